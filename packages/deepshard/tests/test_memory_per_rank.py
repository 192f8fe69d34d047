"""ZeRO's memory savings, counted in tensor bytes per rank through ``engine.memory_bytes()``.

One ``run_on_mesh`` call on 4 ranks trains the tiny Llama for two steps at each ZeRO stage
(fp32, AdamW) and reads the engine's byte counts after the second step's backward pass:

* optimizer state (AdamW's two moments) and fp32 master weights per rank are about a quarter
  of stage 0's at stages 1 and 2, and the four ranks together hold what one stage-0 rank holds
  (for the masters: the fp32 parameters, which stage 0 steps in place, keeping no second copy);
* gradient storage per rank is about a quarter of stage 0's at stage 2 only (stage 1 still
  accumulates full gradients).

"About": the flat buffers are padded (16-byte alignment per parameter, the buffer to a multiple
of 4 × 16 bytes), which is well under 1 % of this model. Process memory (RSS) is not used: it
counts the allocator, the interpreter and the libraries, not what ZeRO partitions.
"""

from __future__ import annotations

from typing import Any

import pytest

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
WORLD = 4


def _bytes_after_backward(mesh: Any, stage: int) -> dict[str, int]:
    import torch

    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_llama()
    config = _models.engine_config(stage=stage, precision="fp32", ga=1)
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    for step in range(2):
        rows = _models.micro_batch(_models.llama_batch(step), micro=0, rank=rank, world=world, ga=1)
        engine.backward(_models.llama_loss(engine, rows, torch.float32))
        if step == 1:
            counts = engine.memory_bytes()
        engine.step()
    return {
        "parameters": counts.parameters,
        "gradients": counts.gradients,
        "master_weights": counts.master_weights,
        "optimizer_state": counts.optimizer_state,
    }


def _all_stages(mesh: Any) -> dict[int, dict[str, int]]:
    return {stage: _bytes_after_backward(mesh, stage) for stage in (0, 1, 2)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, dict[str, int]]]:
    return run_on_mesh(_all_stages, WORLD, store_dir=tmp_path_factory.mktemp("mem"), timeout_s=180)


def _about_a_quarter(part: int, whole: int) -> bool:
    return abs(part * WORLD - whole) <= 0.01 * whole


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("kind", ["optimizer_state", "master_weights"])
def test_optimizer_state_and_masters_are_partitioned(
    results: list[dict[int, dict[str, int]]], stage: int, kind: str
) -> None:
    whole = results[0][0][kind]
    if kind == "master_weights":  # stage 0 steps an fp32 model's parameters in place
        assert whole == 0
        whole = results[0][0]["parameters"]  # what a whole fp32 master holds
    assert whole > 0
    per_rank = [r[stage][kind] for r in results]
    assert all(_about_a_quarter(part, whole) for part in per_rank), (per_rank, whole)
    assert abs(sum(per_rank) - whole) <= 0.01 * whole


def test_gradients_are_partitioned_at_stage_2_only(
    results: list[dict[int, dict[str, int]]],
) -> None:
    whole = results[0][0]["gradients"]
    params = results[0][0]["parameters"]
    assert abs(whole - params) <= 0.01 * params  # stage 0: one full fp32 gradient buffer
    assert all(_about_a_quarter(r[2]["gradients"], whole) for r in results)
    assert all(r[1]["gradients"] >= whole for r in results)  # stage 1: full buffer + partition
    assert all(r[stage]["parameters"] == params for r in results for stage in (1, 2))
