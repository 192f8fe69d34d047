"""DeepSpeed launcher flags that scripts pass: accepted, mapped, or refused by name.

``--no_ssh_check`` and ``--force_multi`` change nothing here (ds-launch never probes ssh and
always reaches a remote host through its launcher); ``--enable_each_rank_log DIR`` is
``--log_dir``; ``--log_level``/``-q`` are accepted; ``--save_pid`` writes the launcher's pid to
``/tmp/<pid>.deepshard``; ``--autotuning`` and DeepSpeed's other MPI launchers are refused with
what to do instead (not argparse's "unrecognized arguments").
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deepshard.launcher.cli import main, parse_args


def test_accepted_flags_parse_and_map() -> None:
    args = parse_args(
        [
            "--no_ssh_check",
            "--force_multi",
            "--log_level",
            "WARNING",
            "-q",
            "--enable_each_rank_log",
            "/tmp/logs",
            "train.py",
            "--lr",
            "1",
        ]
    )
    assert args.no_ssh_check and args.force_multi and args.quiet
    assert args.log_level == "warning"
    assert args.log_dir == "/tmp/logs"  # DeepSpeed's name for --log_dir
    assert (args.user_script, args.user_args) == ("train.py", ["--lr", "1"])


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--autotuning", "tune", "train.py"], "does not carry DeepSpeed's autotuner"),
        (["--launcher", "MVAPICH", "train.py"], "--launcher mvapich: ds-launch starts MPI jobs"),
        (["--launcher", "impi", "train.py"], "--launcher_args"),
    ],
)
def test_refused_flags_say_what_to_do(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "unrecognized" not in err and "invalid choice" not in err


def test_save_pid_writes_the_launcher_pid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    path = Path("/tmp") / f"{os.getpid()}.deepshard"
    try:
        assert main(["--save_pid", "--dry_run", str(script)]) == 0
        assert path.read_text() == f"{os.getpid()}\n"
    finally:
        path.unlink(missing_ok=True)
    assert "rank 0" in capsys.readouterr().out
