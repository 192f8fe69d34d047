"""The engine's profile of a model whose shapes depend on values: the replay of the configured
step fails, one warning says so, and the next step is profiled, counted eagerly.

The model routes the rows whose first feature is positive through an expert
(``torch.nonzero``); every step sees the same batch, so the profiled step's forward MACs are
those the standalone eager profiler counts for it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_BATCH, _WIDTH = 8, 8


class _Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.expert = nn.Linear(_WIDTH, _WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return x.index_add(0, chosen, self.expert(x[chosen]))


def _batch() -> torch.Tensor:
    return torch.randn(_BATCH, _WIDTH, generator=torch.Generator().manual_seed(3))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(mesh: Any, out_dir: str) -> dict[str, Any]:
    import deepshard.engine as ds

    handler = _Lines()
    logging.getLogger("deepshard").addHandler(handler)
    output = Path(out_dir) / "profile.json"
    config = {
        "train_micro_batch_size_per_gpu": _BATCH,
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(output)},
    }
    engine, _, _, _ = ds.initialize(_Routed(), config, mesh=mesh)
    for _ in range(4):
        engine.backward(engine(_batch()).pow(2).mean())
        engine.step()
    logging.getLogger("deepshard").removeHandler(handler)
    return {"profile": json.loads(output.read_text()), "lines": handler.lines}


def test_a_failed_replay_profiles_the_next_step_eagerly(tmp_path: Path) -> None:
    from deepshard.profiler import FlopsProfiler

    (result,) = run_on_mesh(
        _train, 1, args=(str(tmp_path / "out"),), store_dir=tmp_path / "store", timeout_s=120
    )
    warnings = [line for line in result["lines"] if "profiling step 2 instead" in line]
    assert len(warnings) == 1 and "DynamicOutputShape" in warnings[0]
    profile = result["profile"]
    assert profile["profile_step"] == 2
    reference = FlopsProfiler(_Routed(), count_mode="eager")
    reference.start_profile()
    reference.model(_batch())
    routed = int((_batch()[:, 0] > 0).sum())
    assert reference.get_total_macs() == routed * _WIDTH * _WIDTH > 0
    assert profile["summary"]["fwd MACs per device"] == reference.get_total_macs()
    reference.end_profile()
