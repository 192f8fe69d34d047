"""Profiling changes nothing global and repeats exactly; every way to reach a GEMM is seen.

After ``end_profile()`` the torch functions DeepSpeed's profiler replaces are the original
objects, no hook is left on any module and no dispatch mode is active; three profiling runs in a
row give identical FLOPs. ``F.linear``, ``x @ w``, ``torch.einsum``, ``torch.bmm`` and SDPA all
count the same as the formula gives, also inside a ``torch.compile``d function (eager backend).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from deepshard.profiler import CountMode, FlopsProfiler

_PATCHED_BY_DEEPSPEED = {
    "torch.bmm": (torch, "bmm"),
    "torch.matmul": (torch, "matmul"),
    "torch.einsum": (torch, "einsum"),
    "torch.addmm": (torch, "addmm"),
    "Tensor.__matmul__": (torch.Tensor, "__matmul__"),
    "F.linear": (F, "linear"),
    "F.scaled_dot_product_attention": (F, "scaled_dot_product_attention"),
    "F.softmax": (F, "softmax"),
}


class _Ways(nn.Module):
    """Four 8×16×16 products reached four ways, then attention."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.linear(x, self.w)
        b = a @ self.w
        c = torch.einsum("nd,de->ne", b, self.w)
        d = torch.bmm(c.unsqueeze(0), self.w.unsqueeze(0)).squeeze(0)
        q = d.view(1, 2, 4, 16)  # [batch, heads, length, dim]
        return F.scaled_dot_product_attention(q, q, q).reshape(8, 16)


_EXPECTED = 4 * 2 * 8 * 16 * 16 + 2 * 2 * (2 * 4 * 4 * 16)  # four GEMMs + QKᵀ and PV


def _run(model: nn.Module, x: torch.Tensor, count_mode: CountMode) -> int:
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    with torch.no_grad():
        model(x)
    flops = prof.get_total_flops()
    prof.end_profile()
    assert isinstance(flops, int)
    return flops


def test_every_way_to_a_gemm_is_counted_and_nothing_global_changes(
    count_mode: CountMode,
) -> None:
    before = {name: getattr(owner, attr) for name, (owner, attr) in _PATCHED_BY_DEEPSPEED.items()}
    model, x = _Ways(), torch.randn(8, 16)
    runs = [_run(model, x, count_mode) for _ in range(3)]
    assert runs == [_EXPECTED] * 3
    after = {name: getattr(owner, attr) for name, (owner, attr) in _PATCHED_BY_DEEPSPEED.items()}
    assert all(after[name] is before[name] for name in before)
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert _get_current_dispatch_mode() is None


def test_compiled_code_is_counted_too(count_mode: CountMode) -> None:
    model, x = _Ways(), torch.randn(8, 16)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(x)  # compile outside the profile
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    with torch.no_grad():
        compiled(x)
    flops = prof.get_total_flops()
    prof.end_profile()
    assert flops == _EXPECTED


def test_backward_is_counted_when_asked_and_attributed_to_modules(
    count_mode: CountMode,
) -> None:
    model = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4, bias=False))
    x = torch.randn(8, 16, requires_grad=True)
    prof = FlopsProfiler(model, count_backward=True, count_mode=count_mode)
    prof.start_profile()
    model(x).sum().backward()  # the sum is outside the model: not counted
    root = prof.profile().root
    prof.end_profile()
    first, relu, last = root.children
    assert (first.flops, last.flops) == (2 * 8 * 16 * 32, 2 * 8 * 32 * 4)
    assert (first.backward_flops, last.backward_flops) == (2 * first.flops, 2 * last.flops)
    assert relu.flops == relu.backward_flops == 8 * 32
    assert root.backward_flops == first.backward_flops + relu.backward_flops + last.backward_flops


def test_ignored_module_types_count_nothing(count_mode: CountMode) -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False), nn.ReLU())
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile(ignore_list=[nn.ReLU])
    model(torch.randn(2, 4))
    assert prof.get_total_flops() == 2 * (2 * 2 * 4 * 4)
    prof.end_profile()
