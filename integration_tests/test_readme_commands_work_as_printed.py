"""The commands README.md and docs/installation.md print work as written.

* Every ``uv run`` command names dependency groups that provide the tool it runs: the tool's
  distribution must be in what uv resolves for exactly those flags (``uv export`` of the lock
  with the same ``--all-packages``/``--package``/``--group`` flags; the ``dev`` group is a
  default group). ``uv run --all-packages mkdocs ...`` fails this ("Failed to spawn: mkdocs":
  mkdocs is in the ``docs`` group), which the test checks too, so the check can fail.
* Every ``uv pip install ./folder ...`` line lists existing workspace members and, with each,
  every DeepShard package it depends on (nothing is published, so a sibling missing from the
  line could not be found).
* The first such line (``uv pip install ./packages/interface``) is run exactly as printed, in
  the repository root, into a fresh venv, and the package is imported from that venv: about
  5-10 s, mostly building the wheel (marked ``slow`` in its name only; it needs uv and its cache).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/installation.md")
_VALUED = {"--group", "--package", "--extra", "--with", "--python", "--directory", "--project"}
_ALWAYS = {"python", "python3"}  # the venv's interpreter: nothing to provide


def _commands(prefix: str) -> list[str]:
    lines = []
    for page in PAGES:
        text = (REPO / page).read_text()
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
            for line in block.splitlines():
                command = line.split(" #")[0].strip()
                if command.startswith(prefix):
                    lines.append(command)
    return lines


def _split_uv_run(command: str) -> tuple[list[str], str]:
    """``(uv flags, tool)`` of ``uv run FLAGS TOOL ARGS``."""
    words = shlex.split(command)[2:]
    flags: list[str] = []
    while words and words[0].startswith("-"):
        flag = words.pop(0)
        flags.append(flag)
        if flag in _VALUED:
            flags.append(words.pop(0))
    return flags, words[0]


def _export_flags(flags: tuple[str, ...]) -> list[str]:
    """The flags of a ``uv run`` that choose what is installed, for ``uv export``."""
    kept, i = [], 0
    while i < len(flags):
        if flags[i] in ("--group", "--package"):
            kept += flags[i : i + 2]
        elif flags[i] == "--all-packages":
            kept.append(flags[i])
        i += 1 + (flags[i] in _VALUED)
    return kept


@functools.cache
def _resolved(flags: tuple[str, ...]) -> frozenset[str]:
    """Distribution names uv installs for these flags (from the lock; workspace members too)."""
    export = ["--no-hashes", "--no-header", "--no-annotate", "--no-emit-workspace"]
    lock = ["--frozen"] if (REPO / "uv.lock").is_file() else []
    out = subprocess.run(
        ["uv", "export", *lock, *export, *_export_flags(flags)],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    names = {canonicalize_name(Requirement(line.split(" ;")[0]).name) for line in _reqs(out)}
    return frozenset(names | set(_members(flags)))


def _reqs(export: str) -> list[str]:
    return [line for line in export.splitlines() if line and not line.startswith(("#", " ", "-"))]


def _members(flags: tuple[str, ...]) -> list[str]:
    names = []
    for pyproject in [*REPO.glob("packages/*/pyproject.toml"), REPO / "kernels/pyproject.toml"]:
        if pyproject.is_file():
            names.append(canonicalize_name(tomllib.loads(pyproject.read_text())["project"]["name"]))
    if "--all-packages" in flags:
        return names
    return [canonicalize_name(v) for i, v in enumerate(flags) if i and flags[i - 1] == "--package"]


def _provider(tool: str) -> str:
    """The distribution whose console script ``tool`` is; a tool not installed here is assumed
    to be its own distribution's name (mkdocs, pytest, tox are)."""
    for script in entry_points(group="console_scripts"):
        if script.name == tool and script.dist is not None:
            return canonicalize_name(script.dist.name)
    return canonicalize_name(tool)


def _missing_tool(command: str) -> str | None:
    flags, tool = _split_uv_run(command)
    if tool in _ALWAYS:
        return None
    provider = _provider(tool)
    if provider in _resolved(tuple(flags)):
        return None
    return f"`{command}`: {tool} comes from {provider}, which these flags do not install"


needs_uv = pytest.mark.skipif(shutil.which("uv") is None, reason="uv is not on PATH")


@needs_uv
@pytest.mark.parametrize("command", _commands("uv run "))
def test_each_uv_run_command_installs_the_tool_it_runs(command: str) -> None:
    assert _missing_tool(command) is None, _missing_tool(command)


@needs_uv
def test_the_check_catches_mkdocs_without_the_docs_group() -> None:
    assert _missing_tool("uv run --all-packages mkdocs build --strict") is not None
    assert _missing_tool("uv run --all-packages --group docs mkdocs build --strict") is None


def _member_of(folder: str) -> tuple[str, set[str]]:
    project = tomllib.loads((REPO / folder / "pyproject.toml").read_text())["project"]
    deps = {canonicalize_name(Requirement(d).name) for d in project.get("dependencies", [])}
    return canonicalize_name(project["name"]), {d for d in deps if d.startswith("deepshard")}


INSTALLS = _commands("uv pip install ")


def test_the_pages_print_install_commands() -> None:
    assert INSTALLS, "README.md / docs/installation.md lost their `uv pip install` lines"


@pytest.mark.parametrize("command", INSTALLS)
def test_each_install_line_brings_every_sibling_it_needs(command: str) -> None:
    folders = [w.split("[")[0] for w in shlex.split(command)[3:] if w.startswith("./")]
    assert folders, command
    members = dict(_member_of(folder) for folder in folders)
    needed = set().union(*members.values())
    assert needed <= set(members), f"`{command}` lacks {sorted(needed - set(members))}"


@needs_uv
def test_slow_the_first_install_line_works_in_a_fresh_venv(tmp_path: Path) -> None:
    command = INSTALLS[0]
    assert command == "uv pip install ./packages/interface"  # the torch-free one, cheap to run
    venv = tmp_path / "venv"
    subprocess.run(["uv", "venv", "-q", str(venv)], check=True, timeout=60)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "UV_PROJECT"))}
    subprocess.run(
        shlex.split(command), cwd=REPO, env={**env, "VIRTUAL_ENV": str(venv)},
        check=True, timeout=180, capture_output=True,
    )  # fmt: skip
    probe = "import deepshard.interface as m, sys; print(m.__file__); print('torch' in sys.modules)"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, check=True, timeout=60,
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert out[0].startswith(str(venv)), f"imported from {out[0]}, not the fresh venv"
    assert out[1] == "False"  # deepshard-interface alone brings no torch
