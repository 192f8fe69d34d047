"""impl="auto" sends each parameter to the implementation that can update it."""

from __future__ import annotations

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.optimizers import Adam, CPUAdam, Lion, _kernels


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the kernel calls while still running the real kernels."""
    counts = {"cpu_adam_step": 0, "fused_adam_step": 0, "cpu_lion_step": 0}
    for name in counts:
        real = getattr(_kernels, name)

        def counting(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            counts[_name] += 1
            _real(*args, **kwargs)

        monkeypatch.setattr(_kernels, name, counting)
    return counts


def _stepped(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    return optimizer


def test_auto_uses_the_cpu_kernel_for_16_and_32_bit_and_foreach_for_the_rest(calls) -> None:
    fp32 = torch.nn.Parameter(torch.zeros(8))
    bf16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    fp16 = torch.nn.Parameter(torch.zeros(8, dtype=torch.float16))
    fp64 = torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))
    strided = torch.nn.Parameter(torch.zeros(8, 4).T)  # not contiguous
    optimizer = _stepped(Adam([fp32, bf16, fp16, fp64, strided], lr=0.1))
    assert calls == {"cpu_adam_step": 3, "fused_adam_step": 0, "cpu_lion_step": 0}
    for param in (fp32, bf16, fp16, fp64, strided):  # all took the same AdamW step
        torch.testing.assert_close(param.detach().float(), torch.full(param.shape, -0.1),
                                   rtol=0, atol=1e-3)  # fmt: skip
    assert optimizer.state[bf16]["exp_avg"].dtype == torch.float32
    assert optimizer.state[fp64]["exp_avg"].dtype == torch.float64


def test_fused_runs_the_kernels_twin_on_cpu_and_foreach_calls_no_kernel(calls) -> None:
    _stepped(Adam([torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(torch.zeros(3))],
                  impl="fused"))  # fmt: skip
    assert calls["fused_adam_step"] == 1  # one multi-tensor call for both
    _stepped(Adam([torch.nn.Parameter(torch.zeros(8))], impl="foreach"))
    assert calls == {"cpu_adam_step": 0, "fused_adam_step": 1, "cpu_lion_step": 0}


def test_bf16_moments_run_on_the_cpu_kernel(calls) -> None:
    param = torch.nn.Parameter(torch.zeros(8))
    optimizer = _stepped(Adam([param], fp32_optimizer_states=False))
    assert optimizer.state[param]["exp_avg"].dtype == torch.bfloat16
    assert calls["cpu_adam_step"] == 1


def test_lion_auto_uses_the_cpu_kernel(calls) -> None:
    _stepped(Lion([torch.nn.Parameter(torch.zeros(8))]))
    _stepped(Lion([torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))]))
    _stepped(Lion([torch.nn.Parameter(torch.zeros(8, dtype=torch.float64))]))
    assert calls["cpu_lion_step"] == 2


def test_explicit_kernels_refuse_parameters_they_cannot_update() -> None:
    with pytest.raises(ConfigError, match=r"fp32, bf16 or fp16 CPU .*cast fp64 ones to fp32"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))])
    with pytest.raises(ConfigError, match=r"on meta.*move them to the CPU"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, device="meta"))])
    with pytest.raises(ConfigError, match="not contiguous"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.bfloat16).T)])
    with pytest.raises(ConfigError, match="amsgrad"):
        CPUAdam([torch.nn.Parameter(torch.zeros(4))], amsgrad=True)
    with pytest.raises(ConfigError, match=r"impl='cpu'.*got a torch\.float64 parameter on cpu"):
        _stepped(Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))], impl="cpu"))
    with pytest.raises(ConfigError, match="impl='fused'"):
        _stepped(Adam([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], impl="fused"))
    with pytest.raises(ConfigError, match=r"impl='cpu'.*non-contiguous torch\.float16"):
        _stepped(Lion([torch.nn.Parameter(torch.zeros(4, 2, dtype=torch.float16).T)], impl="cpu"))
    with pytest.raises(ConfigError, match="sparse"):
        param = torch.nn.Parameter(torch.zeros(4))
        optimizer = Adam([param])
        param.grad = torch.zeros(4).to_sparse()
        optimizer.step()
