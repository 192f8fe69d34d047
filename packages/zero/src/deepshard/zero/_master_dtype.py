"""Which dtype ZeRO keeps its master weights in, and when a 16-bit one can be honoured.

By default every rank keeps an fp32 copy of its partition of the parameters (the *masters*),
the reduced gradients are handed to the inner optimizer in fp32, and the optimizer's states
follow the masters (fp32 Adam moments). DeepSpeed's ``bf16.bf16_master_weights_and_grads``
keeps the masters and the reduced gradients in bf16 instead, in two modes:

* with ``bf16_optimizer_states`` the states follow too: the inner optimizer simply steps bf16
  tensors (a torch or DeepShard Adam allocates its moments like its parameters), so a parameter
  costs 2 + 2 + 4 bytes of ZeRO state instead of 4 + 4 + 8;
* without it, the masters live on the host (``offload_optimizer: {device: cpu}``) and the CPU
  Adam kernel steps the bf16 masters with fp32 moments (it widens to fp32 and rounds once per
  step): host memory 2 + 8 bytes a parameter instead of 4 + 8, and no separate 16-bit copy.

What DeepShard runs, and why the rest is refused:

* stages 1-3 (stage 0 has no partition to keep a master of, as DeepSpeed says);
* a bf16 model (``bf16.enabled``): the masters are the parameters' own precision, so a
  device-resident bf16 buffer or partition is its own master and nothing is copied;
* optimizer offload to ``cpu`` with the whole partition (``ratio`` 1): NVMe slots and the
  device share of a partial offload keep fp32 masters (planned);
* no full-gradient transform (Muon): its momentum buffers and its Adam half keep fp32 state of
  their own, which is not what ``bf16_optimizer_states`` asks for (planned).

The config-level rules (`bf16.enabled`, the stage, ``bf16_optimizer_states`` against offload)
live in `deepshard.interface.config`'s cross-checks, so ``initialize`` refuses them before
building anything; `master_dtype_problems` repeats the ones a direct `ZeroOptimizer` caller can
break.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError

__all__ = ["MASTER_DTYPES", "check_param_dtypes", "master_dtype_problems"]

MASTER_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes ZeRO keeps masters in."""

_KEY = "bf16.bf16_master_weights_and_grads"


def master_dtype_problems(
    config: ZeroConfig, master_dtype: torch.dtype, *, transformed: bool
) -> list[tuple[str, str]]:
    """Why ``master_dtype`` cannot be honoured with this ``zero_optimization`` section.

    Args:
        config: The ``zero_optimization`` section.
        master_dtype: The requested master dtype.
        transformed: A full-gradient transform (Muon) is used.

    Returns:
        ``(key path, message)`` pairs; empty when it can run.
    """
    if master_dtype == torch.float32:
        return []
    if master_dtype not in MASTER_DTYPES:
        return [("master_dtype", f"must be torch.float32 or torch.bfloat16, got {master_dtype}")]
    problems = []
    if config.stage == 0:
        problems.append((_KEY, "needs zero_optimization.stage >= 1 (stage 0 keeps no masters)"))
    offload = config.offload_optimizer
    if offload is not None and offload.device == "nvme":
        problems.append((_KEY, "with NVMe optimizer offload is planned; use device cpu"))
    if offload is not None and offload.device != "none" and offload.ratio < 1.0:
        problems.append((_KEY, "with a partial optimizer offload (ratio < 1) is planned"))
    if transformed:
        problems.append(
            (_KEY, "with Muon is planned (its momentum and Adam half keep fp32 state); use "
             "AdamW or remove bf16_master_weights_and_grads")
        )  # fmt: skip
    return problems


def check_param_dtypes(master_dtype: torch.dtype, dtypes: Sequence[torch.dtype]) -> None:
    """Refuses 16-bit masters of parameters in another dtype (fp32 masters take any).

    Raises:
        ConfigError: A parameter group is not in ``master_dtype``.
    """
    others = sorted({str(d) for d in dtypes if d != master_dtype})
    if master_dtype != torch.float32 and others:
        raise ConfigError.from_problems(
            [(_KEY, f"keeps {master_dtype} masters of {master_dtype} parameters, but the model "
              f"holds {others}; enable bf16 (the engine casts the model) or cast it yourself")]
        )  # fmt: skip
