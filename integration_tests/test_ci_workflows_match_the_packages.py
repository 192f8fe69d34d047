"""The GitHub workflows are generated from the package list, list every member and are valid.

``tools/ci_workflows.py`` writes `.github/workflows/*.yml` from `deepshard.interface.status`.
This test fails when a file is stale (fix: ``uv run --all-packages python tools/ci_workflows.py``),
when a workspace member has no job or a job names a tox env tox.ini does not define, and when a
file lacks what GitHub requires of a workflow (``on``; per job ``runs-on`` and ``steps``, each
step a ``uses`` or a ``run``). actionlint is not used: its PyPI wrapper downloads the binary
from outside the package registries when it is installed, so it cannot be installed here.
"""

from __future__ import annotations

import configparser
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parent.parent


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "_ci_workflows", REPO / "tools" / "ci_workflows.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _workspace_envs() -> set[str]:
    """The folder name (= tox env) of every workspace member, read from the root pyproject."""
    root = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    folders: set[str] = set()
    for pattern in root["tool"]["uv"]["workspace"]["members"]:
        folders |= {p.parent.name for p in REPO.glob(f"{pattern}/pyproject.toml")}
    return folders


def _tox_envs() -> set[str]:
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(REPO / "tox.ini", encoding="utf-8")
    return {name.strip() for name in parser["tox"]["env_list"].split(",")}


def _loaded(name: str) -> dict[Any, Any]:
    data = yaml.safe_load((REPO / ".github" / "workflows" / name).read_text(encoding="utf-8"))
    assert isinstance(data, dict), name
    return data


def test_the_files_are_what_the_script_writes() -> None:
    assert _tool().stale_files() == [], "run: uv run --all-packages python tools/ci_workflows.py"


def test_a_stale_file_is_reported(tmp_path: Path) -> None:
    tool = _tool()
    for name, workflow in tool.workflows().items():
        (tmp_path / name).write_text(tool.render(workflow), encoding="utf-8")
    assert tool.stale_files(tmp_path) == []
    (tmp_path / "mps.yml").write_text("name: mps\n", encoding="utf-8")
    (tmp_path / "gpu.yml").unlink()
    assert sorted(Path(p).name for p in tool.stale_files(tmp_path)) == ["gpu.yml", "mps.yml"]


def test_every_workspace_member_has_a_job_on_every_python() -> None:
    jobs = _loaded("packages.yml")["jobs"]
    members = _workspace_envs()
    assert members and set(jobs) == members
    for env, job in jobs.items():
        assert job["strategy"]["matrix"]["python"] == ["3.10", "3.11", "3.12", "3.13"]
        # No main run precedes these jobs, so each selects the `slow` tests its tox env deselects.
        runs = [step.get("run", "") for step in job["steps"]]
        assert any(run.endswith(f"tox -e {env} -- -m ''") for run in runs), (env, runs)


def test_each_job_runs_tox_envs_that_exist_and_the_rest_are_there() -> None:
    defined = _tox_envs()
    named: dict[str, set[str]] = {}
    for name in ("packages.yml", "checks.yml", "mps.yml", "gpu.yml"):
        for job in _loaded(name)["jobs"].values():
            for step in job["steps"]:
                found = re.search(r"tox -e (\S+)", step.get("run", ""))
                if found:
                    named.setdefault(name, set()).update(found.group(1).split(","))
    for name, envs in named.items():
        assert envs <= defined, f"{name} runs tox envs tox.ini lacks: {envs - defined}"
    assert named["checks.yml"] == {"lint", "types", "layers", "docs", "wheels"}
    assert named["mps.yml"] == {"kernels", "accelerators", "optimizers"}
    assert "kernels" in named["gpu.yml"]


def test_the_files_have_what_github_requires() -> None:
    for path in sorted((REPO / ".github" / "workflows").glob("*.yml")):
        data = _loaded(path.name)
        # YAML 1.1 readers (PyYAML) read the bare key `on` as True; GitHub reads it as "on".
        triggers = data.get("on", data.get(True))
        assert triggers, f"{path.name}: no `on`"
        assert isinstance(data["jobs"], dict) and data["jobs"], f"{path.name}: no jobs"
        for job_id, job in data["jobs"].items():
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_-]*", job_id), job_id
            assert job["runs-on"], f"{path.name}: jobs.{job_id}.runs-on"
            assert job["steps"], f"{path.name}: jobs.{job_id}.steps"
            for step in job["steps"]:
                assert ("uses" in step) != ("run" in step), f"{path.name}: {job_id}: {step}"


def test_the_mps_job_is_macos_and_the_gpu_job_is_manual_on_a_self_hosted_runner() -> None:
    mps = _loaded("mps.yml")["jobs"]["mps"]
    assert mps["runs-on"].startswith("macos-")
    gpu = _loaded("gpu.yml")
    assert set(gpu.get("on", gpu.get(True))) == {"workflow_dispatch"}
    assert "self-hosted" in gpu["jobs"]["gpu"]["runs-on"]
