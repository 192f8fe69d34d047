"""Optimizer-state helpers shared by every optimizer of the package.

Moments are kept in fp32 by default whatever the parameter dtype (``fp32_optimizer_states``,
DeepSpeed's knob). ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor
to its parameter's dtype, which would silently round fp32 moments of a bf16 parameter to bf16
on every resume; `restore_saved_dtypes` puts back the dtype each tensor was saved in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["SIXTEEN_BIT", "moment_dtype", "restore_saved_dtypes"]

SIXTEEN_BIT = (torch.bfloat16, torch.float16)


def moment_dtype(param_dtype: torch.dtype, fp32_optimizer_states: bool) -> torch.dtype:
    """The dtype of a new moment buffer for a parameter of ``param_dtype``.

    Args:
        param_dtype: The parameter's dtype.
        fp32_optimizer_states: Full-precision moments (fp64 for fp64 parameters).

    Returns:
        fp32 (fp64) when ``fp32_optimizer_states``; otherwise 16 bits: the parameter's own dtype
        when it is 16-bit, bf16 for wider parameters (an fp32 master copy keeps bf16 moments).
    """
    if fp32_optimizer_states:
        return torch.float64 if param_dtype == torch.float64 else torch.float32
    return param_dtype if param_dtype in SIXTEEN_BIT else torch.bfloat16


def restore_saved_dtypes(optimizer: torch.optim.Optimizer, state_dict: Mapping[str, Any]) -> None:
    """After ``load_state_dict``, gives each floating state tensor the dtype it was saved in.

    Args:
        optimizer: The optimizer ``state_dict`` was just loaded into.
        state_dict: The state dict as passed to ``load_state_dict``.
    """
    saved_state = state_dict["state"]
    saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for saved_id, param in zip(saved_ids, params, strict=True):
        for key, saved in saved_state.get(saved_id, {}).items():
            if not isinstance(saved, torch.Tensor) or not saved.is_floating_point():
                continue
            loaded = optimizer.state[param].get(key)
            if isinstance(loaded, torch.Tensor) and loaded.dtype != saved.dtype:
                optimizer.state[param][key] = saved.to(device=param.device, copy=True)
