"""The printed profile, its JSON form, the MFU line, and the typed errors for bad calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from deepshard.profiler import (
    CountMode,
    FlopsProfiler,
    ProfilerError,
    TrainingStep,
    get_model_profile,
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))


def _ticks() -> object:
    """A clock that advances one second per reading (deterministic latencies)."""
    state = {"now": 0.0}

    def clock() -> float:
        state["now"] += 1.0
        return state["now"]

    return clock


def test_the_text_report_has_summary_aggregate_and_tree(
    capsys: pytest.CaptureFixture[str], count_mode: CountMode
) -> None:
    flops, macs, params = get_model_profile(
        _model(), input_shape=(2, 8), top_modules=2, count_mode=count_mode
    )
    text = capsys.readouterr().out
    assert (flops, macs, params) == (
        2 * (2 * 8 * 16 + 2 * 16 * 4) + 2 * 16,
        2 * (8 * 16 + 16 * 4),
        212,
    )
    assert "Profile summary at step 1" in text and "Top 2 modules" in text
    assert "depth 2:" in text and "(0): Linear(" in text and "Params" in text
    assert "FLOPs per operator" in text and "addmm" in text


def test_json_output_and_mfu_with_a_given_peak(tmp_path: Path, count_mode: CountMode) -> None:
    model = _model()
    prof = FlopsProfiler(model, peak_flops=1e3, clock=_ticks(), count_mode=count_mode)  # type: ignore[arg-type]
    prof.start_profile()
    model(torch.randn(2, 8))
    prof.stop_profile()
    out = tmp_path / "deep" / "profile.json"
    step = TrainingStep(
        world_size=1, dp_size=1, micro_batch_per_device=2, micro_steps=1,
        forward_s=1.0, backward_s=2.0, step_s=1.0,
    )  # fmt: skip
    prof.print_model_profile(profile_step=3, output_file=out, training=step)
    data = json.loads(out.read_text())
    prof.end_profile()
    fwd = data["summary"]["fwd flops per device"]
    assert data["profile_step"] == 3 and data["modules"]["params"] == 212
    assert data["summary"]["fwd latency s"] == 1.0 and data["summary"]["samples/s"] == 0.5
    # Backward not counted: the step is 3 × forward FLOPs over 4 s, against a 1 kFLOP/s peak.
    assert data["summary"]["MFU"] == pytest.approx(3 * fwd / 4 / 1e3)
    assert data["ops"]["addmm"]["forward"] == 2 * (2 * 8 * 16 + 2 * 16 * 4)
    assert [c["type_name"] for c in data["modules"]["children"]] == ["Linear", "ReLU", "Sequential"]


def test_bad_calls_raise_profiler_errors() -> None:
    prof = FlopsProfiler(_model())
    with pytest.raises(ProfilerError, match="call start_profile"):
        prof.get_total_flops()
    with pytest.raises(ProfilerError, match="ignore_list"):
        prof.start_profile(ignore_list=["Linear"])  # type: ignore[list-item]
    prof.start_profile()
    with pytest.raises(ProfilerError, match="module_depth"):
        prof.print_model_profile(module_depth=-2)
    with pytest.raises(ProfilerError, match="top_modules"):
        prof.print_model_aggregated_profile(top_modules=0)
    prof.end_profile()
    with pytest.raises(ProfilerError, match="input_shape, args or kwargs"):
        get_model_profile(_model())
    with pytest.raises(ProfilerError, match="peak_flops"):
        FlopsProfiler(_model(), peak_flops=0)


def test_reset_zeroes_and_stop_keeps_the_numbers(count_mode: CountMode) -> None:
    model = _model()
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    model(torch.randn(2, 8))
    first = prof.get_total_flops()
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    model(torch.randn(2, 8))
    prof.stop_profile()
    model(torch.randn(2, 8))  # not counted
    assert prof.get_total_flops() == first
    prof.end_profile()
    assert not prof.started
