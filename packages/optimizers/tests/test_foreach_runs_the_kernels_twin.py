"""impl="foreach" runs deepshard.kernels' dtype-general twin, not a copy of its own."""

from __future__ import annotations

import pytest
import torch

import deepshard.kernels as kernels
from deepshard.optimizers import Adam, Lion, _kernels


def test_the_optimizers_foreach_names_are_the_kernels_functions() -> None:
    assert _kernels.foreach_adam_step is kernels.foreach_adam_step
    assert _kernels.foreach_lion_step is kernels.foreach_lion_step


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_foreach_adam_and_lion_step_through_the_twin(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    calls: list[str] = []
    for name in ("foreach_adam_step", "foreach_lion_step"):
        real = getattr(kernels, name)

        def counting(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls.append(_name)
            _real(*args, **kwargs)

        monkeypatch.setattr(_kernels, name, counting)
    adam_param = torch.nn.Parameter(torch.ones(5, dtype=dtype))
    lion_param = torch.nn.Parameter(torch.ones(5, dtype=dtype))
    adam = Adam([adam_param], lr=0.1, weight_decay=0.01, impl="foreach")
    lion = Lion([lion_param], lr=0.1, weight_decay=0.0, impl="foreach")
    for optimizer, param in ((adam, adam_param), (lion, lion_param)):
        param.grad = torch.ones_like(param)
        optimizer.step()
    assert calls == ["foreach_adam_step", "foreach_lion_step"]
    # Adam's first step moves by lr (m/sqrt(v) = 1 after bias correction); with AdamW's decay
    # 0.01 the parameter is 1 * (1 - 0.1 * 0.01) - 0.1. Lion: 1 * (1 - 0.1 * 0) - 0.1 * sign(1).
    torch.testing.assert_close(adam_param.detach(), torch.full((5,), 1 - 0.001 - 0.1, dtype=dtype))
    torch.testing.assert_close(lion_param.detach(), torch.full((5,), 0.9, dtype=dtype))
