"""The concrete accelerators satisfy the interface's Accelerator protocol; it needs no torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deepshard.accelerators import (
    CpuAccelerator,
    CudaAccelerator,
    MpsAccelerator,
    XpuAccelerator,
    get_accelerator,
)
from deepshard.interface.accelerator import Accelerator


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator, MpsAccelerator, XpuAccelerator])
def test_every_accelerator_satisfies_the_protocol(cls):
    assert isinstance(cls(), Accelerator)


def test_get_accelerator_returns_a_protocol_instance():
    assert isinstance(get_accelerator(env={}), Accelerator)


def test_an_object_missing_members_does_not():
    class Partial:
        name = "cpu"

        def device_count(self) -> int:
            return 1

    assert not isinstance(Partial(), Accelerator)


def test_importing_the_protocol_does_not_import_torch():
    code = (
        "import sys\n"
        "import deepshard.interface.accelerator\n"
        "assert 'torch' not in sys.modules, 'deepshard.interface.accelerator imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
