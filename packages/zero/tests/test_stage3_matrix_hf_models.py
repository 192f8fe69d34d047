"""The stage-3 equivalence matrix where the other stage-3 tests leave holes: tiny Hugging Face
``LlamaForCausalLM`` (tied embeddings) under `deepshard.zero.Init`, Llama and ``Qwen3ForCausalLM``
with optimizer and parameter offload, 20-step runs per model, and stage 3 against stage 1.

One 2-rank ``run_on_mesh`` call trains every configuration in `RUNS` (model × how it is
partitioned × offload × dtype × accumulation × steps) and, on Llama, stage 1; the test computes
the single-process reference of each (model, dtype, steps) itself: AdamW over two param groups
(weights decay, the rest not) on fp32 masters, an LR schedule and ``clip_grad_norm_`` at
`_training.CLIP`, the model run in its dtype (`_training.reference`'s recipe, for any model).

How the Init runs get the reference's weights: Hugging Face's ``post_init`` re-initialises the
weights in place while the model is built, and under ``Init`` the parameters are already
partitioned there (empty ``.data``), so a Llama built under ``Init`` keeps torch's module
defaults, not the seed's Hugging Face weights. ``init-module`` therefore partitions a model built
normally (``Init(module=model)``); ``init-build`` builds it under ``Init`` (never whole on a
rank) and loads the reference's weights inside ``GatheredParameters(modifier_rank=0)`` on rank 0
only, so the broadcast of rank 0's change is what the other rank trains with. The odd-sized MLP
(no ``post_init``) is built under ``Init`` directly and must need no such help.

The 20-step runs are fp32: over 20 bf16 steps the trajectories of any two data-parallel runs
part (rounding the updated masters to bf16 flips last bits that the next steps amplify; stage 1
reported norms up to 9% off the reference's on Qwen3, stage 3 with and without offload alike),
so the bf16 tolerances below hold only for short runs, which is where the other tests use them.
The param groups are chosen by name (`param_groups`): under stage 3 a parameter's own
``dim()`` is that of its empty ``.data``.

Tolerances are the existing stage-3 tests': fp32 losses and reported norms 1e-5 relative and
parameters, per tensor, ``||p - p_ref|| <= 1e-4 · ||p_init - p_ref||`` (the Qwen3 test's: Adam
turns last-ulp reduction-order differences of near-zero gradients into visible steps of single
elements); bf16 losses and norms ``2·2⁻⁸`` relative and the update error of
`test_stage3_matches_reference` below 0.1.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_stage3 = import_beside(__file__, "test_stage3_matches_reference.py")

WORLD, VOCAB, SEQ, SEQS = 2, 128, 8, 8
F32, BF16 = torch.float32, torch.bfloat16
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0}
# (model, partitioning, optimizer offload, parameter offload, dtype, accumulation, steps)
RUNS = [
    ("llama", "init-module", "none", "none", F32, 1, 20),
    ("llama", "init-build", "none", "none", BF16, 4, 5),
    ("llama", "shard", "cpu", "cpu", BF16, 4, 5),
    ("llama", "shard", "nvme", "nvme", BF16, 4, 5),
    ("qwen3", "shard", "cpu", "cpu", BF16, 4, 5),
    ("qwen3", "shard", "nvme", "nvme", BF16, 4, 5),
    ("qwen3", "init-module", "cpu", "none", F32, 4, 20),
    ("mlp", "init-build", "none", "none", F32, 4, 20),
]
# stage 1 on Llama, compared with the stage-3 runs of the same (dtype, accumulation, steps)
STAGE1 = [(F32, 1, 20), (BF16, 4, 5)]


def make(name: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model ``name`` with its seed-0 weights, in ``dtype``."""
    if name == "mlp":
        return _training.make_model(dtype)
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
    }
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **shape)).to(dtype)
    return Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=False, head_dim=8, **shape)).to(dtype)


def batch(name: str, step: int) -> Any:
    """The global batch of ``step``: MLP inputs and targets, or `SEQS` token sequences."""
    if name == "mlp":
        return _training.batch(step)
    return torch.randint(0, VOCAB, (SEQS, SEQ), generator=torch.Generator().manual_seed(step))


