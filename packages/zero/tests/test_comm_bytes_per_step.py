"""Bytes each stage moves per optimizer step, read from the CommsLogger, equal the theory exactly.

What the logger counts (nccl-tests conventions): an all-reduce counts its tensor, a
reduce-scatter its full input, an all-gather its full output. With the default bucket sizes each
param group is one bucket: its parameters at 16-byte aligned offsets, padded to a multiple of
``W × alignment`` elements at stages 1-2 (alignment only at stage 0). Per optimizer step with
``ga`` micro-steps:

* stage 0: one all-reduce per bucket, at the boundary only: Σ padded bucket × comm dtype size;
  no norm collective (every rank holds the same reduced gradients).
* stage 1: one reduction per bucket at the boundary (Σ padded bucket × comm size), one
  all-gather per bucket after the step (Σ padded bucket × model dtype size), and one all-reduce
  of the norm: two fp64 numbers, 16 bytes. On CPU the reduction is an all-reduce of which each
  rank keeps its chunk (gloo's reduce-scatter is slower, `deepshard.zero._settings`).
* stage 2: as stage 1, but the reductions happen at every micro-step (× ``ga``).

Passes inside ``no_sync()`` communicate nothing at stages 0-1.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD, GA = 2, 2
# (model dtype, communication_data_type) pairs
DTYPES = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "fp32")]


def _padded_group_numel(shapes: list[tuple[int, ...]], element_size: int, world: int) -> int:
    """One bucket: each parameter at an aligned offset, the bucket padded to world × alignment."""
    align = 16 // element_size
    used = 0
    for shape in shapes:
        offset = -(-used // align) * align
        used = offset + math.prod(shape)
    return -(-used // (world * align)) * (world * align)


def _step_traffic(mesh: Any) -> dict[Any, Any]:
    from deepshard.comm import CommsLogger
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import GradientReduction, ZeroOptimizer

    group, rank = mesh["dp"], mesh.get_rank()
    out = {}
    for dtype, comm in DTYPES:
        for stage in (0, 1, 2):
            logger = CommsLogger(CommsLoggerConfig(enabled=True))
            model = _training.make_model(dtype)
            inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=1e-3)
            zero = ZeroOptimizer(
                inner,
                group=group,
                config=ZeroConfig(stage=stage),
                reduction=GradientReduction.from_names(dtype=comm),
                comms_logger=logger,
            )
            x, y = _training.batch(0)
            mb = _training.GLOBAL_BATCH // (WORLD * GA)
            rows = [slice((m * WORLD + rank) * mb, (m * WORLD + rank + 1) * mb) for m in range(GA)]
            with zero.no_sync():
                zero.backward(_training.loss_fn(model, x[rows[0]], y[rows[0]]) / GA)
            in_no_sync = logger.call_count
            zero.backward(_training.loss_fn(model, x[rows[1]], y[rows[1]]) / GA)
            zero.step()
            traffic: Counter[str] = Counter()
            calls: Counter[str] = Counter()
            for record in logger.records:
                traffic[record.op] += record.msg_bytes
                calls[record.op] += 1
            out[(dtype, comm, stage)] = (dict(traffic), dict(calls), in_no_sync)
    return out


@pytest.mark.slow
def test_bytes_per_step_match_the_theory(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_step_traffic, WORLD, store_dir=tmp_path)
    params = list(_training.make_model().parameters())
    groups = [[tuple(p.shape) for p in g["params"]] for g in _training.param_groups(params)]
    for traffic_by_rank in per_rank:
        for dtype, comm in DTYPES:
            model_size = torch.tensor([], dtype=dtype).element_size()
            comm_size = 4 if comm == "fp32" else model_size
            for stage in (0, 1, 2):
                traffic, calls, in_no_sync = traffic_by_rank[(dtype, comm, stage)]
                world = 1 if stage == 0 else WORLD
                padded = sum(_padded_group_numel(g, model_size, world) for g in groups)
                if stage == 0:
                    assert traffic == {"all_reduce": padded * comm_size}
                    assert calls == {"all_reduce": len(groups)}
                    assert in_no_sync == 0
                    continue
                passes = GA if stage == 2 else 1
                # CPU buckets are all-reduced and sliced (gloo's reduce-scatter is slower),
                # beside the norm's 16-byte all-reduce
                assert traffic == {
                    "all_gather_into_tensor": padded * model_size,
                    "all_reduce": passes * padded * comm_size + 16,
                }
                assert calls == {
                    "all_gather_into_tensor": len(groups),
                    "all_reduce": passes * len(groups) + 1,
                }
                assert in_no_sync == (len(groups) if stage == 2 else 0)
