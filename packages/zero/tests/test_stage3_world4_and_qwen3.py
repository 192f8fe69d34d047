"""Stage 3 at 4 ranks: the odd-sized MLP and a tiny Hugging Face ``Qwen3ForCausalLM`` train like
one process on the whole batch, gradient clipping included.

One ``run_on_mesh`` call with 4 gloo ranks:

* the MLP through `test_stage3_matches_reference.train_stage3` (each ``Linear`` a unit: at 4
  ranks the 1073-element weight spans three partitions), fp32 with accumulation 1 (every unit
  released after use, 200-element reduce-scatters) and 4 (DeepSpeed's defaults), and bf16;
  losses, reported norms and final parameters against `_training.reference` with that test's
  tolerances;
* Qwen3 (units: its ``_no_split_modules`` decoder layers, released after each use so every
  forward and backward re-gathers), AdamW with ``clip_grad_norm_``-style clipping at 0.5, which
  every step triggers: losses, pre-clip norms and final parameters against the same model
  trained in one process with ``torch.nn.utils.clip_grad_norm_`` (parameters: per tensor,
  ``||p - p_ref|| <= 1e-4 · ||p_init - p_ref||``). Every rank takes one of the
  4 sequences (equal lengths, so the mean of the rank losses is the whole batch's loss).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_stage3 = import_beside(__file__, "test_stage3_matches_reference.py")

WORLD = 4
MLP_CONFIGS = [(torch.float32, 1, True), (torch.float32, 4, False), (torch.bfloat16, 1, True)]
QWEN_STEPS, QWEN_LR, QWEN_CLIP, VOCAB = 4, 1e-2, 0.5, 64


def _qwen3() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (WORLD, 8), generator=torch.Generator().manual_seed(step))


def _qwen3_train(group: Any | None) -> dict[str, Any]:
    """AdamW with clipping on the tiny Qwen3: sharded over ``group``, or in one process."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    model = _qwen3()
    inner = torch.optim.AdamW(model.parameters(), lr=QWEN_LR)
    rows, sharded, zero = slice(None), None, None
    if group is not None:
        policy = ZeroPolicy(max_reuse_distance=0, param_persistence_threshold=0)
        sharded = shard(model, group=group, policy=policy)
        zero = ZeroOptimizer(
            inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=QWEN_CLIP
        )
        rows = slice(group.rank(), group.rank() + 1)
    losses, norms = [], []
    for step in range(QWEN_STEPS):
        ids = _tokens(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        if zero is not None:
            zero.backward(loss)
            norms.append(zero.step().grad_norm)
        else:
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), QWEN_CLIP).item())
            inner.step()
            inner.zero_grad()
        losses.append(loss.item())
    if sharded is not None:
        with sharded.gathered():
            params = [p.detach().clone() for p in model.parameters()]
        units = [p.name for p in sharded.plans]
    else:
        params, units = [p.detach().clone() for p in model.parameters()], []
    return {"losses": losses, "norms": norms, "params": params, "units": units}


def _all(mesh: Any) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    out: dict[Any, Any] = {
        config: _stage3.train_stage3(
            group,
            rank,
            WORLD,
            ga=config[1],
            dtype=config[0],
            policy=_stage3.EAGER if config[2] else {},
        )
        for config in MLP_CONFIGS
    }
    out["qwen3"] = _qwen3_train(mesh["dp"].get_group())
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
def test_stage3_at_four_ranks_matches_one_process(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_all, WORLD, store_dir=tmp_path, timeout_s=240)
    refs = {dtype: _training.reference(dtype) for dtype in (torch.float32, torch.bfloat16)}
    assert max(refs[torch.float32]["norms"]) > _training.CLIP  # clipping is exercised
    for config in MLP_CONFIGS:
        dtype = config[0]
        results = [r[config] for r in per_rank]
        for other in results[1:]:
            for a, b in zip(other["params"], results[0]["params"], strict=True):
                assert torch.equal(a, b), f"ranks disagree for {config}"
        steps = len(results[0]["losses"])
        losses = torch.tensor([sum(r["losses"][i] for r in results) / WORLD for i in range(steps)])
        ref = refs[dtype]
        tol = 1e-5 if dtype == torch.float32 else 2 * _stage3.BF16_U
        assert _rel(losses, torch.tensor(ref["losses"])) < tol, config
        assert _rel(torch.tensor(results[0]["norms"]), torch.tensor(ref["norms"])) < tol, config
        if dtype == torch.float32:
            for got, want in zip(results[0]["params"], ref["params"], strict=True):
                assert _rel(got, want) < 1e-5, config
        else:
            init = _training.initial_params(dtype)
            assert _stage3._update_error(results[0]["params"], ref["params"], init) < 0.1, config

    ref = _qwen3_train(None)
    assert min(ref["norms"]) > QWEN_CLIP  # every step is clipped
    qwen = [r["qwen3"] for r in per_rank]
    initial = [p.detach() for p in _qwen3().parameters()]
    assert qwen[0]["units"] == ["", "model.layers.0", "model.layers.1"]
    losses = [sum(q["losses"][i] for q in qwen) / WORLD for i in range(QWEN_STEPS)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for q in qwen:
        torch.testing.assert_close(
            torch.tensor(q["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0
        )
        for got, want, init in zip(q["params"], ref["params"], initial, strict=True):
            # per tensor, the distance to the reference against how far training moved it:
            # Adam turns the last-ulp reduction-order differences of a near-zero gradient into
            # a visible step of that one element, so elementwise bounds would be arbitrary
            assert float((got - want).norm() / (init - want).norm()) < 1e-4
