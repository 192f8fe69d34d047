"""state_dict/load_state_dict resume a run exactly, keep fp32 moments fp32, and groups differ.

torch's own load_state_dict casts state to the parameter dtype; ours must not round fp32
moments of a bf16 parameter to bf16 on every resume.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from deepshard.optimizers import Adam, AdamW, CPUAdam, Lion, Muon

Factory = Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer]
FACTORIES: dict[str, Factory] = {
    "adamw-foreach-bf16": lambda ps: AdamW(ps, lr=1e-2, weight_decay=0.1, impl="foreach"),
    "adam-cpu": lambda ps: CPUAdam(ps, lr=1e-2, adamw_mode=False, weight_decay=0.1),
    "cpuadam-bf16": lambda ps: CPUAdam(ps, lr=1e-2, weight_decay=0.1),
    "cpuadam-fp16-fp16-moments": lambda ps: CPUAdam(ps, lr=1e-2, fp32_optimizer_states=False),
    "lion-cpu-bf16": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1, impl="cpu"),
    "adam-bf16-moments": lambda ps: Adam(ps, lr=1e-2, fp32_optimizer_states=False),
    "lion": lambda ps: Lion(ps, lr=1e-3, weight_decay=0.1),
    "muon": lambda ps: Muon(ps, lr=0.02),
}
PARAM_DTYPES = {
    "adamw-foreach-bf16": torch.bfloat16,
    "cpuadam-bf16": torch.bfloat16,
    "cpuadam-fp16-fp16-moments": torch.float16,
    "lion-cpu-bf16": torch.bfloat16,
}


def _params(dtype: torch.dtype) -> list[tuple[str, torch.nn.Parameter]]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"block.weight": (6, 10), "block.bias": (6,)}
    return [(n, torch.nn.Parameter(torch.randn(s, generator=generator).to(dtype)))
            for n, s in shapes.items()]  # fmt: skip


def _grad_steps(optimizer: torch.optim.Optimizer, params, seeds: range) -> None:
    for seed in seeds:
        generator = torch.Generator().manual_seed(100 + seed)
        for _, param in params:
            param.grad = torch.randn(param.shape, generator=generator).to(param.dtype)
        optimizer.step()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
def test_resume_equals_an_uninterrupted_run(kind: str) -> None:
    dtype = PARAM_DTYPES.get(kind, torch.float32)
    straight = _params(dtype)
    uninterrupted = FACTORIES[kind](straight)
    _grad_steps(uninterrupted, straight, range(4))

    first = _params(dtype)
    before = FACTORIES[kind](first)
    _grad_steps(before, first, range(2))
    saved = before.state_dict()
    resumed_params = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in first]
    resumed = FACTORIES[kind](resumed_params)
    resumed.load_state_dict(saved)
    for (_, old), (_, new) in zip(first, resumed_params, strict=True):
        for key, value in before.state[old].items():
            if isinstance(value, torch.Tensor):
                assert resumed.state[new][key].dtype == value.dtype, key
    _grad_steps(resumed, resumed_params, range(2, 4))
    for (_, a), (_, b) in zip(straight, resumed_params, strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=0, atol=0)


def test_bf16_parameters_keep_fp32_moments_and_round_each_step() -> None:
    param = torch.nn.Parameter(torch.randn(64).to(torch.bfloat16))
    reference = torch.nn.Parameter(param.detach().float())
    ours = AdamW([param], lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1, foreach=False)
    for seed in range(5):
        grad = torch.randn(64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        param.grad = grad
        reference.grad = grad.float()
        ours.step()
        theirs.step()
        with torch.no_grad():  # the bf16 parameter holds the rounded fp32 result
            reference.copy_(reference.to(torch.bfloat16).float())
    assert ours.state[param]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(param.detach().float(), reference.detach(), rtol=0, atol=0)
    torch.testing.assert_close(
        ours.state[param]["exp_avg_sq"], theirs.state[reference]["exp_avg_sq"]
    )


def test_adam_param_groups_keep_their_own_settings() -> None:
    generator = torch.Generator().manual_seed(7)
    starts = [torch.randn(16, generator=generator) for _ in range(2)]
    groups_spec = [
        {"lr": 0.1, "betas": (0.8, 0.9), "weight_decay": 0.0},
        {"lr": 0.001, "betas": (0.9, 0.99), "weight_decay": 0.5, "eps": 1e-6},
    ]
    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    theirs = [torch.nn.Parameter(s.clone()) for s in starts]
    ours_opt = AdamW([{"params": [p], **g} for p, g in zip(ours, groups_spec, strict=True)])
    theirs_opt = torch.optim.AdamW(
        [{"params": [p], **g} for p, g in zip(theirs, groups_spec, strict=True)]
    )
    for seed in range(3):
        for a, b in zip(ours, theirs, strict=True):
            grad = torch.randn(16, generator=torch.Generator().manual_seed(seed))
            a.grad, b.grad = grad.clone(), grad.clone()
        ours_opt.step()
        theirs_opt.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.detach(), b.detach())


def test_a_torch_adamw_state_dict_continues_in_ours() -> None:
    start = torch.randn(32, generator=torch.Generator().manual_seed(3))
    grads = [torch.randn(32, generator=torch.Generator().manual_seed(s)) for s in range(4)]
    theirs_param = torch.nn.Parameter(start.clone())
    theirs = torch.optim.AdamW([theirs_param], lr=1e-2, weight_decay=0.1)
    for grad in grads[:2]:
        theirs_param.grad = grad.clone()
        theirs.step()
    ours_param = torch.nn.Parameter(theirs_param.detach().clone())
    ours = AdamW([ours_param], lr=1e-2, weight_decay=0.1)
    # deepcopy as a checkpoint would: torch's "step" tensor is loaded without a copy.
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    for grad in grads[2:]:
        theirs_param.grad, ours_param.grad = grad.clone(), grad.clone()
        theirs.step()
        ours.step()
    assert ours.state[ours_param]["step"] == 4
    torch.testing.assert_close(ours_param.detach(), theirs_param.detach())
