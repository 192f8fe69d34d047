"""The compiled deepshard.kernels._cuda imports and reports on a machine without a GPU driver.

The CUDA runtime is linked statically (cmake/cuda.cmake), so only a launch needs a driver; the
module must import, describe itself, count 0 devices and validate input without one. Skipped
when the package was built without a CUDA compiler (then `fused_adam_status` says so).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from deepshard.kernels import fused_adam_status


@pytest.fixture
def cuda_module() -> ModuleType:
    compiled, reason = fused_adam_status()
    if not compiled:
        pytest.skip(f"the CUDA module is not built here: {reason}")
    return importlib.import_module("deepshard.kernels._cuda")


def test_module_describes_its_build(cuda_module: ModuleType) -> None:
    compiled, description = fused_adam_status()
    assert compiled
    assert f"CUDA architectures {cuda_module.cuda_architectures}" in description
    assert "CUDA runtime" in cuda_module.runtime_summary()
    assert cuda_module.cuda_architectures.replace(",", "").isalnum()


def test_device_count_matches_torch(cuda_module: ModuleType) -> None:
    assert cuda_module.visible_device_count() == torch.cuda.device_count()


def test_inconsistent_tables_are_refused_before_any_launch(cuda_module: ModuleType) -> None:
    scalars = {
        "grad_type": 0,
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "bias_correction1": 0.1,
        "bias_correction2_sqrt": 0.03,
        "adamw_mode": True,
        "device": 0,
        "stream": 0,
    }
    with pytest.raises(ValueError, match="same length"):
        cuda_module.fused_adam_step([1], [1], [1], [1], [4, 4], **scalars)
    with pytest.raises(ValueError, match="null data pointer"):
        cuda_module.fused_adam_step([0], [16], [16], [16], [4], **scalars)
    with pytest.raises(ValueError, match="element count"):
        cuda_module.fused_adam_step([16], [16], [16], [16], [-1], **scalars)
    with pytest.raises(ValueError, match="gradient type"):
        cuda_module.fused_adam_step([16], [16], [16], [16], [4], **{**scalars, "grad_type": 7})


def test_empty_tables_need_no_device(cuda_module: ModuleType) -> None:
    # Nothing to update: returns without touching the (here absent) driver.
    cuda_module.fused_adam_step(
        [16], [16], [16], [16], [0], 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1.0, 1.0, False, 0, 0
    )
