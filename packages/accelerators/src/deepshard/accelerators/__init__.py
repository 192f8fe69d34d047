"""Device abstraction for DeepShard over ``torch.accelerator``: cpu, cuda, mps and xpu.

``get_accelerator()`` picks the device (argument, then ``DEEPSHARD_ACCELERATOR``, then
``DS_ACCELERATOR``, then auto-detection) and returns a stateless object satisfying
`deepshard.interface.accelerator.Accelerator`.
"""

from __future__ import annotations

from deepshard.accelerators._base import AcceleratorBase
from deepshard.accelerators._cpu import CpuAccelerator
from deepshard.accelerators._device import (
    CudaAccelerator,
    DeviceAccelerator,
    MpsAccelerator,
    XpuAccelerator,
)
from deepshard.accelerators._errors import AcceleratorError
from deepshard.accelerators._info import torch_info
from deepshard.accelerators._selection import ACCELERATOR_NAMES, ENV_VARS, get_accelerator

__all__ = [
    "ACCELERATOR_NAMES",
    "ENV_VARS",
    "AcceleratorBase",
    "AcceleratorError",
    "CpuAccelerator",
    "CudaAccelerator",
    "DeviceAccelerator",
    "MpsAccelerator",
    "XpuAccelerator",
    "get_accelerator",
    "torch_info",
]