def micro(name: str, data: Any, m: int, rank: int, ga: int) -> Any:
    """Rank ``rank``'s rows of micro-step ``m`` (the ranks together see the whole batch)."""
    rows = (_training.GLOBAL_BATCH if name == "mlp" else SEQS) // (WORLD * ga)
    cut = slice((m * WORLD + rank) * rows, (m * WORLD + rank + 1) * rows)
    return (data[0][cut], data[1][cut]) if name == "mlp" else data[cut]


def loss_of(name: str, model: torch.nn.Module, data: Any) -> torch.Tensor:
    """The fp32 loss (equal-length sequences: the mean of equal parts is the whole's mean)."""
    if name == "mlp":
        return _training.loss_fn(model, *data)
    return model(input_ids=data, labels=data).loss.float()


def param_groups(name: str, model: torch.nn.Module) -> list[dict[str, Any]]:
    """`_training.param_groups` chosen by parameter name: a partitioned parameter's ``.data``
    is empty (``dim() == 1``), so its own shape cannot say whether it decays."""
    decays = {n for n, p in make(name, F32).named_parameters() if p.dim() > 1}
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decays], "weight_decay": _training.WEIGHT_DECAY},
        {"params": [p for n, p in named if n not in decays], "weight_decay": 0.0},
    ]


def reference(name: str, dtype: torch.dtype, steps: int) -> dict[str, Any]:
    """One process, the whole batch: AdamW + ``clip_grad_norm_`` on fp32 masters."""
    model = make(name, dtype)
    params = list(model.parameters())
    masters = params if dtype == F32 else [p.detach().float() for p in params]
    groups = param_groups(name, model)
    by_id = {id(p): m for p, m in zip(params, masters, strict=True)}
    for group in groups:
        group["params"] = [by_id[id(p)] for p in group["params"]]
    inner = torch.optim.AdamW(groups, lr=_training.LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, _training.lr_factor)
    losses, norms = [], []
    for step in range(steps):
        model.zero_grad()
        loss = loss_of(name, model, batch(name, step))
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(masters, _training.CLIP).item())
        inner.step()
        scheduler.step()
        with torch.no_grad():
            for master, param in zip(masters, params, strict=True):
                param.copy_(master)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": [p.detach().float() for p in params]}


def _offload(device: str, root: str) -> dict[str, Any] | None:
    if device == "none":
        return None
    if device == "cpu":
        return {"device": "cpu", "pin_memory": True}
    return {"device": "nvme", "nvme_path": root}


def _partitioned(mesh: Any, run: tuple[Any, ...], root: str) -> tuple[Any, Any, Any]:
    """The model of ``run`` partitioned as it says, and its stage-3 `ZeroOptimizer`."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import GatheredParameters, Init, ZeroOptimizer, ZeroPolicy, shard

    name, how, opt, par, dtype = run[:5]
    config = ZeroConfig(
        stage=3,
        sub_group_size=2000,
        offload_optimizer=_offload(opt, root),
        offload_param=_offload(par, root),
        **EAGER,
    )
    policy = ZeroPolicy.from_config(config)
    if how == "shard":
        model = make(name, dtype)
        sharded = shard(model, group=mesh["dp"], policy=policy)
    elif how == "init-module":
        model = make(name, dtype)
        sharded = Init(module=model, mesh=mesh, policy=policy).sharded[0]
    else:
        with Init(mesh=mesh, dtype=dtype, policy=policy) as init:
            model = make(name, F32)  # Init casts to ``dtype`` while partitioning
        sharded = init.sharded[0]
        if name != "mlp":  # post_init ran on empty partitions: load the seed's weights
            wanted = list(make(name, dtype).parameters())
            with GatheredParameters(list(model.parameters()), modifier_rank=0):
                if mesh.get_rank() == 0:
                    with torch.no_grad():
                        for param, value in zip(model.parameters(), wanted, strict=True):
                            param.copy_(value)
    inner = torch.optim.AdamW(param_groups(name, model), lr=_training.LR)
    zero = ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    return model, sharded, zero


def _stage1(mesh: Any, dtype: torch.dtype) -> tuple[Any, None, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = make("llama", dtype)
    inner = torch.optim.AdamW(param_groups("llama", model), lr=_training.LR)
    zero = ZeroOptimizer(
        inner,
        group=mesh["dp"],
        config=ZeroConfig(stage=1),
        gradient_clipping=_training.CLIP,
        named_parameters=model.named_parameters(),
    )
    return model, None, zero


def _train(
    name: str, built: tuple[Any, Any, Any], rank: int, ga: int, steps: int
) -> dict[str, Any]:
    """The engine's loop: ``ga`` micro-steps per step, one `ZeroOptimizer.step`, the schedule."""
    model, sharded, zero = built
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, _training.lr_factor)
    losses, norms = [], []
    for step in range(steps):
        data = batch(name, step)
        total = 0.0
        for m in range(ga):
            loss = loss_of(name, model, micro(name, data, m, rank, ga)) / ga
            zero.backward(loss, is_boundary=m == ga - 1)
            total += loss.item()
        result = zero.step()
        scheduler.step()
        losses.append(total)
        norms.append(result.grad_norm)
    with sharded.gathered() if sharded is not None else contextlib.nullcontext():
        params = [p.detach().float().clone() for p in model.parameters()]
    tied = name == "llama" and model.lm_head.weight is model.model.embed_tokens.weight
    return {"losses": losses, "norms": norms, "params": params, "tied": tied}


