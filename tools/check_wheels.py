"""Build every workspace member and prove each wheel works on its own, outside the workspace.

What a user gets from ``pip install deepshard-comm`` is the wheel, not the workspace: an editable
install can hide a file missing from the wheel, a ``deepshard/__init__.py`` that would break the
PEP 420 namespace, or a sibling dependency that was never declared. So this script:

1. builds every member (sdist, then the wheel from the sdist) into a temporary folder with
   ``uv build --all-packages``;
2. checks each archive: no ``deepshard/__init__.py``, exactly one package under ``deepshard/``,
   which carries ``py.typed``;
3. for each wheel (side by side, one per core), creates a fresh venv in the temporary folder,
   installs that wheel plus the sibling wheels its metadata requires (as files, so no registry
   can substitute a same-named project), and imports the package from a working directory
   outside the repository, checking that it was loaded from the venv and that its installed
   version is the workspace version.

Third-party dependencies (pydantic, torch) come from the package index, limited by the root
``[tool.uv] exclude-newer`` like every other resolution in the workspace.

Usage: ``python tools/check_wheels.py [--only deepshard-comm ...] [--keep]``
(``tox -e wheels`` runs it with no arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent

# Run inside each fresh venv: import the package and report where it, and the namespace, live.
_PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
module = importlib.import_module(sys.argv[1])
namespace = importlib.import_module("deepshard")
print(json.dumps({
    "file": module.__file__,
    "namespace_file": getattr(namespace, "__file__", None),
    "namespace_path": list(namespace.__path__),
    "version": importlib.metadata.version(sys.argv[2]),
    "has_torch": importlib.util.find_spec("torch") is not None,
    "torch_loaded": "torch" in sys.modules,
}))
"""


class WheelCheckError(Exception):
    """A built distribution is malformed or does not work outside the workspace."""


@dataclass(frozen=True)
class Wheel:
    """One built wheel and the parts of its metadata this script needs."""

    path: Path
    name: str
    version: str
    requires: tuple[str, ...]
    package: str

    @property
    def module(self) -> str:
        return f"deepshard.{self.package}"


def _run(cmd: list[str], cwd: Path) -> str:
    result = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shown = " ".join("<probe>" if "\n" in part else part for part in cmd)
        raise WheelCheckError(
            f"command failed ({result.returncode}): {shown}\n{result.stdout}{result.stderr}"
        )
    return result.stdout


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _sibling_requirements(requires_dist: list[str]) -> tuple[str, ...]:
    siblings = []
    for line in requires_dist:
        requirement, _, marker = line.partition(";")
        if "extra ==" in marker:
            continue  # an optional extra is not needed to import the package
        name = requirement.strip().split("==")[0].split(" ")[0].split("[")[0]
        if _canonical(name) == "deepshard" or _canonical(name).startswith("deepshard-"):
            siblings.append(_canonical(name))
    return tuple(siblings)


def _package_under_namespace(names: list[str], archive: str, prefix: str) -> str:
    namespace = f"{prefix}deepshard/"
    if f"{namespace}__init__.py" in names:
        raise WheelCheckError(f"{archive} ships {namespace}__init__.py; delete it (PEP 420)")
    packages = sorted({n[len(namespace) :].split("/")[0] for n in names if n.startswith(namespace)})
    if len(packages) != 1:
        raise WheelCheckError(f"{archive} must hold exactly one deepshard package, has {packages}")
    if f"{namespace}{packages[0]}/py.typed" not in names:
        raise WheelCheckError(f"{archive} lacks {namespace}{packages[0]}/py.typed")
    return packages[0]


def read_wheel(path: Path) -> Wheel:
    """Checks one wheel's layout and reads its name, version and sibling requirements."""
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        metadata_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(metadata_name).decode())
    package = _package_under_namespace(names, path.name, prefix="")
    return Wheel(
        path=path,
        name=_canonical(metadata["Name"]),
        version=metadata["Version"],
        requires=_sibling_requirements(metadata.get_all("Requires-Dist") or []),
        package=package,
    )


def check_sdist(path: Path) -> None:
    """Checks that an sdist carries the member's src/deepshard/<name>/ and no namespace init."""
    with tarfile.open(path) as archive:
        names = archive.getnames()
    top = names[0].split("/")[0]
    _package_under_namespace(names, path.name, prefix=f"{top}/src/")


