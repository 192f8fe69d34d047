"""Which dtype ZeRO keeps its master weights in, and when a 16-bit one can be honoured.

By default every rank keeps an fp32 copy of its partition of the parameters (the *masters*),
the reduced gradients are handed to the inner optimizer in fp32, and the optimizer's states
follow the masters (fp32 Adam moments). DeepSpeed's ``bf16.bf16_master_weights_and_grads``
keeps the masters and the reduced gradients in bf16 instead, in two modes:

* with ``bf16_optimizer_states`` the states follow too: the inner optimizer simply steps bf16
  tensors (a torch or DeepShard Adam allocates its moments like its parameters), so a parameter
  costs 2 + 2 + 4 bytes of ZeRO state instead of 4 + 4 + 8;
* without it, the masters live on the host (``offload_optimizer``, ``cpu`` or ``nvme``) and the
  CPU Adam kernel steps the bf16 masters with fp32 moments (it widens to fp32 and rounds once
  per step): 2 + 8 bytes a parameter instead of 4 + 8, and no separate 16-bit copy. With both
  switches the offloaded moments are bf16 too (`host_moment_dtype`).

``fp16.fp16_master_weights_and_grads`` is DeepSpeed's fp16 form of the second mode only (fp16
moments would underflow): fp16 masters on the host, fp32 moments, the loss scale taken off the
fp16 gradients before the kernel widens them.

What DeepShard runs, and why the rest is refused:

* stages 1-3 (stage 0 has no partition to keep a master of, as DeepSpeed says);
* a model in the masters' dtype (``bf16.enabled`` / ``fp16.enabled``): the masters are the
  parameters' own precision, so a device-resident buffer or partition is its own master;
* any optimizer offload (``cpu``, ``nvme``, a partial ``ratio``: its device share keeps
  16-bit masters too and steps them widened to fp32, as the kernel does);
* Muon with bf16 masters, on the device or offloaded (stage 3, ``device: "cpu"``: Newton-Schulz
  runs on the device on the whole reduced gradient, Muon steps the bf16 host masters itself);
  its momentum follows the gradients' dtype, as plain Muon's follows a bf16 model's gradients,
  and its Adam half the optimizer's ``fp32_optimizer_states``, which the engine sets from
  ``bf16_optimizer_states``. Muon with fp16 masters is refused: those are stepped by the CPU
  Adam kernel only, as in DeepSpeed.

The config-level rules (``enabled``, the stage, ``bf16_optimizer_states`` against offload)
live in `deepshard.interface.config`'s cross-checks, so ``initialize`` refuses them before
building anything; `master_dtype_problems` repeats the ones a direct `ZeroOptimizer` caller can
break.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.interface.config import ZeroConfig
from deepshard.interface.errors import ConfigError

__all__ = ["MASTER_DTYPES", "check_param_dtypes", "host_moment_dtype", "master_dtype_problems"]

MASTER_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes ZeRO keeps masters in."""

_KEYS = {
    torch.bfloat16: "bf16.bf16_master_weights_and_grads",
    torch.float16: "fp16.fp16_master_weights_and_grads",
}
"""The config key that asks for each 16-bit master dtype."""


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
        names = ", ".join(map(str, MASTER_DTYPES))
        return [("master_dtype", f"must be one of {names}; got {master_dtype}")]
    key = _KEYS[master_dtype]
    problems = []
    if config.stage == 0:
        problems.append((key, "needs zero_optimization.stage >= 1 (stage 0 keeps no masters)"))
    offload = config.offload_optimizer
    device = "none" if offload is None else offload.device
    if master_dtype == torch.float16 and device == "none":
        problems.append(
            (key, 'needs zero_optimization.offload_optimizer ("cpu" or "nvme"): fp16 masters '
             "are stepped with fp32 moments by the CPU Adam kernel (as DeepSpeed)")
        )  # fmt: skip
    if transformed and master_dtype == torch.float16:
        problems.append(
            (key, "does not run with Muon: fp16 masters are stepped by the CPU Adam kernel, "
             "which takes the loss scale off before widening (DeepSpeed requires its CPU Adam "
             "for them too); use bf16 masters (bf16.bf16_master_weights_and_grads) with Muon")
        )  # fmt: skip
    return problems


def check_param_dtypes(master_dtype: torch.dtype, dtypes: Sequence[torch.dtype]) -> None:
    """Refuses 16-bit masters of parameters in another dtype (fp32 masters take any).

    Raises:
        ConfigError: A parameter group is not in ``master_dtype``.
    """
    others = sorted({str(d) for d in dtypes if d != master_dtype})
    if master_dtype != torch.float32 and others:
        key = _KEYS[master_dtype]
        section = key.split(".")[0]
        raise ConfigError.from_problems(
            [(key, f"keeps {master_dtype} masters of {master_dtype} parameters, but the model "
              f"holds {others}; enable {section} (the engine casts the model) or cast it "
              "yourself")]
        )  # fmt: skip


def host_moment_dtype(
    optimizer: object, master_dtype: torch.dtype, state_dtype: torch.dtype | None
) -> torch.dtype:
    """The dtype of the Adam moments the CPU Adam kernel keeps with optimizer offload.

    ``state_dtype`` when given (``bf16_optimizer_states``); else fp32, unless the optimizer says
    ``fp32_optimizer_states=False`` (DeepShard's CPU Adam), then 16 bits as the kernel pairs
    them: fp16 beside fp16 masters, bf16 otherwise.
    """
    if state_dtype is not None:
        return state_dtype
    if getattr(optimizer, "fp32_optimizer_states", True) is not False:
        return torch.float32
    return torch.float16 if master_dtype == torch.float16 else torch.bfloat16
