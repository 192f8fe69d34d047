"""``sequence_parallel_size: 2`` through ``initialize`` trains a tiny Llama like one process.

Cases: 2 ranks (sp 2, ZeRO stage 0, plain and with the tiled MLP and tiled logits-loss of the
``sequence_parallel`` section, 3 slices each) and 4 ranks (dp 2 × sp 2, ZeRO stages 2 and 3,
both tiled too), fp32, AdamW, gradient clipping at 0.5, `STEPS` steps. Each data-parallel
replica reads two rows of 32 tokens; each sequence-parallel rank feeds 16 of them
(`UlyssesDataLoaderAdapter`). Labels are masked so that the shards hold very different numbers
of valid tokens (one shard none).

The single-process reference runs the same model on whole sequences: per step, the mean over
the data-parallel replicas of each replica's token-mean loss (what data parallelism
optimises), ``clip_grad_norm_`` and ``torch.optim.AdamW``. Per-step losses and the final
weights must agree to 1e-5 relative (fp32; only the summation order differs). The tiled
cases train with SGD and momentum instead of AdamW: tiling sums each parameter's gradient over
three slices, a few ulps off the untiled sum (measured: 4e-7 relative after one step, tiled
against untiled in one process), and Adam's per-element normalisation turns that into 7.5e-5
after five steps for elements whose gradient is near zero, in one process already; SGD is
linear in the gradient, so the same comparison stays at 2e-7.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

STEPS = 5
SEQ = 32
ROWS = 2  # per data-parallel replica
VOCAB = 64
LR = 1e-2
SGD_LR = 0.5
EPS = 1e-3
"""Adam's ``eps``. With torch's 1e-8, Adam's ``g / (|g| + eps)`` turns the rounding of a
near-zero gradient element into an update of up to ``lr``: measured at sp 2, ZeRO-0 (after
ZeRO's buckets changed their summation order), an element whose reference gradient was 5e-9
put ``gate_proj`` 2.6e-5 relative off after five steps; with 1e-3 every parameter stays
within 2e-7. A rounding error ``δ`` then moves an update by at most ``lr · δ / eps``."""
CLIP = 0.5


def _llama() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _replica_batch(step: int, replica: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + replica)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=gen)
    labels = ids.clone()
    cut = int(torch.randint(SEQ // 2, SEQ - 2, (1,), generator=gen))
    labels[0, :cut] = -100  # the first half-sequence of row 0 has no valid label
    labels[1, SEQ - 3 - step :] = -100
    return {"input_ids": ids, "labels": labels}


TILED = {
    "tiled_mlp": True,
    "tiled_mlp_shards": 3,
    "tiled_logits_loss": True,
    "tiled_logits_shards": 3,
}


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


def _config(stage: int, dp: int, tiled: bool) -> dict[str, Any]:
    optimizer = {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "torch_adam": True}}
    return {
        "sequence_parallel": TILED if tiled else {},
        "zero_allow_untested_optimizer": tiled,
        "train_batch_size": ROWS * dp,
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": CLIP,
        "sequence_parallel_size": 2,
        **({} if tiled else {"optimizer": optimizer}),
        "zero_optimization": {"stage": stage},
    }


def _train(mesh: Any, cases: list[tuple[int, bool]]) -> dict[Any, Any]:
    import deepshard.engine as ds
    from deepshard.comm import ParallelDims
    from deepshard.sequence_parallel import UlyssesDataLoaderAdapter

    dims = ParallelDims.from_mesh(mesh)
    results = {}
    for stage, tiled in cases:
        config = _config(stage, dims.batch_world_size, tiled)
        engine, _, _, _ = ds.initialize(
            _llama(), config, optimizer=_sgd if tiled else None, mesh=dims
        )
        batches = [_replica_batch(step, dims.batch_rank) for step in range(STEPS)]
        losses = []
        for batch in UlyssesDataLoaderAdapter(batches, parallel_dims=dims):
            assert batch["input_ids"].shape == (ROWS, SEQ // 2)
            out = engine(**batch)
            assert (out.logits is None) == tiled  # the tiled loss never makes the logits
            losses.append(engine.backward(out.loss).item())
            engine.step()
        state = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
        results[(stage, tiled)] = {"losses": losses, "state": state}
    if dims.batch_world_size == 1:
        results["extras"] = _engine_extras(dims)
    return results


def _engine_extras(dims: Any) -> dict[str, Any]:
    """The loader ``initialize`` builds yields shards; a model Ulysses cannot wrap is refused."""
    import deepshard.engine as ds
    from deepshard.interface.errors import ConfigError

    samples = [{k: v[0] for k, v in _replica_batch(s, 0).items()} for s in range(2)]
    config = _config(0, 1, False) | {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1}
    _, _, loader, _ = ds.initialize(_llama(), config, training_data=samples, mesh=dims)
    shapes = [tuple(batch["input_ids"].shape) for batch in loader]
    try:
        ds.initialize(torch.nn.Linear(2, 2), config, mesh=dims)
        refusal = "accepted"
    except ConfigError as exc:
        refusal = str(exc)
    return {"loader": type(loader).__name__, "shapes": shapes, "refusal": refusal}


def _reference(dp: int, sgd: bool) -> dict[str, Any]:
    model = _llama()
    opt = _sgd(model.parameters()) if sgd else torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        loss = sum(model(**_replica_batch(step, r)).loss for r in range(dp)) / dp
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": model.state_dict()}


def _check(per_rank: list[dict[str, Any]], ref: dict[str, Any], what: str) -> None:
    losses = torch.tensor([r["losses"] for r in per_rank], dtype=torch.float64).mean(0)
    expected = torch.tensor(ref["losses"], dtype=torch.float64)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0.0, msg=f"{what}: losses")
    for name, value in ref["state"].items():
        if not value.is_floating_point():
            continue
        error = float((per_rank[0]["state"][name] - value).norm() / value.norm())
        assert error <= 1e-5, f"{what}: {name} off by {error:.3g} relative"


@pytest.mark.parametrize(
    ("world", "cases"),
    [(2, [(0, False), (0, True)]), (4, [(2, False), (3, False), (2, True), (3, True)])],
)
def test_sequence_parallel_training_matches_one_process(
    world: int, cases: list[tuple[int, bool]], tmp_path: Path
) -> None:
    topology = Topology(dp=world // 2, sp=2)
    results = run_on_mesh(
        _train, world, topology=topology, args=(cases,), store_dir=tmp_path, timeout_s=300
    )
    if world == 2:
        extras = results[0]["extras"]
        assert extras["loader"] == "UlyssesDataLoaderAdapter"
        assert extras["shapes"] == [(1, SEQ // 2), (1, SEQ // 2)]
        assert extras["refusal"].startswith("sequence_parallel_size: apply_ulysses needs")
    initial = _llama().state_dict()
    for case in cases:
        ref = _reference(topology.dp, sgd=case[1])
        moved = max(float((ref["state"][n] - v).norm()) for n, v in initial.items())
        assert moved > 1e-3, "the reference must train for the comparison to bite"
        _check([r[case] for r in results], ref, f"world {world} (stage, tiled) {case}")