def build_all(out_dir: Path) -> tuple[list[Wheel], list[Path]]:
    """Builds every workspace member into ``out_dir``; returns the wheels and the sdists."""
    _run(["uv", "build", "--all-packages", "--out-dir", str(out_dir)], cwd=REPO)
    wheels = [read_wheel(path) for path in sorted(out_dir.glob("*.whl"))]
    sdists = sorted(out_dir.glob("*.tar.gz"))
    members = sorted(REPO.glob("packages/*/pyproject.toml")) + sorted(
        REPO.glob("kernels/pyproject.toml")
    )
    if len(wheels) != len(members) or len(sdists) != len(members):
        raise WheelCheckError(
            f"{len(members)} members built {len(wheels)} wheels and {len(sdists)} sdists"
        )
    for sdist in sdists:
        check_sdist(sdist)
    return wheels, sdists


def _closure(wheel: Wheel, by_name: dict[str, Wheel]) -> list[Wheel]:
    needed: dict[str, Wheel] = {}
    pending = [wheel.name]
    while pending:
        name = pending.pop()
        if name in needed:
            continue
        if name not in by_name:
            raise WheelCheckError(f"{wheel.name} needs {name}, which the workspace did not build")
        needed[name] = by_name[name]
        pending.extend(by_name[name].requires)
    return sorted(needed.values(), key=lambda w: w.name)


def _exclude_newer() -> list[str]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        value = tomllib.load(handle).get("tool", {}).get("uv", {}).get("exclude-newer")
    return ["--exclude-newer", str(value)] if value else []


def install_and_import(wheel: Wheel, by_name: dict[str, Wheel], work: Path) -> dict[str, Any]:
    """Installs ``wheel`` and its sibling wheels into a fresh venv and imports it there."""
    venv = work / "venvs" / wheel.name
    _run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], cwd=work)
    python = venv / "bin" / "python"
    files = [str(w.path) for w in _closure(wheel, by_name)]
    install = ["uv", "pip", "install", "--quiet", "--python", str(python), *_exclude_newer()]
    _run([*install, *files], cwd=work)
    output = _run([str(python), "-c", _PROBE, wheel.module, wheel.name], cwd=work)
    report: dict[str, Any] = json.loads(output.strip().splitlines()[-1])
    if report["file"] is None:
        raise WheelCheckError(f"{wheel.module} has no __init__.py in {wheel.path.name}")
    where = [Path(report["file"]), *(Path(p) for p in report["namespace_path"])]
    outside = [str(p) for p in where if venv.resolve() not in p.resolve().parents]
    if outside or report["namespace_file"] is not None:
        raise WheelCheckError(f"{wheel.module} was not imported from its venv alone: {outside}")
    if report["version"] != wheel.version:
        raise WheelCheckError(f"{wheel.name} reports version {report['version']}")
    return report


def _check_light(wheel: Wheel, report: dict[str, Any]) -> None:
    # deepshard-interface declares no torch: a fresh install must not have it at all.
    if wheel.name == "deepshard-interface" and (report["has_torch"] or report["torch_loaded"]):
        raise WheelCheckError("deepshard-interface pulled torch into a fresh venv")


def _check_one(wheel: Wheel, by_name: dict[str, Wheel], work: Path) -> tuple[str | None, float]:
    start = time.monotonic()
    try:
        _check_light(wheel, install_and_import(wheel, by_name, work))
    except WheelCheckError as error:
        return str(error), time.monotonic() - start
    return None, time.monotonic() - start


def _smoke_install(wheels: list[Wheel], only: set[str] | None, work: Path) -> list[str]:
    by_name = {wheel.name: wheel for wheel in wheels}
    selected = [w for w in wheels if only is None or w.name in only]
    # Lightest first: a broken base package shows up before everything that depends on it.
    ordered = sorted(selected, key=lambda w: (len(_closure(w, by_name)), w.name))
    # Each check is a fresh venv and a cold `import torch` (most of its time, CPU-bound and
    # single-threaded), so they run side by side, one per core; reports keep the order above.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        checks = [(w, pool.submit(_check_one, w, by_name, work)) for w in ordered]
        failures = []
        for wheel, check in checks:
            error, took = check.result()
            if error is not None:
                failures.append(f"{wheel.name}: {error}")
                print(f"FAIL {wheel.name:<24} ({took:.1f}s)\n{error}", flush=True)
            else:
                print(f"ok   {wheel.name:<24} import {wheel.module} ({took:.1f}s)", flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    """Builds, checks and smoke-installs the wheels; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, help="distribution names to install")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="deepshard-wheels-"))
    try:
        start = time.monotonic()
        wheels, _ = build_all(work / "dist")
        took = time.monotonic() - start
        print(f"built and checked {len(wheels)} wheels + sdists ({took:.1f}s)", flush=True)
        failures = _smoke_install(wheels, set(args.only) if args.only else None, work)
    except WheelCheckError as error:
        failures = [str(error)]
        print(f"FAIL {error}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    if failures:
        print(f"{len(failures)} wheel check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
