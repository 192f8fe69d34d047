"""The MPS implementation of ``deepshard::fused_adam_step``: a Metal kernel, the twin as fallback.

The same op as the CUDA kernel (`_fused_adam`), registered for the MPS dispatch key with
``register_kernel("mps")``, so ``fused_adam_step`` on MPS tensors (eager or inside
``torch.compile``) runs this. The kernel below is compiled from source at the first MPS call
through ``torch.mps.compile_shader`` (no Objective-C++ toolchain at install time). One thread
updates one element of one tensor, in fp32, in the twin's order::

    adamw_mode:  p *= 1 - lr * weight_decay      otherwise:  g += weight_decay * p
    m = mix(m, g, 1 - beta1)                     (torch's lerp)
    v = beta2 * v + (1 - beta2) * g * g
    p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)

so it matches `reference_fused_adam_step` to rounding (Metal may contract to FMA). The step's
scalars travel in one small fp32 tensor rather than as separate scalar arguments, so the
binding of Python numbers to Metal types does not matter. fp16 gradients are read as ``half``;
bf16 ones are widened on the host (Metal's ``bfloat`` needs macOS 14). Each tensor is one
dispatch. When the shader cannot be compiled (no MPS, an old OS) the twin runs after one
warning that says why.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from deepshard.kernels._constants import bias_corrections
from deepshard.kernels._extension import ExtensionLoader
from deepshard.kernels._fused_adam import _AdamHyper, _foreach_adam, _fused_adam_op

__all__ = ["MPS_ADAM_SOURCE", "MPS_SHADERS", "compile_mps_adam", "mps_fused_adam"]

MPS_ADAM_SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// h: lr, beta1, beta2, eps, weight_decay, step_size (lr / bc1), bc2_sqrt.
template <typename G, bool ADAMW>
kernel void adam_step(device float* param [[buffer(0)]],
                      device const G* grad [[buffer(1)]],
                      device float* exp_avg [[buffer(2)]],
                      device float* exp_avg_sq [[buffer(3)]],
                      device const float* h [[buffer(4)]],
                      uint i [[thread_position_in_grid]]) {
  float p = param[i];
  float g = float(grad[i]);
  const float lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], wd = h[4];
  if (ADAMW) {
    p = p * (1.0f - lr * wd);
  } else {
    g = g + wd * p;
  }
  float m = mix(exp_avg[i], g, 1.0f - beta1);
  float v = beta2 * exp_avg_sq[i] + (1.0f - beta2) * g * g;
  float denom = sqrt(v) / h[6] + eps;
  param[i] = p - h[5] * (m / denom);
  exp_avg[i] = m;
  exp_avg_sq[i] = v;
}

#define DS_ADAM(G, NAME, ADAMW)                                         \
  template [[host_name(NAME)]] kernel void adam_step<G, ADAMW>(         \
      device float* param [[buffer(0)]],                                \
      device const G* grad [[buffer(1)]],                               \
      device float* exp_avg [[buffer(2)]],                              \
      device float* exp_avg_sq [[buffer(3)]],                           \
      device const float* h [[buffer(4)]],                              \
      uint i [[thread_position_in_grid]]);
DS_ADAM(float, "adam_step_float_adamw", true)
DS_ADAM(float, "adam_step_float_l2", false)
DS_ADAM(half, "adam_step_half_adamw", true)
DS_ADAM(half, "adam_step_half_l2", false)
"""
"""The Metal source of the kernel (four entry points: fp32/fp16 gradient x AdamW/L2 decay)."""

_KERNEL_GRADS = {torch.float32: "float", torch.float16: "half"}


def compile_mps_adam() -> Any:
    """Compiles `MPS_ADAM_SOURCE`; returns the shader library.

    Raises:
        RuntimeError: MPS is unavailable, or the Metal compiler refused the source.
    """
    if not torch.backends.mps.is_available():
        raise RuntimeError(
            "MPS is not available (torch.backends.mps.is_available() is False: not an "
            "Apple-silicon Mac, or torch built without MPS)"
        )
    return torch.mps.compile_shader(MPS_ADAM_SOURCE)


MPS_SHADERS: ExtensionLoader[Any] = ExtensionLoader(
    "deepshard.kernels:metal-fused-adam",
    hint="Use torch >= 2.6 on macOS 13 or later with an Apple-silicon GPU.",
    importer=compile_mps_adam,
)
"""Compiles the Metal library once, at the first MPS call; remembers why when it cannot."""


@functools.cache
def _warn_shader_unavailable(reason: str) -> None:
    warnings.warn(
        f"fused_adam_step: the MPS kernel is unavailable, using the torch._foreach twin "
        f"instead: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )


def _launch(library: Any, tensors: tuple[torch.Tensor, ...], hyper: _AdamHyper) -> None:
    param, grad, exp_avg, exp_avg_sq = tensors
    if grad.dtype not in _KERNEL_GRADS:
        grad = grad.to(torch.float32)
    bc1, bc2_sqrt = bias_corrections(hyper.step, hyper.beta1, hyper.beta2, hyper.bias_correction)
    scalars = (hyper.lr, hyper.beta1, hyper.beta2, hyper.eps, hyper.weight_decay, hyper.lr / bc1)
    h = torch.tensor((*scalars, bc2_sqrt), dtype=torch.float32, device=param.device)
    kind = "adamw" if hyper.adamw_mode else "l2"
    kernel = getattr(library, f"adam_step_{_KERNEL_GRADS[grad.dtype]}_{kind}")
    kernel(param, grad, exp_avg, exp_avg_sq, h, threads=param.numel())


def mps_fused_adam(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adamw_mode: bool,
    bias_correction: bool,
) -> None:
    """The op's MPS kernel: the Metal library if it compiled, else the twin after one warning."""
    hyper = _AdamHyper(step, lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction)
    library = MPS_SHADERS.load()
    on_mps = bool(params) and params[0].device.type == "mps"
    if library is None or not on_mps:
        if on_mps:
            _warn_shader_unavailable(MPS_SHADERS.failure_with_hint())
        _foreach_adam(params, grads, exp_avgs, exp_avg_sqs, hyper)
        return
    for tensors in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True):
        if tensors[0].numel():
            _launch(library, tensors, hyper)


_fused_adam_op.register_kernel("mps")(mps_fused_adam)
