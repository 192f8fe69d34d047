"""One ``Linear(100, 100)`` held by three parents applied in sequence on (1, 100): the model
counts 3 × 2·100·100 = 60,000 FLOPs and 10,100 parameters (the shared layer once); each parent
holds the 20,000 of its own call, and the shared layer the 60,000 of all three."""

from __future__ import annotations

import torch
from torch import nn

from deepshard.profiler import CountMode, FlopsProfiler


class _Parent(nn.Module):
    def __init__(self, shared: nn.Linear) -> None:
        super().__init__()
        self.layer = shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_a_shared_module_is_counted_once_in_the_totals(count_mode: CountMode) -> None:
    shared = nn.Linear(100, 100)
    model = nn.Sequential(_Parent(shared), _Parent(shared), _Parent(shared))
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    model(torch.randn(1, 100))
    assert prof.get_total_flops() == 60_000
    assert prof.get_total_params() == 10_100
    root = prof.profile().root
    prof.end_profile()
    assert [parent.flops for parent in root.children] == [20_000] * 3
    assert {parent.children[0].flops for parent in root.children} == {60_000}
    assert root.children[0].children[0].shared == 3 and root.children[0].children[0].calls == 3
