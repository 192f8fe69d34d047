"""Importing the light packages never imports torch.

``deepshard.interface`` is imported by every package (and by ``ds-launch``, which must start
instantly), so importing it, or any of its submodules, must not pull in torch. Each check runs in
a fresh interpreter: this test process has torch loaded already.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

# deepshard.launcher joins this list when its package lands (it may import only the interface).
LIGHT_PACKAGES = ("deepshard.interface", "deepshard.launcher")
HEAVY_MODULES = ("torch",)

_PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
imported = [package.__name__]
for info in pkgutil.walk_packages(package.__path__, prefix=package.__name__ + "."):
    importlib.import_module(info.name)
    imported.append(info.name)
heavy = sorted(name for name in sys.argv[2:] if name in sys.modules)
print(json.dumps({"imported": imported, "heavy": heavy}))
"""


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _probe(package: str, *modules: str) -> dict[str, list[str]]:
    """Import `package` in a fresh interpreter; report which of `modules` it loaded."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, package, *modules],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, list[str]] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


@pytest.mark.parametrize("package", LIGHT_PACKAGES)
def test_importing_light_package_leaves_torch_unloaded(package: str) -> None:
    if not _installed(package):
        pytest.skip(f"{package} is not part of the workspace yet")
    report = _probe(package, *HEAVY_MODULES)
    assert package in report["imported"]
    assert report["heavy"] == [], f"importing {package} pulled in {report['heavy']}"


def test_probe_detects_an_imported_dependency() -> None:
    # The probe itself must be able to fail: the interface is built on pydantic, so asking
    # about pydantic has to report it.
    report = _probe("deepshard.interface", "pydantic")
    assert report["heavy"] == ["pydantic"]
