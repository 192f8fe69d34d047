"""Counting the forward only, the dispatch mode is on only while a module's forward runs.

Operators outside the model (the backward among them) then pay nothing, and the numbers are
those of the always-on mode: a forward inside ``torch.no_grad``, one with grad and a backward,
an exception in a forward (the mode is still popped) and ``ignore_list`` all count the same.
Counting backward too, the mode stays on from ``start_profile`` to ``stop_profile``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from deepshard.profiler import CountMode, FlopsProfiler


class _Probe(nn.Module):
    """A linear layer that records whether a dispatch mode was active in its forward."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8, bias=False)
        self.fail = fail
        self.saw_mode: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.saw_mode.append(_get_current_dispatch_mode() is not None)
        if self.fail:
            raise ValueError("forward failed")
        return self.linear(x)


_LINEAR_FLOPS = 2 * 4 * 8 * 8  # [4, 8] @ [8, 8]


@pytest.mark.parametrize("count_mode", ["eager", "replay"])
def test_mode_is_on_only_inside_the_forward_when_counting_forward_only(
    count_mode: CountMode,
) -> None:
    model, x = _Probe(), torch.randn(4, 8)
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    assert _get_current_dispatch_mode() is None  # nothing outside the model goes through it
    model(x).sum().backward()
    assert _get_current_dispatch_mode() is None
    with torch.no_grad():
        model(x)
    # The replay runs the forward again, under the counting and fake-tensor modes, when read.
    assert model.saw_mode == [count_mode == "eager"] * 2
    assert prof.get_total_flops() == 2 * _LINEAR_FLOPS
    assert prof.get_total_backward_flops() == 0
    assert prof.get_flops_by_op() == {"mm": (2 * _LINEAR_FLOPS, 0)}
    prof.end_profile()


def test_mode_is_popped_when_a_forward_raises(count_mode: CountMode) -> None:
    model = _Probe(fail=True)
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    with pytest.raises(ValueError, match="forward failed"):
        model(torch.randn(4, 8))
    assert _get_current_dispatch_mode() is None
    model.fail = False
    model(torch.randn(4, 8))
    assert prof.get_total_flops() == _LINEAR_FLOPS
    prof.end_profile()


def test_ignored_top_level_module_never_turns_the_mode_on(count_mode: CountMode) -> None:
    model = _Probe()
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile(ignore_list=[_Probe])
    model(torch.randn(4, 8))
    assert model.saw_mode == [False]
    assert prof.get_total_flops() == 0
    prof.end_profile()


@pytest.mark.parametrize("count_mode", ["eager", "replay"])
def test_counting_backward_keeps_the_mode_on_for_the_whole_profile(count_mode: CountMode) -> None:
    model, x = _Probe(), torch.randn(4, 8, requires_grad=True)
    prof = FlopsProfiler(model, count_backward=True, count_mode=count_mode)
    prof.start_profile()
    assert (_get_current_dispatch_mode() is not None) == (count_mode == "eager")
    model(x).sum().backward()
    assert model.saw_mode == [count_mode == "eager"]
    # Backward: the gradients of the input and of the weight, each a product as large.
    assert prof.get_total_backward_flops() == 2 * _LINEAR_FLOPS
    prof.stop_profile()
    assert _get_current_dispatch_mode() is None
    assert prof.get_total_flops() == _LINEAR_FLOPS  # still readable after stop
    prof.end_profile()
