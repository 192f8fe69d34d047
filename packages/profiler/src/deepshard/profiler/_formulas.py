"""FLOP and MAC formulas of aten operators, as functions of shapes.

The profiler counts at the aten level (below ``torch.nn.functional``, ``Tensor.__matmul__``,
``torch.einsum`` and Hugging Face attention, which all end in the same few operators), so a
formula takes the operator's arguments and its output. Conventions, DeepSpeed's where it is right:

* GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot``): FLOPs = 2 × MACs; the added
  bias of ``addmm``/``baddbmm`` is not counted (so ``nn.Linear`` is 2 × MACs, as in DeepSpeed
  and in ``torch.utils.flop_counter``).
* Convolution: MACs = batch × output positions × C_out × C_in/groups × kernel; a transposed
  convolution's weight is ``[C_in, C_out/groups, *k]`` and its MACs run over the *input*
  positions (each input element is scattered through the kernel), which is right for depthwise
  and grouped ones too. The bias adds one FLOP per output element.
* Attention (SDPA kernels): the two batched products, ``L·S·E`` and ``L·S·Ev`` MACs per
  batch × query head (grouped key/value heads are broadcast); its backward is five products.
* Normalisations and activations: per-element estimates (layer/group/batch norm 4 or 5 with an
  affine transform, batch norm in eval 1 or 2; relu, gelu, silu, elu, leaky relu, relu6, prelu
  1). ``tanh``, ``sigmoid`` and other transcendental functions count 0, as in DeepSpeed, whose
  LeNet numbers depend on it. Softmax, pooling and upsampling count one per element.
* Elementwise arithmetic (add, sub, mul, div): one FLOP per element of the *broadcast* result,
  shapes aligned from the trailing dimension (``numel(broadcast_shapes(a, b))``).
* Embedding lookups, views, copies and reductions count 0.

Backward kernels of the estimated families use the forward's per-element estimate.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "CATEGORY",
    "FORMULAS",
    "conv_macs",
    "elementwise_flops",
    "formula_for",
    "op_name",
    "sdpa_macs",
]

Counts = tuple[int, int]
"""(FLOPs, MACs) of one operator call."""

Formula = Callable[[Sequence[Any], dict[str, Any], Any], Counts]
"""``formula(args, kwargs, out) -> (flops, macs)``."""

aten = torch.ops.aten


def _shape(value: Any) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _numel(value: Any) -> int:
    return value.numel() if isinstance(value, torch.Tensor) else 1


def _first_tensor(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


def elementwise_flops(a: Sequence[int] | None, b: Sequence[int] | None) -> int:
    """One FLOP per element of the broadcast result (a scalar operand is ``None``).

    Broadcasting aligns the shapes from the trailing dimension (the shorter one is padded with
    1s on the left), so ``[2, 3, 4] × [4]`` has 24 elements, not the 48 of a left alignment.

    Args:
        a: The first operand's shape, or None for a Python scalar.
        b: The second operand's shape, or None for a Python scalar.

    Returns:
        ``numel(broadcast_shapes(a, b))``; 1 when both are scalars.

    Raises:
        ValueError: The shapes do not broadcast.
    """
    x, y = tuple(a or ()), tuple(b or ())
    width = max(len(x), len(y))
    x, y = (1,) * (width - len(x)) + x, (1,) * (width - len(y)) + y
    count = 1
    for m, n in zip(x, y, strict=True):
        if m != n and 1 not in (m, n):
            raise ValueError(f"shapes {tuple(a or ())} and {tuple(b or ())} do not broadcast")
        count *= n if m == 1 else m
    return count


def conv_macs(
    input_shape: Sequence[int],
    weight_shape: Sequence[int],
    output_shape: Sequence[int],
    *,
    transposed: bool,
) -> int:
    """Multiply-accumulates of one (transposed) convolution.

    Args:
        input_shape: ``[N, C_in, *spatial_in]``.
        weight_shape: ``[C_out, C_in/groups, *k]``, or ``[C_in, C_out/groups, *k]`` when
            transposed.
        output_shape: ``[N, C_out, *spatial_out]``.
        transposed: Whether it is a transposed convolution.

    Returns:
        For a convolution every output position takes ``C_in/groups × k`` products per output
        channel; for a transposed one every input position is scattered through ``C_out/groups
        × k`` products per input channel.
    """
    batch = input_shape[0]
    if transposed:
        return batch * math.prod(input_shape[2:]) * math.prod(weight_shape)
    return batch * math.prod(output_shape[2:]) * weight_shape[0] * math.prod(weight_shape[1:])


def sdpa_macs(
    query: Sequence[int], key: Sequence[int], value: Sequence[int], *, backward: bool
) -> int:
    """Multiply-accumulates of scaled dot-product attention on ``[B, H, L, E]`` tensors.

    Args:
        query: ``[B, H_q, L, E]``.
        key: ``[B, H_kv, S, E]`` (``H_q`` a multiple of ``H_kv``).
        value: ``[B, H_kv, S, Ev]``.
        backward: Count the backward kernel: the scores recomputed (``E``), the gradients of
            the probabilities and of V (``Ev`` each), of Q and of K (``E`` each).

    Returns:
        ``B·H_q·L·S·(E + Ev)`` forward, ``B·H_q·L·S·(3E + 2Ev)`` backward.
    """
    *lead, length, e = query
    s, ev = key[-2], value[-1]
    per_pair = 3 * e + 2 * ev if backward else e + ev
    return math.prod(lead) * length * s * per_pair


def _gemm(a_index: int, b_index: int) -> Formula:
    def formula(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        a, b = _shape(args[a_index]), _shape(args[b_index])
        macs = math.prod(a) * (b[-1] if len(b) > 1 else 1)
        return 2 * macs, macs

    return formula


def _convolution(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    x, w, bias, transposed = args[0], args[1], args[2], bool(args[6])
    macs = conv_macs(_shape(x), _shape(w), _shape(out), transposed=transposed)
    return 2 * macs + (_numel(out) if bias is not None else 0), macs


def _convolution_backward(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    grad_out, x, w, transposed, mask = args[0], args[1], args[2], bool(args[7]), args[10]
    # Grad input and grad weight are each a convolution as large as the forward one.
    macs = conv_macs(_shape(x), _shape(w), _shape(grad_out), transposed=transposed)
    total = macs * (int(mask[0]) + int(mask[1]))
    return 2 * total + (_numel(grad_out) if mask[2] else 0), total


def _sdpa(first: int, *, backward: bool) -> Formula:
    def formula(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        q, k, v = (_shape(args[first + i]) for i in range(3))
        macs = sdpa_macs(q, k, v, backward=backward)
        return 2 * macs, macs

    return formula


def _elementwise(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    # The operator ran, so its result (the operand itself for an in-place one) has exactly the
    # broadcast shape: its size is `elementwise_flops` of the operands, without recomputing it.
    return _numel(_first_tensor(out)), 0


def _per_element(factor: int, *, of_output: bool = False) -> Formula:
    def formula(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        source = _first_tensor(out) if of_output else args[0]
        return factor * _numel(source), 0

    return formula


def _affine_norm(weight_index: int) -> Formula:
    def formula(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        affine = len(args) > weight_index and args[weight_index] is not None
        return (5 if affine else 4) * _numel(args[0]), 0

    return formula


def _batch_norm(*, always_eval: bool = False) -> Formula:
    def formula(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
        affine = args[1] is not None
        # (input, weight, bias, running_mean, running_var, training, ...); the overload of
        # `_native_batch_norm_legit` without running stats has the flag at index 3.
        training = not always_eval and bool(args[5] if len(args) >= 8 else args[3])
        per = (5 if affine else 4) if training else (2 if affine else 1)
        return per * _numel(args[0]), 0

    return formula


def _rms_norm(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    affine = len(args) > 2 and args[2] is not None
    return (4 if affine else 3) * _numel(args[0]), 0


def _zero(args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> Counts:
    return 0, 0


_GEMMS: dict[str, Formula] = {
    "mm": _gemm(0, 1),
    "addmm": _gemm(1, 2),
    "bmm": _gemm(0, 1),
    "baddbmm": _gemm(1, 2),
    "mv": _gemm(0, 1),
    "addmv": _gemm(1, 2),
    "dot": _gemm(0, 1),
    "vdot": _gemm(0, 1),
    "_scaled_mm": _gemm(0, 1),
}
_CONVOLUTIONS: dict[str, Formula] = {
    "convolution": _convolution,
    "_convolution": _convolution,
    "convolution_backward": _convolution_backward,
}
_ATTENTION: dict[str, Formula] = {
    "_scaled_dot_product_flash_attention": _sdpa(0, backward=False),
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa(0, backward=False),
    "_scaled_dot_product_efficient_attention": _sdpa(0, backward=False),
    "_scaled_dot_product_cudnn_attention": _sdpa(0, backward=False),
    "_scaled_dot_product_fused_attention_overrideable": _sdpa(0, backward=False),
    "_scaled_dot_product_flash_attention_backward": _sdpa(1, backward=True),
    "_scaled_dot_product_flash_attention_for_cpu_backward": _sdpa(1, backward=True),
    "_scaled_dot_product_efficient_attention_backward": _sdpa(1, backward=True),
    "_scaled_dot_product_cudnn_attention_backward": _sdpa(1, backward=True),
    "_scaled_dot_product_fused_attention_overrideable_backward": _sdpa(1, backward=True),
}
_NORMS: dict[str, Formula] = {
    "native_layer_norm": _affine_norm(2),
    "native_group_norm": _affine_norm(1),
    "native_batch_norm": _batch_norm(),
    "_native_batch_norm_legit": _batch_norm(),
    "_native_batch_norm_legit_no_training": _batch_norm(always_eval=True),
    "cudnn_batch_norm": _batch_norm(),
    "miopen_batch_norm": _batch_norm(),
    "_fused_rms_norm": _rms_norm,
    "native_layer_norm_backward": _per_element(5),
    "native_group_norm_backward": _per_element(5),
    "native_batch_norm_backward": _per_element(5),
    "cudnn_batch_norm_backward": _per_element(5),
}
_ACTIVATIONS = (
    "relu gelu silu elu leaky_relu hardtanh _prelu_kernel prelu threshold_backward "
    "gelu_backward silu_backward elu_backward leaky_relu_backward hardtanh_backward"
)
_PER_ELEMENT = (
    "_softmax _log_softmax _softmax_backward_data _log_softmax_backward_data "
    "avg_pool1d avg_pool2d avg_pool3d max_pool1d max_pool2d max_pool3d max_pool1d_with_indices "
    "max_pool2d_with_indices max_pool3d_with_indices _adaptive_avg_pool2d _adaptive_avg_pool3d "
    "adaptive_max_pool2d adaptive_max_pool3d"
)
_OF_OUTPUT = (
    "upsample_nearest1d upsample_nearest2d upsample_nearest3d _upsample_nearest_exact1d "
    "_upsample_nearest_exact2d _upsample_nearest_exact3d upsample_linear1d upsample_bilinear2d "
    "upsample_bicubic2d upsample_trilinear3d avg_pool2d_backward avg_pool3d_backward "
    "max_pool2d_with_indices_backward max_pool3d_with_indices_backward "
    "_adaptive_avg_pool2d_backward _adaptive_avg_pool3d_backward"
)
_ELEMENTWISE = "add sub rsub mul div"


def _table() -> dict[str, Formula]:
    table: dict[str, Formula] = {**_GEMMS, **_CONVOLUTIONS, **_ATTENTION, **_NORMS}
    for name in _ACTIVATIONS.split() + _PER_ELEMENT.split():
        table[name] = _per_element(1)
    for name in _OF_OUTPUT.split():
        table[name] = _per_element(1, of_output=True)
    for name in _ELEMENTWISE.split():
        table[name] = _elementwise
    table["embedding"] = _zero
    return table


FORMULAS: dict[str, Formula] = _table()
"""Formula per aten operator name (the overload packet: ``mm`` covers ``mm.default``/``mm.out``,
``add`` covers ``add.Tensor``/``add_.Tensor`` through the in-place name below)."""


def op_name(func: Any) -> str:
    """The name a counted operator is reported under: in-place variants (``add_``) under their
    operator's name (``add``)."""
    name: str = func.overloadpacket.__name__
    return name if name in FORMULAS else name.rstrip("_")


def formula_for(func: Any) -> Formula | None:
    """The formula of an aten ``OpOverload``, or None when the operator counts nothing.

    In-place and out variants (``add_``, ``mul_``) share their operator's formula.
    """
    formula = FORMULAS.get(op_name(func))
    return None if formula is _zero else formula


CATEGORY: dict[str, str] = {
    **dict.fromkeys(_GEMMS, "gemm"),
    **dict.fromkeys(_CONVOLUTIONS, "convolution"),
    **dict.fromkeys(_ATTENTION, "attention"),
    **dict.fromkeys(_NORMS, "normalization"),
    **dict.fromkeys(_ACTIVATIONS.split(), "activation"),
    **dict.fromkeys(_PER_ELEMENT.split() + _OF_OUTPUT.split(), "softmax/pool/upsample"),
    **dict.fromkeys(_ELEMENTWISE.split(), "elementwise"),
}
"""The family of each counted operator, for the report."""
