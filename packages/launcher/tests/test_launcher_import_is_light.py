"""Importing any launcher module never loads torch, numpy or deepshard.comm; --help is instant."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

import deepshard.launcher as launcher

HEAVY = ("torch", "numpy", "deepshard.comm", "deepshard.accelerators")

_PROBE = """
import importlib, json, pkgutil, sys
import deepshard.launcher as package
first = sorted(name for name in sys.modules if name.startswith(("deepshard.interface", "pydantic")))
from deepshard.launcher.cli import build_parser
build_parser()
after_cli = sorted(name for name in sys.modules if name.startswith("pydantic"))
names = [info.name for info in pkgutil.walk_packages(package.__path__, "deepshard.launcher.")]
for name in names:
    importlib.import_module(name)
for name in package.__all__:
    getattr(package, name)
heavy = sorted(name for name in sys.argv[1:] if name in sys.modules)
print(json.dumps({"first": first, "after_cli": after_cli, "modules": names, "heavy": heavy}))
"""


def test_every_module_imports_without_heavy_dependencies() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, *HEAVY, "pydantic"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert "deepshard.launcher.node" in report["modules"] and len(report["modules"]) >= 15
    # Only pydantic (through deepshard.interface) is heavy-ish, and only once a name is used.
    assert report["heavy"] == ["pydantic"]
    assert report["first"] == [] and report["after_cli"] == []


def test_help_answers_at_once() -> None:
    ds_launch = Path(sys.executable).parent / "ds-launch"
    start = time.monotonic()
    done = subprocess.run(
        [str(ds_launch), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr
    for flag in ("--hostfile", "--include", "--nproc_per_node", "--launcher", "--dry_run"):
        assert flag in done.stdout
    assert took < 3.0, f"ds-launch --help took {took:.2f} s"


def test_public_names_load_lazily_and_unknown_names_fail() -> None:
    assert set(launcher.__all__) <= set(dir(launcher))
    assert launcher.parse_hostfile_text("a slots=1") == {"a": 1}
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = launcher.nope  # type: ignore[attr-defined]
