"""A DeepShard error every rank raises prints once, without a traceback, unless asked.

Real ``ds-launch`` runs of a script whose two ranks raise the same `ConfigError`, the script
runner on its own (it must look to the script like ``python script.py``), and the report's
folding of rank errors as a function of data.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from deepshard.launcher import Outcome, ProcessSpec
from deepshard.launcher._rank_errors import RankError, traceback_requested
from deepshard.launcher._report import describe_outcome
from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")
MESSAGE = "zero_optimization.stage: input should be 0, 1, 2 or 3; got 7"
# Both ranks raise the same error. They ignore SIGTERM, so the first rank's failure does not stop
# the other before it raised too (the launcher's stop would otherwise race the second raise).
BAD_CONFIG = f"""\
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
from deepshard.interface.errors import ConfigError

def load_config():
    raise ConfigError({MESSAGE!r})

print("starting", flush=True)
load_config()
"""
# Prints what a script can see of how it was started.
INTROSPECT = """\
import json, os, sys
print(json.dumps({
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "path0": sys.path[0],
    "spec": __spec__ and __spec__.name,
    "loader": type(__loader__).__name__,
    "cached": __cached__,
    "main_is_me": sys.modules["__main__"].__dict__ is globals(),
}))
"""


def _launch(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "train.py").write_text(BAD_CONFIG)
    return _probes.ds_launch("--nproc_per_node", "2", *flags, "train.py", cwd=tmp_path)


def test_an_error_every_rank_raises_prints_once_without_traceback(tmp_path: Path) -> None:
    done = _launch(tmp_path)
    console = done.stdout + done.stderr
    assert done.returncode == 1, console
    assert console.count(MESSAGE) == 1, console
    assert "Traceback" not in console
    assert f"ds-launch: ranks 0, 1 stopped with ConfigError:\n    {MESSAGE}\n" in done.stderr
    assert "DEEPSHARD_TRACEBACK=1 (or ds-launch --traceback) shows the traceback" in done.stderr
    # The rest of the ranks' output is relayed as before.
    assert "[rank 0] starting" in done.stdout and "[rank 1] starting" in done.stdout


def test_traceback_flag_shows_the_tracebacks_from_the_script_on(tmp_path: Path) -> None:
    done = _launch(tmp_path, "--traceback")
    assert done.returncode == 1, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] Traceback (most recent call last):" in done.stderr
        assert f'[rank {rank}]   File "{tmp_path / "train.py"}", line 6, in load_config' in (
            done.stderr
        )
        assert f"[rank {rank}] deepshard.interface.errors.ConfigError: {MESSAGE}" in done.stderr
    # The script runner's frames (and runpy's) are left out, as if python ran the script.
    assert "runpy" not in done.stderr and "deepshard/launcher/script.py" not in done.stderr


def test_the_script_runner_looks_like_plain_python_to_the_script(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "tool.py").write_text(INTROSPECT)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(INTROSPECT)
    runner = [sys.executable, "-m", "deepshard.launcher.script"]
    for target in (["sub/probe.py"], ["-m", "pkg.tool"]):
        seen = []
        for prefix in ([sys.executable], runner):
            done = subprocess.run(
                [*prefix, *target, "a b", "--flag"],
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            )
            seen.append(json.loads(done.stdout))
        assert seen[0] == seen[1]
        assert seen[1]["name"] == "__main__" and seen[1]["argv"][1:] == ["a b", "--flag"]


def _run_script(tmp_path: Path, text: str, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "job.py").write_text(text)
    return subprocess.run(
        [sys.executable, "-m", "deepshard.launcher.script", "job.py"],
        cwd=tmp_path,
        env=_probes.launcher_env(**env),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_runner_writes_the_error_file_or_prints_the_message(tmp_path: Path) -> None:
    raising = "from deepshard.interface.errors import TopologyError\nraise TopologyError('tp 3')\n"
    error_file = tmp_path / "error.json"
    reported = _run_script(tmp_path, raising, DEEPSHARD_ERROR_FILE=str(error_file))
    assert (reported.returncode, reported.stderr) == (1, "")
    assert json.loads(error_file.read_text()) == {"kind": "TopologyError", "message": "tp 3"}
    printed = _run_script(tmp_path, raising)  # no error file: a log file gets the message
    assert printed.returncode == 1
    assert printed.stderr.splitlines()[0] == "TopologyError: tp 3"
    assert "Traceback" not in printed.stderr


def test_other_exits_and_errors_pass_through_the_runner(tmp_path: Path) -> None:
    assert _run_script(tmp_path, "import sys\nsys.exit(3)\n").returncode == 3
    failed = _run_script(tmp_path, "raise KeyError('plain')\n")
    assert failed.returncode == 1
    assert failed.stderr.splitlines() == [
        "Traceback (most recent call last):",
        f'  File "{tmp_path / "job.py"}", line 1, in <module>',
        "    raise KeyError('plain')",
        "KeyError: 'plain'",
    ]


def _rank(rank: int) -> ProcessSpec:
    label = f"rank {rank} (local rank {rank} on localhost)"
    return ProcessSpec(label=label, argv=("python",), env={"RANK": str(rank)})


def test_the_report_folds_identical_errors_and_keeps_distinct_ones() -> None:
    ranks = [_rank(rank) for rank in range(4)]
    config, topology = (
        RankError("ConfigError", "a.b: bad\nc: worse"),
        RankError("TopologyError", "tp"),
    )
    outcome = Outcome(
        1,
        ranks[2],
        1,
        tail=("Traceback (most recent call last):",),
        errors=((ranks[0], config), (ranks[1], topology), (ranks[2], config), (ranks[3], config)),
    )
    assert describe_outcome(outcome).splitlines() == [
        "ds-launch: ranks 0, 2, 3 stopped with ConfigError:",
        "    a.b: bad",
        "    c: worse",
        "ds-launch: rank 1 stopped with TopologyError:",
        "    tp",
        "ds-launch: DEEPSHARD_TRACEBACK=1 (or ds-launch --traceback) shows the traceback",
        "ds-launch: rank 2 (local rank 2 on localhost) exited with code 1; the other processes "
        "were stopped",
    ]
    # The failed rank reported nothing (it crashed): its output tail is shown as before.
    crashed = Outcome(1, ranks[3], 1, tail=("Segfault",), errors=((ranks[0], config),))
    assert describe_outcome(crashed).splitlines()[-2:] == [
        "ds-launch: last 1 lines of its output:",
        "    Segfault",
    ]


def test_traceback_is_asked_for_by_a_true_value() -> None:
    for value in ("1", "true", "YES", "on"):
        assert traceback_requested({"DEEPSHARD_TRACEBACK": value})
    for value in ("", "0", "false", "no"):
        assert not traceback_requested({"DEEPSHARD_TRACEBACK": value})
    assert not traceback_requested({})


def test_the_runner_loads_nothing_heavy_before_the_script(tmp_path: Path) -> None:
    heavy = ("pydantic", "deepshard.interface", "torch")
    probe = f"import sys\nprint([name for name in {heavy!r} if name in sys.modules])\n"
    done = _run_script(tmp_path, probe)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr
