"""A reduction group of one rank: ZeRO 0-2 issue no gradient or parameter collective there.

Under pure tensor parallelism (TP = 2, DP = 1 on 2 gloo ranks) every TP slice is its own ZeRO
problem over a one-rank data-parallel group, and in a world of one the group is the world.
There is nothing to combine, so the stores skip the bucket copies and the collectives
(`deepshard.zero._gradients`, ``GradientStore.solo``). These tests check that the comms logger
records none of ZeRO's gradient reductions or parameter all-gathers (only tensor parallelism's
own collectives over the 2 tp ranks), and that training still gives the one-process reference:
the losses, the clipped gradient norm and every parameter (TP slices of the reference's). In a
world of one they also check gradient accumulation over two micro-steps, a skipped overflow
step (parameters untouched, norm not finite), and that stages 0, 1 and 2 in bf16 agree
bit for bit (the same accumulation and step arithmetic, whatever the stage partitions).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

_mlp = import_beside(__file__, "_tp_mlp.py")

STAGES = (0, 1, 2)
ZERO_COLLECTIVES = {"zero_all_reduce_grads", "zero_reduce_scatter_grads", "zero_all_gather_params"}


def _zero(model: torch.nn.Module, dims: Any, stage: int, registry: Any = None) -> Any:
    from deepshard.comm import CommsLogger
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    policy = ZeroPolicy(stage=stage)
    sharded = shard(
        model, parallel_dims=dims, policy=policy, placements=registry, comms_logger=logger
    )
    inner = torch.optim.AdamW(model.parameters(), lr=_mlp.LR)
    zero = ZeroOptimizer(
        inner, sharded, config=ZeroConfig(stage=stage), gradient_clipping=_mlp.CLIP
    )
    return zero, logger


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _train_tp(mesh: Any, stage: int) -> dict[str, Any]:
    from deepshard.comm import ParallelDims

    dims = ParallelDims.from_mesh(mesh)
    tp_rank = dims.coordinate["tp"]
    model = _mlp.local_model(2, tp_rank, dims.tp)
    zero, logger = _zero(model, dims, stage, _mlp.placements(model, dims.topology))
    losses, norms = [], []
    for step in range(_mlp.STEPS):
        loss = _mlp.loss_of(model, *_mlp.batch(step, 0))
        zero.backward(loss)
        norms.append(zero.step().grad_norm)
        losses.append(loss.item())
    records = {(r.log_name, r.world_size) for r in logger.records}
    return {
        "losses": losses,
        "norms": norms,
        "params": _params(model),
        "tp": tp_rank,
        "records": records,
    }


def _tp_runs(mesh: Any) -> list[dict[str, Any]]:
    return [_train_tp(mesh, stage) for stage in STAGES]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    from deepshard.interface import Topology

    store = tmp_path_factory.mktemp("tp_solo")
    return run_on_mesh(_tp_runs, 2, topology=Topology(tp=2), store_dir=store, timeout_s=60)


@pytest.mark.parametrize("stage", STAGES)
def test_tp2_dp1_matches_reference_without_zero_collectives(
    tp_results: list[list[dict[str, Any]]], stage: int
) -> None:
    ref = _mlp.reference(1)
    assert min(ref["norms"]) > _mlp.CLIP  # clipping acts on every step
    for rank_runs in tp_results:
        got = rank_runs[STAGES.index(stage)]
        assert got["losses"] == pytest.approx([s[0] for s in ref["losses"]], rel=1e-5)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for name, value in got["params"].items():
            want = _mlp.local_slice(name, ref["params"][name], 2, got["tp"])
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)
        names = {name for name, _ in got["records"]}
        assert not names & ZERO_COLLECTIVES, got["records"]
        assert "zero_grad_norm_tp" in names  # the norm still combines over tp
        assert {world for _, world in got["records"]} == {2}


def _train_world1(mesh: Any, stage: int, dtype_name: str) -> dict[str, Any]:
    from deepshard.comm import ParallelDims

    dims = ParallelDims.from_mesh(mesh)
    model = _mlp.full_model().to(getattr(torch, dtype_name))
    zero, logger = _zero(model, dims, stage)
    losses, norms, overflows = [], [], []
    for step in range(_mlp.STEPS):
        zero.set_boundary(False)
        for micro in range(2):
            x, y = _mlp.batch(step, micro)
            if step == 2:  # an overflow step: the optimizer must skip it
                x = torch.full_like(x, math.inf)
            zero.set_boundary(micro == 1)
            loss = _mlp.loss_of(model, x, y) / 2
            loss.backward()
        before = _params(model)
        result = zero.step()
        overflows.append(result.overflow)
        norms.append(result.grad_norm)
        losses.append(loss.item())
        if result.overflow:
            after = _params(model)
            assert all(torch.equal(after[n], v) for n, v in before.items())
    records = [r.log_name for r in logger.records]
    return {"norms": norms, "overflows": overflows, "params": _params(model), "records": records}


def _reference_accumulated() -> dict[str, Any]:
    """One process, plain PyTorch: two half-weighted micro-batches per step, step 2 skipped."""
    model = _mlp.full_model()
    inner = torch.optim.AdamW(model.parameters(), lr=_mlp.LR)
    norms = []
    for step in range(_mlp.STEPS):
        if step == 2:
            norms.append(math.inf)
            continue
        for micro in range(2):
            (_mlp.loss_of(model, *_mlp.batch(step, micro)) / 2).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), _mlp.CLIP).item())
        inner.step()
        inner.zero_grad()
    return {"norms": norms, "params": _params(model)}


RUNS_WORLD1 = tuple((s, "float32") for s in STAGES) + tuple((s, "bfloat16") for s in STAGES)


def _world1_runs(mesh: Any) -> list[dict[str, Any]]:
    return [_train_world1(mesh, stage, dtype) for stage, dtype in RUNS_WORLD1]


@pytest.fixture(scope="module")
def world1_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("world1_solo")
    return run_on_mesh(_world1_runs, 1, store_dir=store, timeout_s=60)[0]


@pytest.mark.parametrize("stage", STAGES)
def test_world1_accumulation_and_overflow_match_reference(
    world1_results: list[dict[str, Any]], stage: int
) -> None:
    ref = _reference_accumulated()
    got = world1_results[STAGES.index(stage)]
    assert got["overflows"] == [step == 2 for step in range(_mlp.STEPS)]
    assert not math.isfinite(got["norms"][2])
    kept = [n for i, n in enumerate(ref["norms"]) if i != 2]
    assert [n for i, n in enumerate(got["norms"]) if i != 2] == pytest.approx(kept, rel=1e-5)
    for name, value in got["params"].items():
        torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert not set(got["records"]) & ZERO_COLLECTIVES, got["records"]


def test_world1_bf16_stages_agree_bit_for_bit(world1_results: list[dict[str, Any]]) -> None:
    runs = world1_results[len(STAGES) :]
    for got in runs[1:]:
        assert got["overflows"] == runs[0]["overflows"]
        assert got["norms"][:2] + got["norms"][3:] == runs[0]["norms"][:2] + runs[0]["norms"][3:]
        for name, value in got["params"].items():
            assert torch.equal(value, runs[0]["params"][name]), name
        assert not set(got["records"]) & ZERO_COLLECTIVES
    ref = _reference_accumulated()
    assert runs[0]["norms"][0] == pytest.approx(ref["norms"][0], rel=2e-2)
