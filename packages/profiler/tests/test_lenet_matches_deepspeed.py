"""LeNet-5 on (1024, 1, 32, 32) gives DeepSpeed's numbers: 866,076,672 FLOPs, 426,516,480 MACs,
61,706 parameters (the model of DeepSpeed's own profiler test, ending in a softmax).

The expected values are also derived here layer by layer from the formulas (convolutions 2 ×
MACs plus one FLOP per output element for the bias, linear layers 2 × MACs, pooling and softmax
one per input element, tanh 0), and the model runs on the meta device, so no arithmetic is done.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepshard.profiler import CountMode, FlopsProfiler, get_model_profile

BATCH = 1024


class LeNet5(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feature_extractor = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(6, 16, 5), nn.Tanh(), nn.AvgPool2d(2),
            nn.Conv2d(16, 120, 5), nn.Tanh(),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(120, 84), nn.Tanh(), nn.Linear(84, 10))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.classifier(torch.flatten(self.feature_extractor(x), 1))
        return logits, F.softmax(logits, dim=1)


def _derived() -> tuple[int, int]:
    """(FLOPs, MACs) from the layer shapes."""
    flops = macs = 0
    side = 32
    for c_in, c_out, pool in ((1, 6, True), (6, 16, True), (16, 120, False)):
        side -= 4  # 5×5 kernel, no padding
        conv = BATCH * side * side * c_out * c_in * 25
        flops += 2 * conv + BATCH * c_out * side * side  # + bias
        macs += conv
        if pool:
            flops += BATCH * c_out * side * side  # average pooling reads every element
            side //= 2
    for f_in, f_out in ((120, 84), (84, 10)):
        flops += 2 * BATCH * f_in * f_out
        macs += BATCH * f_in * f_out
    return flops + BATCH * 10, macs  # + softmax


def test_lenet_numbers_equal_deepspeeds(count_mode: CountMode) -> None:
    model = LeNet5().to("meta")
    flops, macs, params = get_model_profile(
        model, input_shape=(BATCH, 1, 32, 32), print_profile=False, warm_up=0, count_mode=count_mode
    )
    assert (flops, macs) == _derived()
    assert (flops, macs, params) == (866_076_672, 426_516_480, 61_706)


def test_per_module_numbers_add_up_to_the_totals(count_mode: CountMode) -> None:
    model = LeNet5().to("meta")
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    model(torch.empty(BATCH, 1, 32, 32, device="meta"))
    root = prof.profile().root
    prof.end_profile()
    features, classifier = root.children
    assert features.flops + classifier.flops + BATCH * 10 == root.flops  # softmax in the root
    assert [c.macs for c in features.children if c.type_name == "Conv2d"] == [
        BATCH * 28 * 28 * 6 * 25,
        BATCH * 10 * 10 * 16 * 6 * 25,
        BATCH * 16 * 120 * 25,
    ]
    assert all(c.flops == 0 for c in features.children if c.type_name == "Tanh")
    assert sum(c.params for c in root.children) == root.params == 61_706