def _train_all(mesh: Any, root: str) -> dict[Any, Any]:
    rank = mesh.get_rank()
    out: dict[Any, Any] = {}
    for run in RUNS:
        built = _partitioned(mesh, run, root)
        out[run] = _train(run[0], built, rank, run[5], run[6])
        built[2].close()
    for dtype, ga, steps in STAGE1:
        out[("stage1", dtype, ga, steps)] = _train("llama", _stage1(mesh, dtype), rank, ga, steps)
    return out


def _merged(per_rank: list[dict[Any, Any]], key: Any) -> dict[str, Any]:
    results = [r[key] for r in per_rank]
    for other in results[1:]:
        for a, b in zip(other["params"], results[0]["params"], strict=True):
            assert torch.equal(a, b), f"ranks disagree for {key}"
    steps = len(results[0]["losses"])
    losses = [sum(r["losses"][i] for r in results) / WORLD for i in range(steps)]
    return {"losses": losses, "norms": results[0]["norms"], "params": results[0]["params"]}


def _check(
    got: dict[str, Any],
    want: dict[str, Any],
    dtype: torch.dtype,
    init: list[torch.Tensor],
    key: Any,
) -> None:
    tol = 1e-5 if dtype == F32 else 2 * _stage3.BF16_U
    assert len(got["losses"]) == len(want["losses"]), key
    assert _stage3._rel(torch.tensor(got["losses"]), torch.tensor(want["losses"])) < tol, key
    assert _stage3._rel(torch.tensor(got["norms"]), torch.tensor(want["norms"])) < tol, key
    if dtype == F32:
        for p, r, i in zip(got["params"], want["params"], init, strict=True):
            assert float((p - r).norm()) <= 1e-4 * float((i - r).norm()), key
    else:
        assert _stage3._update_error(got["params"], want["params"], init) < 0.1, key


@pytest.mark.slow
def test_stage3_matrix_llama_qwen3_init_offload_and_stage1(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train_all, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    refs: dict[Any, dict[str, Any]] = {}
    for run in RUNS:
        name, dtype, steps = run[0], run[4], run[6]
        if (name, dtype, steps) not in refs:
            refs[(name, dtype, steps)] = reference(name, dtype, steps)
        ref = refs[(name, dtype, steps)]
        assert max(ref["norms"]) > _training.CLIP, run  # clipping is exercised
        init = [p.detach().float() for p in make(name, dtype).parameters()]
        _check(_merged(per_rank, run), ref, dtype, init, run)
        assert all(r[run]["tied"] for r in per_rank) == (name == "llama"), run
    for dtype, ga, steps in STAGE1:  # stage 1 matches the reference and stage 3
        key = ("stage1", dtype, ga, steps)
        init = [p.detach().float() for p in make("llama", dtype).parameters()]
        stage1 = _merged(per_rank, key)
        _check(stage1, refs[("llama", dtype, steps)], dtype, init, key)
        for run in (r for r in RUNS if r[0] == "llama" and r[4:] == (dtype, ga, steps)):
            _check(_merged(per_rank, run), stage1, dtype, init, (key, run))
    assert list(root.iterdir()) == []  # the nvme runs' files are gone after close()
