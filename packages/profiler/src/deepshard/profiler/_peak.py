"""Peak dense FLOP/s of known accelerators, for the model FLOPs utilisation (MFU).

The numbers are the vendors' dense (no sparsity) tensor-core peaks for 16-bit inputs and the
plain FP32 peak, per device. A device or dtype not listed has no known peak: the report then
prints no MFU rather than a guess (pass ``peak_flops=`` to the profiler instead).
"""

from __future__ import annotations

import torch

__all__ = ["PEAK_FLOPS", "peak_flops_of"]

PEAK_FLOPS: dict[str, dict[torch.dtype, float]] = {
    # (name fragment as torch reports it) -> dtype -> FLOP/s; most specific fragments first.
    "H200": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "H100 PCIe": {torch.bfloat16: 756.5e12, torch.float16: 756.5e12, torch.float32: 51.2e12},
    "H100": {torch.bfloat16: 989.4e12, torch.float16: 989.4e12, torch.float32: 66.9e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12, torch.float32: 19.5e12},
    "V100": {torch.float16: 125e12, torch.float32: 15.7e12},
}
"""Peak FLOP/s per device-name fragment and dtype."""


def peak_flops_of(device: torch.device, dtype: torch.dtype) -> float | None:
    """The peak FLOP/s of one ``device`` computing in ``dtype``, when it is listed.

    Args:
        device: A CUDA device (others have no table entry).
        dtype: The compute dtype.

    Returns:
        FLOP/s, or None when the device or dtype is not in `PEAK_FLOPS`.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in name:
            return peaks.get(dtype)
    return None
