"""Transposed convolutions and broadcasting elementwise ops, through the profiler and the pure
formulas.

Transposed convolution: each input element is scattered through ``C_out/groups × k`` weights
per input channel, so MACs = N × input positions × C_in × C_out/groups × k (weight
``[C_in, C_out/groups, *k]``); on (2, C_in, 8, 8) that is 2·64·4·6·16 = 49,152,
2·64·4·1·9 = 4,608 (depthwise) and 2·64·6·2·4 = 6,144 (grouped). Elementwise ops count the
elements of the broadcast result, shapes aligned from the trailing dimension.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from deepshard.profiler import CountMode, FlopsProfiler, conv_macs, elementwise_flops


def _profile(model: nn.Module, count_mode: CountMode, *inputs: torch.Tensor) -> tuple[int, int]:
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    model(*inputs)
    flops, macs = prof.get_total_flops(), prof.get_total_macs()
    prof.end_profile()
    assert isinstance(flops, int) and isinstance(macs, int)
    return flops, macs


@pytest.mark.parametrize(
    ("layer", "macs"),
    [
        (nn.ConvTranspose2d(4, 6, 4, stride=2, padding=1), 49_152),
        (nn.ConvTranspose2d(4, 4, 3, stride=2, padding=1, output_padding=1, groups=4), 4_608),
        (nn.ConvTranspose2d(6, 6, 2, stride=2, groups=3), 6_144),
    ],
)
def test_transposed_convolution_macs(
    layer: nn.ConvTranspose2d, macs: int, count_mode: CountMode
) -> None:
    x = torch.randn(2, layer.in_channels, 8, 8)
    out = layer(x)
    flops, counted = _profile(layer, count_mode, x)
    assert counted == macs
    assert flops == 2 * macs + out.numel()  # the bias adds one per output element
    # The output size the transposed formula gives is the one torch produced.
    (k,), (s,), (p,), (op,) = (layer.kernel_size[:1], layer.stride[:1], layer.padding[:1],
                               layer.output_padding[:1])  # fmt: skip
    assert out.shape[-1] == (8 - 1) * s - 2 * p + (k - 1) + op + 1


def test_convolution_macs_of_grouped_and_depthwise_layers(count_mode: CountMode) -> None:
    for groups in (1, 2, 4):
        layer = nn.Conv2d(4, 8, 3, padding=1, groups=groups, bias=False)
        flops, macs = _profile(layer, count_mode, torch.randn(2, 4, 6, 6))
        assert macs == 2 * 36 * 8 * (4 // groups) * 9 and flops == 2 * macs
    assert conv_macs((2, 4, 8, 8), (4, 1, 3, 3), (2, 4, 16, 16), transposed=True) == 4_608


class _Mul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a * b


@pytest.mark.parametrize(
    ("a", "b", "flops"),
    [
        ((2, 3, 4), (4,), 24),
        ((4,), (2, 3, 4), 24),
        ((8,), (2, 8), 16),
        ((4, 1, 7), (1, 5, 7), 140),
    ],
)
def test_elementwise_mul_counts_the_broadcast_result(
    a: tuple[int, ...], b: tuple[int, ...], flops: int, count_mode: CountMode
) -> None:
    assert elementwise_flops(a, b) == flops
    assert _profile(_Mul(), count_mode, torch.randn(a), torch.randn(b)) == (flops, 0)


def test_scalar_operands_count_the_tensor() -> None:
    assert elementwise_flops((3, 5), None) == 15
    assert elementwise_flops(None, None) == 1
