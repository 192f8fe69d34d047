"""kernel_report() and ``python -m deepshard.kernels``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import deepshard.kernels as kernels


def test_report_names_every_op_and_what_it_runs_on():
    report = kernels.kernel_report()
    names = ["cpu_adam_step", "cpu_lion_step", "fused_adam_step", "fused_weighted_sum"]
    assert [op.name for op in report.ops] == names
    for name in ("cpu_adam_step", "cpu_lion_step"):
        op = report.op(name)
        assert op.compiled and op.fallback_reason is None
        assert op.backend == kernels.active_simd_path()
        assert ", ".join(kernels.available_simd_paths()) in op.detail
    fused = report.op("fused_adam_step")
    compiled, description = kernels.fused_adam_status()
    assert fused.compiled == compiled
    assert (fused.detail if compiled else fused.fallback_reason) == description
    assert fused.backend == ("cuda" if compiled else "reference")
    combine = report.op("fused_weighted_sum")
    compiled, description = kernels.fused_weighted_sum_status()
    assert (combine.compiled, combine.backend) == (compiled, "triton" if compiled else "reference")
    assert (combine.detail if compiled else combine.fallback_reason) == description
    with pytest.raises(KeyError, match="no op named 'nope'"):
        report.op("nope")


def test_report_follows_the_forced_path():
    with kernels.use_simd_path("scalar"):
        assert kernels.kernel_report().op("cpu_adam_step").backend == "scalar"


def test_cli_prints_the_report_and_honours_the_env_path():
    env = {**os.environ, "DEEPSHARD_CPU_SIMD": "scalar"}
    result = subprocess.run(
        [sys.executable, "-m", "deepshard.kernels"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "deepshard-kernels"
    adam = next(line for line in lines if line.strip().startswith("cpu_adam_step"))
    assert adam.split()[1:3] == ["compiled", "scalar"], adam
    assert any(line.strip().startswith("fused_adam_step") for line in lines)


def test_importing_the_package_loads_no_extension():
    code = (
        "import sys, deepshard.kernels as k\n"
        "assert 'deepshard.kernels._cpu' not in sys.modules, 'loaded at import'\n"
        "k.available_simd_paths()\n"
        "assert 'deepshard.kernels._cpu' in sys.modules, 'not loaded on first use'\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
