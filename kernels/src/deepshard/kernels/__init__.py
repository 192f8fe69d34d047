"""Compiled DeepShard ops with a pure-torch twin for each.

- `cpu_adam_step` / `cpu_lion_step`: Adam/AdamW and Lion on flat CPU tensors, one pass over
  memory on the best SIMD path of the CPU (AVX-512, AVX2, NEON, SVE or scalar), multi-threaded.
- `fused_adam_step`: multi-tensor Adam/AdamW for CUDA tensors (compiled kernel) and MPS tensors
  (a Metal kernel compiled at first use through ``torch.mps.compile_shader``).
- `foreach_adam_step` / `foreach_lion_step`: the dtype-general ``torch._foreach`` twins (any
  device, any floating dtype) that `fused_adam_step` falls back to and
  deepshard-optimizers' ``impl="foreach"`` runs.
- `fused_weighted_sum`: a mixture-of-experts layer's combine (expert-sorted rows back into
  weighted token rows, fp32 accumulation) in one pass, differentiable; Triton kernels on CUDA
  tensors, the pure-torch twin `reference_fused_weighted_sum` everywhere else.

Every op is a ``torch.library`` custom op (``deepshard::...``), so it composes with
``torch.compile``. Importing this package loads no extension; the first call does, and if the
compiled code cannot be loaded the op runs its pure-torch twin (``reference_*``) after one warning
saying why. ``python -m deepshard.kernels`` prints `kernel_report()`.
"""

from __future__ import annotations

# _mps_adam registers the MPS kernel of deepshard::fused_adam_step (cheap: nothing compiles).
from deepshard.kernels import _mps_adam  # noqa: F401
from deepshard.kernels._cpu_ops import cpu_adam_step, cpu_lion_step
from deepshard.kernels._extension import SIMD_ENV_VAR
from deepshard.kernels._foreach import compute_dtype, foreach_adam_step, foreach_lion_step
from deepshard.kernels._fused_adam import fused_adam_status, fused_adam_step
from deepshard.kernels._reference import reference_adam_step, reference_lion_step
from deepshard.kernels._report import KernelReport, OpReport, kernel_report
from deepshard.kernels._simd import active_simd_path, available_simd_paths, use_simd_path
from deepshard.kernels._weighted_sum import (
    fused_weighted_sum,
    fused_weighted_sum_status,
    reference_fused_weighted_sum,
)

__all__ = [
    "SIMD_ENV_VAR",
    "KernelReport",
    "OpReport",
    "active_simd_path",
    "available_simd_paths",
    "compute_dtype",
    "cpu_adam_step",
    "cpu_lion_step",
    "foreach_adam_step",
    "foreach_lion_step",
    "fused_adam_status",
    "fused_adam_step",
    "fused_weighted_sum",
    "fused_weighted_sum_status",
    "kernel_report",
    "reference_adam_step",
    "reference_fused_weighted_sum",
    "reference_lion_step",
    "use_simd_path",
]
