"""``wall_clock_breakdown`` at ZeRO stage 3 prints the exposed and the total gather time.

2 ranks, a ``ModuleList`` of three ``Linear`` units (each its own unit by the default rule,
none persistent), prefetch off so every gather a hook needs is waited for. Rank 0's breakdown
line, printed once for the three steps, must carry "gather (exposed)" equal to the
`ShardedModule`'s blocked-on-gather seconds per step and "gather (total)" equal to the
per-step latency of the comms logger's all-gather records; at stage 2 neither figure appears.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_STEPS, _WIDTH = 3, 64


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(_WIDTH, _WIDTH) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(mesh: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    handler = _Lines()
    log = logging.getLogger("deepshard.engine")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": _STEPS,
        "wall_clock_breakdown": True,
    }
    if stage == 3:
        config["zero_optimization"] |= {
            "stage3_prefetch_bucket_size": 0,
            "stage3_param_persistence_threshold": 0,
        }
    engine, optimizer, _, _ = ds.initialize(_Chain(), config, mesh=mesh)
    for _ in range(_STEPS):
        engine.backward(engine(torch.randn(8, _WIDTH)).pow(2).mean())
        engine.step()
    log.removeHandler(handler)
    records = engine.comms_logger.records
    return {
        "lines": [line for line in handler.lines if line.startswith("time per step (ms)")],
        "exposed_s": optimizer.sharded.gather_waits.exposed_s if stage == 3 else None,
        "gather_s": sum(r.latency_s for r in records if r.op == "all_gather_into_tensor"),
        "calls": engine.comms_logger.call_count,
        "records": len(records),
    }


def _phases(line: str) -> dict[str, float]:
    parts = line.split(": ", 1)[1].split(" | ")
    return {name: float(value) for name, value in (part.rsplit(" ", 1) for part in parts)}


@pytest.mark.parametrize("stage", [3, 2])
def test_breakdown_line_carries_the_exposed_gather_time(tmp_path: Path, stage: int) -> None:
    rank0 = run_on_mesh(_train, 2, args=(stage,), store_dir=tmp_path, timeout_s=90)[0]
    assert len(rank0["lines"]) == 1
    phases = _phases(rank0["lines"][0])
    if stage == 2:
        assert set(phases) == {"forward", "backward", "reduce", "step"}
        return
    assert set(phases) == {
        *("forward", "backward", "reduce", "step"),
        *("gather (exposed)", "gather (total)"),
    }
    assert rank0["calls"] == rank0["records"]  # every call kept a record: totals are whole
    assert rank0["exposed_s"] > 0
    assert phases["gather (exposed)"] == pytest.approx(1e3 * rank0["exposed_s"] / _STEPS, abs=0.01)
    assert phases["gather (total)"] == pytest.approx(1e3 * rank0["gather_s"] / _STEPS, abs=0.01)
