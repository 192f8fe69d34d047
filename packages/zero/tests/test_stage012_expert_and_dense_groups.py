"""Stages 0-2 with expert and dense parameters in one model: one layout per (unit × group).

The model, placements, batches and one-process reference are stage 3's
(`test_stage3_expert_and_dense_groups.py`): four gloo ranks on ``dp=2 × ep=2``, a dense input
and output layer in the root unit and two blocks (units by ``unit_rule``) each holding a dense
``gate`` and ep rank ``e``'s expert; the experts' placements reduce them over ``dp`` only. The
reference holds both experts, averages each dense gradient over 4 ranks and each expert's over
the 2 dp ranks holding it, clips by the norm of the whole gradient (every expert once), then
steps Adam. At every stage 0-2, 5 steps of losses, reported norms and final parameters match,
each block unit is two layouts (dense and ``("dp",)``), and the comms logger shows the experts'
gradient reductions (and at stages 1-2 their all-gathers) over 2 ranks, the dense ones over 4.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_s3 = import_beside(__file__, "test_stage3_expert_and_dense_groups.py")
STAGES = (0, 1, 2)


def _train(mesh: Any, stage: int) -> dict[str, Any]:
    from deepshard.comm import CommsLogger, ParallelDims
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    dims, rank = ParallelDims.from_mesh(mesh), mesh.get_rank()
    model = _s3._local_model(_s3._ep(rank))
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    policy = ZeroPolicy(
        stage=stage, unit_rule=lambda name, _: name.startswith("blocks.") and name.count(".") == 1
    )
    resident = shard(
        model,
        parallel_dims=dims,
        policy=policy,
        placements=_s3._placements(model),
        comms_logger=logger,
    )
    inner = torch.optim.Adam(model.parameters(), lr=_s3.LR)
    zero = ZeroOptimizer(
        inner, resident, config=ZeroConfig(stage=stage), gradient_clipping=_s3.CLIP
    )
    losses, norms = [], []
    for step in range(_s3.STEPS):
        x, y = _s3._batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        zero.backward(loss)
        norms.append(zero.step().grad_norm)
        losses.append(loss.item())
    units = [(u.name, u.reduce_over, u.param_names, u.flat.layout.numel) for u in resident.units]
    records = [(r.op, r.log_name, r.world_size, r.msg_bytes) for r in logger.records]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "units": units, "records": records}


def _all_stages(mesh: Any) -> dict[int, dict[str, Any]]:
    return {stage: _train(mesh, stage) for stage in STAGES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, Any]]]:
    from deepshard.interface import Topology

    return run_on_mesh(
        _all_stages,
        _s3.WORLD,
        topology=Topology(dp=2, ep=2),
        store_dir=tmp_path_factory.mktemp("groups"),
        timeout_s=120,
    )


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    ref: dict[str, Any] = _s3._reference()
    assert min(ref["norms"]) > _s3.CLIP  # clipping acts on every step
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_training_matches_one_process(
    results: list[dict[int, dict[str, Any]]], reference: dict[str, Any], stage: int
) -> None:
    for rank, by_stage in enumerate(results):
        got, expert = by_stage[stage], _s3._ep(rank)
        assert got["losses"] == pytest.approx([s[rank] for s in reference["losses"]], rel=1e-5)
        assert got["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        for name, value in got["params"].items():
            ref_name = name.replace("experts.0.", f"experts.{expert}.")
            torch.testing.assert_close(
                value, reference["params"][ref_name].detach(), rtol=1e-5, atol=1e-6
            )


@pytest.mark.parametrize("stage", STAGES)
def test_expert_layouts_communicate_over_their_group(
    results: list[dict[int, dict[str, Any]]], stage: int
) -> None:
    for by_stage in results:
        got = by_stage[stage]
        layouts = {(name, axes) for name, axes, _, _ in got["units"]}
        for b in range(_s3.BLOCKS):
            assert {(f"blocks.{b}", ()), (f"blocks.{b}", ("dp",))} <= layouts
        expert_names = sorted(n for _, axes, names, _ in got["units"] if axes for n in names)
        assert expert_names == sorted(n for n in got["params"] if ".experts." in n)
        records = got["records"]
        for world, expert in ((2, True), (4, False)):
            sizes = [4 * numel for _, axes, _, numel in got["units"] if bool(axes) == expert]
            # one reduction of every layout per step (CPU: an all-reduce kept sliced) ...
            reduced = [
                b for _, name, w, b in records if name == "zero_all_reduce_grads" and w == world
            ]
            assert sorted(reduced) == sorted(sizes * _s3.STEPS), (stage, world, reduced)
            # ... and at stages 1-2 one all-gather of it after the step
            gathered = [
                b for op, _, w, b in records if op == "all_gather_into_tensor" and w == world
            ]
            assert sorted(gathered) == (sorted(sizes * _s3.STEPS) if stage else []), stage
        # the norm: one 16-byte all-reduce over the dense group per step, every element once
        norm = [(w, b) for _, name, w, b in records if name == "zero_grad_norm"]
        assert norm == [(4, 16)] * _s3.STEPS
