"""The per-step scalars of Adam and Lion, exactly as the C++ kernels compute them.

The kernels take the hyper-parameters as float32 and derive their constants in float32
arithmetic (csrc/cpu/scalar_math.h, ``adam_consts``/``lion_consts``). The pure-torch twins use
the same float32 values, so twin and kernel round identically. A float32 result of one ``+ - * /``
on two float32 values is obtained here in Python's float64 followed by one rounding to float32;
that double rounding is known to be exact for these operations (53 >= 2 * 24 + 2 bits).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

__all__ = [
    "AdamConstants",
    "LionConstants",
    "adam_constants",
    "bias_corrections",
    "f32",
    "lion_constants",
]


def f32(value: float) -> float:
    """Rounds a Python float to the nearest float32 (ties to even), returned as a Python float."""
    rounded: float = struct.unpack("f", struct.pack("f", value))[0]
    return rounded


def bias_corrections(step: int, beta1: float, beta2: float, enabled: bool) -> tuple[float, float]:
    """Returns ``(1 - beta1**step, sqrt(1 - beta2**step))`` in float64, as torch.optim.Adam does.

    Both are 1 when bias correction is off.
    """
    if not enabled:
        return 1.0, 1.0
    return 1.0 - beta1**step, (1.0 - beta2**step) ** 0.5


@dataclass(frozen=True)
class AdamConstants:
    """The float32 constants of one Adam step (mirror of the C++ ``AdamConsts``)."""

    decay: float
    weight_decay: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    bias_correction2_sqrt: float
    eps: float
    step_size: float


def adam_constants(
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
) -> AdamConstants:
    """Computes the float32 constants the kernels use for this step."""
    bc1, bc2_sqrt = bias_corrections(step, beta1, beta2, bias_correction)
    lr32, wd32, b1, b2 = f32(lr), f32(weight_decay), f32(beta1), f32(beta2)
    return AdamConstants(
        decay=f32(1.0 - f32(lr32 * wd32)),
        weight_decay=wd32,
        beta1=b1,
        one_minus_beta1=f32(1.0 - b1),
        beta2=b2,
        one_minus_beta2=f32(1.0 - b2),
        bias_correction2_sqrt=f32(bc2_sqrt),
        eps=f32(eps),
        step_size=f32(lr32 / f32(bc1)),
    )


@dataclass(frozen=True)
class LionConstants:
    """The float32 constants of one Lion step (mirror of the C++ ``LionConsts``)."""

    decay: float
    lr: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float


def lion_constants(*, lr: float, beta1: float, beta2: float, weight_decay: float) -> LionConstants:
    """Computes the float32 constants the kernels use for a Lion step."""
    lr32, b1, b2 = f32(lr), f32(beta1), f32(beta2)
    return LionConstants(
        decay=f32(1.0 - f32(lr32 * f32(weight_decay))),
        lr=lr32,
        beta1=b1,
        one_minus_beta1=f32(1.0 - b1),
        beta2=b2,
        one_minus_beta2=f32(1.0 - b2),
    )
