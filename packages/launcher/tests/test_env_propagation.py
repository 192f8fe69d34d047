"""Which variables travel to remote nodes, .deepshard_env files, and shell-safe quoting."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import EXPORT_PREFIXES, exported_variables, parse_env_file
from deepshard.launcher._env import env_file_names, read_env_files, shell_assignments


def test_exported_variables_follow_the_prefixes() -> None:
    environ = {
        "NCCL_IB_HCA": "mlx5",
        "PYTHONPATH": "/src",
        "UCX_TLS": "tcp",
        "MLFLOW_RUN": "1",
        "HF_HOME": "/hf",
        "TORCH_LOGS": "+dynamo",
        "TORCHINDUCTOR_CACHE_DIR": "/c",
        "DEEPSHARD_TIMEOUT": "5",
        "OMP_NUM_THREADS": "4",
        "VIRTUAL_ENV": "/venv",
        "HOME": "/root",
        "PATH": "/bin",
        "CUDA_VISIBLE_DEVICES": "0",
        "HFX": "no",  # HF_ needs the underscore
        "MY_NCCL": "no",  # a prefix, not a substring
    }
    exported = exported_variables(environ)
    assert set(exported) == {
        "NCCL_IB_HCA",
        "PYTHONPATH",
        "UCX_TLS",
        "MLFLOW_RUN",
        "HF_HOME",
        "TORCH_LOGS",
        "TORCHINDUCTOR_CACHE_DIR",
        "DEEPSHARD_TIMEOUT",
        "OMP_NUM_THREADS",
        "VIRTUAL_ENV",
    }
    assert all(exported[name] == environ[name] for name in exported)
    assert {"NCCL", "PYTHON", "UCX", "MLFLOW", "HF_", "TORCH", "DEEPSHARD"} <= set(EXPORT_PREFIXES)


def test_env_file_lines(tmp_path: Path) -> None:
    text = (
        "# comment\n\nNCCL_SOCKET_IFNAME=eth0\nA = b=c \nQUOTED='two words'\n"
        'DOUBLE="sky-run"\nINSIDE=x=y \'z\'\nODD="open\nEMPTY=\n'
    )
    assert parse_env_file(text, "f") == {
        "NCCL_SOCKET_IFNAME": "eth0",
        "A": "b=c",  # blanks around the value dropped
        "QUOTED": "two words",  # one pair of quotes around the whole value dropped
        "DOUBLE": "sky-run",
        "INSIDE": "x=y 'z'",  # quotes inside kept
        "ODD": '"open',  # an unmatched quote kept
        "EMPTY": "",
    }
    for bad, line in (("NO_EQUALS\n", 1), ("ok=1\n1BAD=2\n", 2), ("A B=1\n", 1)):
        with pytest.raises(LaunchError, match=rf"^f:{line}: .* is not KEY=VALUE"):
            parse_env_file(bad, "f")


def test_launch_directory_file_wins_over_home(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepshard_env").write_text("A=home\nB=home\n")
    (cwd / ".deepshard_env").write_text("B=cwd\n")
    assert read_env_files([str(home), str(cwd)]) == {"A": "home", "B": "cwd"}
    assert read_env_files([str(tmp_path / "none")]) == {}


def test_deepspeed_env_files_are_read_before_ours(tmp_path: Path) -> None:
    """DeepSpeed's ``.deepspeed_env`` (or ``$DS_ENV_FILE``) is read; ``.deepshard_env`` wins."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / ".deepspeed_env").write_text("A=ds-home\nB=ds-home\nC=ds-home\n")
    (cwd / ".deepspeed_env").write_text('B="ds-cwd"\n')
    (cwd / ".deepshard_env").write_text("C=ours\n")
    (cwd / "custom.env").write_text("D=custom\n")
    names = env_file_names({})
    assert names == (".deepspeed_env", ".deepshard_env")
    assert read_env_files([str(home), str(cwd)], names) == {
        "A": "ds-home",
        "B": "ds-cwd",
        "C": "ours",
    }
    custom = env_file_names({"DS_ENV_FILE": "custom.env"})
    assert read_env_files([str(home), str(cwd)], custom) == {"C": "ours", "D": "custom"}


def test_assignments_survive_a_shell_verbatim(tmp_path: Path) -> None:
    nasty = "x'; touch pwned; '\"$(touch pwned)\" `touch pwned` * $HOME\nline2 \\ end"
    words = shell_assignments({"A": nasty, "B": ""})
    script = f"env {' '.join(words)} printenv A B"
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert done.stdout == f"{nasty}\n\n"
    assert not list(tmp_path.glob("pwned*"))
    with pytest.raises(LaunchError, match="not a valid environment variable name"):
        shell_assignments({"A;rm": "x"})
