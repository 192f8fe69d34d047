"""A ZeRO checkpoint of a tensor-parallel model loads at other TP and DP sizes.

Four gloo ranks train the test-local TP MLP (`packages/zero/tests/_tp_mlp.py`: column- and
row-parallel Linears, replicated LayerNorm and bias, a per-head scale summed over tp) at
(TP 2, DP 2, ZeRO-1) for `SAVED` AdamW steps and save `ZeroOptimizer.state_shards()` with
`deepshard.checkpoint.save` over the world: under tensor parallelism the maps span dp × tp, so
one checkpoint holds every TP slice. A fresh model built from other weights then loads it at
(TP 1, DP 4, ZeRO-2) and at (TP 4, DP 1, ZeRO-0): its logits equal the reference's after
`SAVED` steps, and `MORE` further steps match the one-process reference step by step (so the
masters, both Adam moments and the step count were restored across the reshape). The
checkpoint consolidated in one process (`load_state_dict_from_checkpoint`, what
``ds-checkpoint export`` reads) holds the full, unsharded weights.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

SAVED, MORE = 3, 2


def _mlp() -> Any:
    """The shared TP MLP helper of the ZeRO tests, loaded by path once per process."""
    path = Path(__file__).resolve().parents[1] / "packages/zero/tests/_tp_mlp.py"
    key = "_deepshard_tp_mlp_integration"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module
        spec.loader.exec_module(module)
    return sys.modules[key]


def _build(mesh: Any, stage: int, seed_shift: float) -> tuple[Any, Any, Any]:
    from deepshard.comm import ParallelDims
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    mlp = _mlp()
    dims = ParallelDims.from_mesh(mesh)
    tp, t = dims.topology.tp, dims.coordinate["tp"]
    model = mlp.local_model(tp, t, dims.tp if tp > 1 else None)
    with torch.no_grad():  # other weights: only a real load gives the reference's
        for param in model.parameters():
            param.add_(seed_shift)
    policy = ZeroPolicy(stage=stage, param_persistence_threshold=0)
    registry = mlp.placements(model, dims.topology)
    sharded = shard(model, parallel_dims=dims, policy=policy, placements=registry)
    inner = torch.optim.AdamW(model.parameters(), lr=mlp.LR)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=stage), gradient_clipping=mlp.CLIP)
    return dims, model, zero


def _train(dims: Any, model: Any, zero: Any, steps: range) -> list[float]:
    mlp = _mlp()
    dp, d = dims.topology.dp, dims.coordinate["dp"]
    losses = []
    for step in steps:
        loss = mlp.loss_of(model, *mlp.dp_rows(mlp.global_batch(step), dp, d))
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    return losses


def _state(zero: Any) -> dict[str, Any]:
    from deepshard.checkpoint import ShardedTensor

    rank = torch.distributed.get_rank()
    return {
        entry.key: ShardedTensor(entry.tensor, entry.shard_map, rank, linear=entry.kind == "master")
        for entry in zero.state_shards()
        if entry.kind != "param"  # the master is the weight; the model copy follows it
    }


def _save(mesh: Any, root: str) -> list[float]:
    from deepshard.checkpoint import save

    dims, model, zero = _build(mesh, stage=1, seed_shift=0.0)
    losses = _train(dims, model, zero, range(SAVED))
    maps = [entry.shard_map for entry in zero.state_shards()]
    assert all(set(m.axes) == {"dp", "ep", "sp", "tp"} for m in maps)
    save(_state(zero), root, tag="tp2dp2")
    return losses


def _load(mesh: Any, root: str, stage: int) -> dict[str, Any]:
    from deepshard.checkpoint import load

    dims, model, zero = _build(mesh, stage=stage, seed_shift=0.25)
    zero.materialize_state()
    like = _state(zero)
    load(
        root, like, tag="tp2dp2", strict=False
    )  # a rank holding none of a tensor lists no moments for it
    zero.load_state_shards({key: value.local for key, value in like.items()})
    x, _ = _mlp().global_batch(0)
    with torch.no_grad():
        logits = model(x)
    losses = _train(dims, model, zero, range(SAVED, SAVED + MORE))
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"logits": logits, "losses": losses, "params": params, **dims.coordinate}


def _mean_over_dp(per_rank: list[list[float]], tp: int) -> list[float]:
    """Each step's loss averaged over the dp ranks (tp peers report the same loss): the loss
    of the whole batch, which is what the reference reports."""
    for rank, losses in enumerate(per_rank):
        assert losses == pytest.approx(per_rank[rank - rank % tp], rel=1e-6)
    firsts = per_rank[::tp]
    return [sum(step) / len(firsts) for step in zip(*firsts, strict=True)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    from deepshard.interface import Topology

    root = tmp_path_factory.mktemp("tp_ckpt")
    losses = run_on_mesh(
        _save,
        4,
        topology=Topology(dp=2, tp=2),
        args=(str(root / "ckpt"),),
        store_dir=root,
        timeout_s=60,
    )
    return root / "ckpt", losses


@pytest.mark.parametrize(("tp", "stage"), [(1, 2), (4, 0)], ids=["tp1-dp4-zero2", "tp4-dp1-zero0"])
def test_tp_checkpoint_loads_at_other_sizes(
    saved: tuple[Path, list[list[float]]], tmp_path: Path, tp: int, stage: int
) -> None:
    from deepshard.interface import Topology

    mlp = _mlp()
    ckpt, saved_losses = saved
    ref_losses, ref_params = mlp.reference_run(SAVED + MORE)
    assert _mean_over_dp(saved_losses, tp=2) == pytest.approx(ref_losses[:SAVED], rel=1e-5)
    per_rank = run_on_mesh(
        _load,
        4,
        topology=Topology(dp=4 // tp, tp=tp),
        args=(str(ckpt), stage),
        store_dir=tmp_path,
        timeout_s=60,
    )
    reference = mlp.full_model()
    reference.load_state_dict(ref_params[SAVED - 1])
    x, _ = mlp.global_batch(0)
    with torch.no_grad():
        want_logits = reference(x)
    losses = _mean_over_dp([got["losses"] for got in per_rank], tp=tp)
    assert losses == pytest.approx(ref_losses[SAVED:], rel=1e-5)
    for got in per_rank:
        torch.testing.assert_close(got["logits"], want_logits, rtol=1e-5, atol=1e-6)
        for name, value in got["params"].items():
            want = mlp.local_slice(name, ref_params[-1][name], tp, got["tp"])
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)


def test_tp_checkpoint_consolidates_to_full_weights(saved: tuple[Path, list[list[float]]]) -> None:
    from deepshard.checkpoint import load_state_dict_from_checkpoint

    mlp = _mlp()
    ckpt, _ = saved
    _, ref_params = mlp.reference_run(SAVED)
    full = load_state_dict_from_checkpoint(ckpt, tag="tp2dp2")
    for name, want in ref_params[-1].items():
        got = full[f"{name}/master"]
        assert tuple(got.shape) == tuple(want.shape), name  # the whole tensor, not a TP slice
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-6, msg=name)
