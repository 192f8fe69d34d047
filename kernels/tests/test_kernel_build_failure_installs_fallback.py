"""A failed C++ build still installs a working package that runs the pure-torch twins.

`kernels/pyproject.toml` tells scikit-build-core to build the wheel again without CMake when the
CMake build fails. This test forces the failure (``DEEPSHARD_KERNELS_FAIL_BUILD``), checks the
wheel has no compiled module, then imports the package from that wheel alone (``python -S``, so
the workspace's editable install cannot answer instead) and checks that an op warns once, says
why, and computes the same update as the reference.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent
INTERFACE_SRC = KERNELS.parent / "packages" / "interface" / "src"

_PROBE = """
import warnings
import torch
import deepshard.kernels as kernels
assert kernels.__file__.startswith(WHEEL_DIR), kernels.__file__
torch.manual_seed(0)
args = [torch.randn(1000) for _ in range(2)] + [torch.zeros(1000), torch.zeros(1000)]
expected = [t.clone() for t in args]
hyper = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    kernels.cpu_adam_step(*args, **hyper)
    kernels.cpu_adam_step(*args, **dict(hyper, step=2))
kernels.reference_adam_step(*expected, **hyper)
kernels.reference_adam_step(*expected, **dict(hyper, step=2))
assert all(torch.equal(a, b) for a, b in zip(args, expected))
messages = [str(w.message) for w in caught]
assert len(messages) == 1, messages
print(messages[0])
print(kernels.kernel_report())
"""


@pytest.mark.slow
def test_failed_build_installs_the_pure_torch_package(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH (it builds the wheel the way an install would)")
    env = dict(os.environ, DEEPSHARD_KERNELS_FAIL_BUILD="1", DEEPSHARD_BUILD_CUDA="OFF")
    build = subprocess.run(
        [uv, "build", "--wheel", "--out-dir", str(tmp_path / "dist"), str(KERNELS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    assert "failing the extension build on purpose" in build.stderr + build.stdout
    (wheel,) = (tmp_path / "dist").glob("deepshard_kernels-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "wheel")
    assert "deepshard/kernels/__init__.py" in names
    assert not [name for name in names if name.endswith((".so", ".pyd"))], names

    wheel_dir = str(tmp_path / "wheel")
    path = os.pathsep.join([wheel_dir, *site.getsitepackages(), str(INTERFACE_SRC)])
    probe = _PROBE.replace("WHEEL_DIR", repr(wheel_dir))
    run = subprocess.run(
        [sys.executable, "-S", "-c", probe],
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "the C++ build failed or was skipped" in run.stdout
    assert "pure-torch" in run.stdout
