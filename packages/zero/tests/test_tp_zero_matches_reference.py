"""Tensor parallelism × ZeRO 0-3: TP = 2 × DP = 2 on 4 gloo ranks against one process.

The test-local TP MLP (`_tp_mlp.py`: a column-parallel and a row-parallel Linear, a replicated
LayerNorm and row bias, and a per-head ``scale`` whose gradient is a partial sum over tp) is
sharded by ZeRO at every stage over its dense data-parallel group (``dp``, never ``tp``), with
the placements built by hand. Five AdamW steps with clipping 1.0 (active on every step) must
give the reference's losses, the reference's gradient norm (replicated parameters counted
once: the norm a double count would give is asserted to be far outside the tolerance), and
every parameter equal to the matching slice of the reference. bf16 runs (stages 1 and 3) check
the norm and losses at bf16 accuracy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_mlp = import_beside(__file__, "_tp_mlp.py")

TP, DP = 2, 2
RUNS = ((0, "float32"), (1, "float32"), (2, "float32"), (3, "float32"))
BF16_RUNS = ((1, "bfloat16"), (3, "bfloat16"))


def _train(mesh: Any, stage: int, dtype_name: str) -> dict[str, Any]:
    from deepshard.comm import CommsLogger, ParallelDims
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    dims = ParallelDims.from_mesh(mesh)
    coords = dims.coordinate
    dtype = getattr(torch, dtype_name)
    model = _mlp.local_model(TP, coords["tp"], dims.tp, dtype)
    registry = _mlp.placements(model, dims.topology)
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    policy = ZeroPolicy(stage=stage, param_persistence_threshold=0)
    sharded = shard(
        model, parallel_dims=dims, policy=policy, placements=registry, comms_logger=logger
    )
    inner = torch.optim.AdamW(model.parameters(), lr=_mlp.LR)
    zero = ZeroOptimizer(
        inner, sharded, config=ZeroConfig(stage=stage), gradient_clipping=_mlp.CLIP
    )
    losses, norms = [], []
    for step in range(_mlp.STEPS):
        loss = _mlp.loss_of(model, *_mlp.batch(step, coords["dp"]))
        zero.backward(loss)
        norms.append(zero.step().grad_norm)
        losses.append(loss.item())
    gathered = sharded.gathered() if stage == 3 else torch.no_grad()
    with gathered:  # type: ignore[attr-defined]
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    worlds = {(r.op, r.world_size) for r in logger.records}
    return {"losses": losses, "norms": norms, "params": params, "worlds": worlds, **coords}


def _runs(mesh: Any, runs: tuple[tuple[int, str], ...]) -> list[dict[str, Any]]:
    return [_train(mesh, stage, dtype) for stage, dtype in runs]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    from deepshard.interface import Topology

    store = tmp_path_factory.mktemp("tp_zero")
    return run_on_mesh(
        _runs,
        TP * DP,
        topology=Topology(dp=DP, tp=TP),
        args=(RUNS + BF16_RUNS,),
        store_dir=store,
        timeout_s=100,
    )


@pytest.mark.parametrize("run", range(len(RUNS)), ids=[f"zero{s}" for s, _ in RUNS])
def test_tp2_zero_matches_one_process(results: list[list[dict[str, Any]]], run: int) -> None:
    ref = _mlp.reference(DP)
    assert min(ref["norms"]) > _mlp.CLIP  # clipping acts on every step
    for rank_runs in results:
        got = rank_runs[run]
        assert got["losses"] == pytest.approx([s[got["dp"]] for s in ref["losses"]], rel=1e-5)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for name, value in got["params"].items():
            want = _mlp.local_slice(name, ref["params"][name], TP, got["tp"])
            torch.testing.assert_close(value, want, rtol=1e-5, atol=1e-6, msg=name)
        # ZeRO's collectives run over the 2 dp ranks; only tp's own (the layers' all-reduces,
        # the partial sum and the norm's second step) over the 2 tp ranks: never 4.
        assert {w for _, w in got["worlds"]} <= {2}


def test_replicated_params_are_counted_once() -> None:
    """A double count of the replicated parameters would move the norm far beyond 1e-5."""
    ref = _mlp.reference(DP)
    for norm, doubled in zip(ref["norms"], ref["doubled"], strict=True):
        assert doubled > norm * 1.05


@pytest.mark.parametrize("run", range(len(BF16_RUNS)), ids=[f"zero{s}" for s, _ in BF16_RUNS])
def test_tp2_zero_bf16_norm(results: list[list[dict[str, Any]]], run: int) -> None:
    ref = _mlp.reference(DP, steps=1)
    for rank_runs in results:
        got = rank_runs[len(RUNS) + run]
        assert got["norms"][0] == pytest.approx(ref["norms"][0], rel=2e-2)
        assert abs(got["norms"][0] - ref["norms"][0]) < (ref["doubled"][0] - ref["norms"][0]) / 2
        assert got["losses"][0] == pytest.approx(ref["losses"][0][got["dp"]], rel=2e-2)
        # every tp rank of a dp rank reports the same norm and the same loss
    norms = {round(r[len(RUNS) + run]["norms"][-1], 6) for r in results}
    assert len(norms) == 1
