"""The ``flops_profiler`` block and ``wall_clock_breakdown`` in a 2-rank ZeRO-2 training run.

Rank 0, and only rank 0, writes the profile of global step 1 (counted from 0) as JSON: the
forward FLOPs are those the standalone profiler counts for one micro-batch times the two
accumulation micro-steps, the backward FLOPs are 3/2 of the forward (the two equal GEMMs of
this bias-free MLP have three GEMMs of their size in backward: the first layer's input needs no
gradient), and the summary carries the step's latencies,
samples/s and TFLOPS; at stage 3, whose parameters are empty between uses, the parameter count
is still the model's. The timer line printed every ``steps_per_print`` has a positive "reduce"
read from the comms logger's records of each step.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_MICRO, _GA, _WIDTH = 4, 2, 16


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(_WIDTH, 2 * _WIDTH, bias=False),
        torch.nn.Linear(2 * _WIDTH, _WIDTH, bias=False),
    )


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _train(mesh: Any, out_dir: str, stage: int = 2) -> dict[str, Any]:
    import deepshard.engine as ds

    handler = _Lines()
    log = logging.getLogger("deepshard.engine")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    rank = torch.distributed.get_rank()
    output = Path(out_dir) / f"rank{rank}" / "profile.json"
    config = {
        "train_micro_batch_size_per_gpu": _MICRO,
        "gradient_accumulation_steps": _GA,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 3,
        "wall_clock_breakdown": True,
        "flops_profiler": {"enabled": True, "profile_step": 1, "output_file": str(output)},
    }
    engine, _, _, _ = ds.initialize(_mlp(), config, mesh=mesh)
    for _ in range(3 * _GA):
        loss = engine(torch.randn(_MICRO, _WIDTH)).pow(2).mean()
        engine.backward(loss)
        engine.step()
    log.removeHandler(handler)
    profile = json.loads(output.read_text()) if output.exists() else None
    return {"profile": profile, "lines": handler.lines}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("profiles")
    return run_on_mesh(
        _train, 2, args=(str(out),), store_dir=tmp_path_factory.mktemp("store"), timeout_s=120
    )


def test_rank_0_writes_the_profile_of_the_configured_step(results: list[dict[str, Any]]) -> None:
    from deepshard.profiler import FlopsProfiler

    assert results[1]["profile"] is None
    profile = results[0]["profile"]
    assert profile is not None and profile["profile_step"] == 1
    reference = FlopsProfiler(_mlp())
    reference.start_profile()
    reference.model(torch.randn(_MICRO, _WIDTH))
    one_micro_batch = reference.get_total_flops()
    reference.end_profile()
    summary = profile["summary"]
    assert summary["fwd flops per device"] == _GA * one_micro_batch
    assert summary["bwd flops per device (counted)"] == 3 * _GA * one_micro_batch // 2
    assert summary["world size"] == 2 and summary["batch size per device"] == _MICRO
    for key in ("fwd latency s", "bwd latency s", "step latency s", "samples/s"):
        assert summary[key] > 0
    iter_s = summary["fwd latency s"] + summary["bwd latency s"] + summary["step latency s"]
    assert summary["samples/s"] == pytest.approx(_MICRO * _GA * 2 / iter_s)
    assert summary["TFLOPS per device (fwd+bwd / iter latency)"] == pytest.approx(
        5 * _GA * one_micro_batch / 2 / iter_s / 1e12
    )


def test_the_breakdown_reads_reduce_from_the_steps_comms_records(
    results: list[dict[str, Any]],
) -> None:
    lines = [line for line in results[0]["lines"] if line.startswith("time per step (ms)")]
    assert len(lines) == 1  # steps_per_print 3, three steps
    phases = dict(part.rsplit(" ", 1) for part in lines[0].split(": ", 1)[1].split(" | "))
    assert set(phases) == {"forward", "backward", "reduce", "step"}
    assert all(float(value) > 0 for value in phases.values())
    assert not any("not wired" in line for line in results[0]["lines"])


def test_stage_3_profiles_count_the_full_parameters(tmp_path: Path) -> None:
    results = run_on_mesh(
        _train, 2, args=(str(tmp_path / "out"), 3), store_dir=tmp_path / "store", timeout_s=120
    )
    summary = results[0]["profile"]["summary"]
    assert summary["params per device"] == sum(p.numel() for p in _mlp().parameters())
