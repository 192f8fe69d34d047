"""Bytes on the wire per optimizer step, from the comms logger, equal the theory exactly.

The theory, from the model's parameter sizes alone: ZeRO lays the parameters out in one flat
buffer (the default bucket holds all of them), each starting 16-byte aligned, and pads the buffer
to a multiple of ``W × 16`` bytes (``W`` ranks; 16 bytes at stage 0, which does not partition).
With ``a = 16 / element size`` elements, the buffer holds
``P = round_up(Σ round_up(numel, a), W·a)`` elements. Bytes are counted as nccl-tests does:
an all-reduce its buffer, a reduce-scatter its full input, an all-gather its full output. So
per step of ``ga`` micro-batches:

* stage 0: one all-reduce of the gradients, ``P₁ × size`` bytes (``P₁``: padding for W = 1);
  no other collective (every rank already holds the whole gradient for the norm).
* stage 1: one reduction of the gradients and one all-gather of the updated parameters,
  ``P × size`` bytes each, and the 16-byte all-reduce that combines the norm and overflow flag.
  On CPU the reduction is an all-reduce of which each rank keeps its chunk (gloo's
  reduce-scatter is slower than its all-reduce).
* stage 2: as stage 1, but one reduction per micro-batch.

One ``run_on_mesh`` call on 4 ranks runs each stage for 3 steps, with the MLP in fp32 and in
bf16, and 1 and 2 accumulation steps.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest

from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
WORLD = 4
STEPS = 3
CASES = list(itertools.product((0, 1, 2), ("fp32", "bf16"), (1, 2)))
SIZES = {"fp32": 4, "bf16": 2}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _padded_numel(numels: list[int], element_size: int, world: int) -> int:
    align = 16 // element_size
    return _round_up(sum(_round_up(n, align) for n in numels), world * align)


def _logged(mesh: Any, stage: int, precision: str, ga: int) -> dict[tuple[str, str], Any]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    dtype = _models.DTYPES[precision]
    model = _models.make_mlp()
    config = _models.engine_config(
        stage=stage, precision=precision, ga=ga, comms_logger={"enabled": True}
    )
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    for step in range(STEPS):
        for micro in range(ga):
            rows = _models.micro_batch(
                _models.mlp_batch(step), micro=micro, rank=rank, world=world, ga=ga
            )
            engine.backward(_models.mlp_loss(engine, rows, dtype))
            engine.step()
    calls: Counter[tuple[str, str]] = Counter()
    sizes: dict[tuple[str, str], set[int]] = {}
    for record in engine.comms_logger.records:
        key = (record.op, record.log_name)
        calls[key] += 1
        sizes.setdefault(key, set()).add(record.msg_bytes)
    return {key: (calls[key], sizes[key]) for key in calls}


def _all_cases(mesh: Any) -> dict[Any, Any]:
    return {case: _logged(mesh, *case) for case in CASES}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_on_mesh(_all_cases, WORLD, store_dir=tmp_path_factory.mktemp("comm"), timeout_s=180)


def _theory(stage: int, precision: str, ga: int) -> dict[tuple[str, str], Any]:
    numels = [p.numel() for p in _models.make_mlp().parameters()]
    size = SIZES[precision]
    if stage == 0:
        grads = _padded_numel(numels, size, 1) * size
        return {("all_reduce", "zero_all_reduce_grads"): (STEPS, {grads})}
    flat = _padded_numel(numels, size, WORLD) * size
    scatters = STEPS * (ga if stage == 2 else 1)
    return {
        # CPU buckets: all-reduced and sliced (gloo's reduce-scatter is slower)
        ("all_reduce", "zero_all_reduce_grads"): (scatters, {flat}),
        ("all_gather_into_tensor", "zero_all_gather_params"): (STEPS, {flat}),
        ("all_reduce", "zero_grad_norm"): (STEPS, {2 * 8}),  # norm and flag, fp64
    }


@pytest.mark.parametrize("case", CASES, ids=lambda case: "-".join(map(str, case)))
def test_bytes_per_step_match_the_theory(results: list[dict[Any, Any]], case: Any) -> None:
    for rank_results in results:
        assert rank_results[case] == _theory(*case)
