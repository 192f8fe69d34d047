"""`tools/bench/adam.py --quick` runs end to end: a finite row per competitor, and the triad line.

The benchmark runs once, in a subprocess, at its smoke size on one thread. DeepSpeed is only in
the optional `bench` dependency group, so its row is required only where it is importable;
DeepShard's row is required where `deepshard.kernels` exports the CPU Adam op. A competitor
without a row must say why on a `skipped:` line.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools" / "bench"))
import _host  # (the bench's modules import each other by bare name)

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "tools" / "bench" / "adam.py"
ROW = re.compile(r"^\| (?P<name>[a-z-]+) \| (?P<params>[\w.]+)( ~)? \| 1 \|(?P<rest>.*)\|$")
TRIAD = re.compile(r"^STREAM triad, 1 thread: (?P<gbps>\S+) GB/s best")


@pytest.fixture(scope="module")
def output() -> str:
    """The benchmark's stdout (its report), from one run shared by this module's tests."""
    command = [sys.executable, str(BENCH), "--quick", "--skip-missing", "--threads", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"adam.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _rows(output: str) -> dict[str, list[float]]:
    """Competitor name -> its numeric columns (s/step, GB/s, of triad, triad GB/s, cpu/wall)."""
    rows = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match is None:
            continue
        cells = [cell.strip() for cell in match["rest"].split("|")]
        seconds, gbps, fraction, triad, _busy, cpu_per_wall = cells
        numbers = [seconds, gbps, fraction.rstrip("%"), triad, cpu_per_wall]
        rows[match["name"]] = [float(number) for number in numbers]
    return rows


def _has_deepshard_adam() -> bool:
    try:
        return hasattr(importlib.import_module("deepshard.kernels"), "cpu_adam_step")
    except ImportError:
        return False


def _expected_rows() -> list[str]:
    expected = ["torch-fused", "torch-foreach"]
    if importlib.util.find_spec("deepspeed") is not None:
        expected.append("deepspeed")
    if _has_deepshard_adam():
        expected.append("deepshard")
    return expected


def test_the_triad_line_gives_a_finite_bandwidth(output: str) -> None:
    lines = [TRIAD.match(line) for line in output.splitlines()]
    figures = [float(match["gbps"]) for match in lines if match is not None]
    assert len(figures) == 1, output
    assert math.isfinite(figures[0]) and figures[0] > 0


@pytest.mark.parametrize("name", ["torch-fused", "torch-foreach", "deepspeed", "deepshard"])
def test_each_competitor_that_can_run_has_a_finite_row(output: str, name: str) -> None:
    if name not in _expected_rows():
        pytest.skip(f"{name} is not installed in this environment")
    rows = _rows(output)
    assert name in rows, output
    assert all(math.isfinite(number) and number > 0 for number in rows[name]), rows[name]


def test_a_competitor_without_a_row_says_why(output: str) -> None:
    rows = _rows(output)
    for name in ("torch-fused", "torch-foreach", "deepspeed", "deepshard"):
        if name not in rows:
            assert f"skipped: {name} could not run" in output, output


def _half_unit(text: str) -> float:
    """Half a unit of the last printed digit of ``text`` (``"0.00107"`` -> 5e-6)."""
    digits = len(text.partition(".")[2])
    return 0.5 * 10.0**-digits


def _seconds_cells(output: str) -> dict[str, str]:
    """Competitor name -> its s/step cell as printed."""
    cells = {}
    for line in output.splitlines():
        match = ROW.match(line)
        if match is not None:
            cells[match["name"]] = match["rest"].split("|")[0].strip()
    return cells


def test_the_row_arithmetic_is_consistent(output: str) -> None:
    # GB/s is 28 bytes per parameter over the step time; 'of triad' is GB/s over triad GB/s.
    # Each printed figure is rounded, so the check allows for half a unit of its last digit:
    # the step time's rounding bounds GB/s from both sides, then GB/s is rounded to 0.1.
    printed = _seconds_cells(output)
    for name, (seconds, gbps, percent, triad, _) in _rows(output).items():
        half = _half_unit(printed[name])
        fastest = 28 * 1_000_000 / (seconds - half) / 1e9
        slowest = 28 * 1_000_000 / (seconds + half) / 1e9
        assert slowest - 0.05 - 1e-9 <= gbps <= fastest + 0.05 + 1e-9, (name, seconds, gbps)
        lowest = 100 * (gbps - 0.05) / (triad + 0.05) - 0.5
        highest = 100 * (gbps + 0.05) / (triad - 0.05) + 0.5
        assert lowest <= percent <= highest


def test_a_bf16_run_races_16_bit_parameters_with_their_byte_count() -> None:
    # --dtype bf16: DeepShard updates bf16 parameters in place with fp32 moments (22 B/param);
    # torch.optim would keep bf16 moments, which is other work, so it is skipped saying so.
    if not _has_deepshard_adam():
        pytest.skip("deepshard.kernels has no CPU Adam op here")
    command = [sys.executable, str(BENCH), "--quick", "--skip-missing", "--threads", "1",
               "--dtype", "bf16", "--competitors", "deepshard,torch-fused"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, f"adam.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    assert "bf16 parameters and gradients, fp32 moments" in done.stdout, done.stdout
    assert "skipped: torch-fused could not run" in done.stdout, done.stdout
    seconds, gbps, *_ = _rows(done.stdout)["deepshard"]
    # As in the fp32 rows' check: the printed step time's rounding bounds GB/s from both sides
    # (a flat 0.05 missed a 47 GB/s row on a fast box), then GB/s is rounded to 0.1.
    half = _half_unit(_seconds_cells(done.stdout)["deepshard"])
    fastest = 22 * 1_000_000 / (seconds - half) / 1e9
    slowest = 22 * 1_000_000 / (seconds + half) / 1e9
    assert slowest - 0.05 - 1e-9 <= gbps <= fastest + 0.05 + 1e-9, (seconds, gbps)


def test_the_header_says_which_cpu_the_figures_were_measured_on(output: str) -> None:
    # The same line `_host` builds for this machine, so a figure never travels without its CPU.
    host = next(line for line in output.splitlines() if line.startswith("host: "))
    assert host.startswith(f"host: {_host.cpu_description()}, "), host
