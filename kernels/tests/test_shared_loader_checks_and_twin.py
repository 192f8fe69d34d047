"""The CPU and CUDA ops share one extension loader, one set of argument checks and one twin."""

from __future__ import annotations

import warnings

import pytest
import torch

import deepshard.kernels as kernels
from deepshard.kernels import _extension, _fused_adam
from deepshard.kernels._constants import bias_corrections

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "weight_decay": 0.1}


def test_one_loader_class_serves_both_modules_and_warns_once() -> None:
    assert isinstance(_fused_adam.CUDA_EXTENSION, _extension.ExtensionLoader)
    assert isinstance(_extension.CPU_EXTENSION, _extension.ExtensionLoader)
    missing = _extension.ExtensionLoader("deepshard.kernels._absent", hint="Do X to get it.")
    assert missing.load() is None  # silent
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert missing.get() is None and missing.get() is None
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and "Do X to get it." in messages[0], messages
    assert "ModuleNotFoundError" in missing.failure_with_hint()


def test_fused_and_cpu_ops_share_the_scalar_checks() -> None:
    p, g, m, v = (torch.zeros(4) for _ in range(4))
    for bad, error in (({"step": 1.5}, TypeError), ({"beta1": 1.0}, ValueError)):
        kwargs = {"step": 1, **HYPER, **bad}
        with pytest.raises(error) as fused:
            kernels.fused_adam_step([p], [g], [m], [v], **kwargs)  # type: ignore[arg-type]
        with pytest.raises(error) as cpu:
            kernels.cpu_adam_step(p, g, m, v, **kwargs)  # type: ignore[arg-type]
        # Same words after the op's name: one check, not two that drift apart.
        assert str(fused.value).split(": ", 1)[1] == str(cpu.value).split(": ", 1)[1]


def test_bias_corrections_are_torch_adams() -> None:
    bc1, bc2_sqrt = bias_corrections(7, 0.9, 0.999, True)
    assert bc1 == 1 - 0.9**7 and bc2_sqrt == (1 - 0.999**7) ** 0.5
    assert bias_corrections(7, 0.9, 0.999, False) == (1.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float32])
def test_the_foreach_twin_matches_torch_adamw_in_any_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    start = [torch.randn(9, generator=gen).to(dtype), torch.randn(2, 3, generator=gen).to(dtype)]
    grads = [[torch.randn(p.shape, generator=gen).to(dtype) for p in start] for _ in range(3)]
    ours = [p.clone() for p in start]
    m, v = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ours]
    # torch's reference works in fp32 for 16-bit tensors, as the twin does.
    ref = [torch.nn.Parameter(p.clone().to(kernels.compute_dtype(dtype))) for p in start]
    torch_opt = torch.optim.AdamW(ref, lr=HYPER["lr"], betas=(0.9, 0.99), eps=1e-8,
                                  weight_decay=0.1, foreach=True)  # fmt: skip
    for step, step_grads in enumerate(grads, start=1):
        kernels.foreach_adam_step(ours, step_grads, m, v, step=step, adamw_mode=True,
                                  bias_correction=True, **HYPER)  # fmt: skip
        for param, grad in zip(ref, step_grads, strict=True):
            param.grad = grad.to(param.dtype)
        torch_opt.step()
        ref_now = [p.detach().to(dtype) for p in ref]  # 16-bit: rounded like the twin's store
        for mine, theirs in zip(ours, ref_now, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        for param, rounded in zip(ref, ref_now, strict=True):
            param.data.copy_(rounded)  # continue from the same stored 16-bit values
