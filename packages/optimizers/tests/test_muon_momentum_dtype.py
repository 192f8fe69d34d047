"""Muon's momentum takes the gradient's dtype, also after restoring an fp32-stored momentum."""

from __future__ import annotations

import torch

from deepshard.optimizers import Muon


def _grads(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(8, 12, generator=generator).to(torch.bfloat16) for _ in range(count)]


def _weight(value: torch.Tensor) -> torch.nn.Parameter:
    weight = torch.nn.Parameter(value.clone())
    weight.grad_dtype = None  # an fp32 master weight fed bf16 gradients (as under ZeRO)
    return weight


def test_bf16_gradients_give_bf16_momentum() -> None:
    for param_dtype in (torch.float32, torch.bfloat16):
        weight = _weight(torch.randn(8, 12).to(param_dtype))
        optimizer = Muon([("block.weight", weight)])
        weight.grad = _grads(1)[0]
        optimizer.step()
        assert optimizer.state[weight]["momentum_buffer"].dtype == torch.bfloat16
        assert weight.dtype == param_dtype


def test_momentum_restored_from_fp32_is_cast_back_on_the_next_step() -> None:
    grads = _grads(3)
    start = torch.randn(8, 12)
    straight = _weight(start)
    uninterrupted = Muon([("block.weight", straight)], lr=0.1)
    for grad in grads:
        straight.grad = grad
        uninterrupted.step()

    first = _weight(start)
    before = Muon([("block.weight", first)], lr=0.1)
    for grad in grads[:2]:
        first.grad = grad
        before.step()
    saved = before.state_dict()
    for state in saved["state"].values():  # a checkpoint that keeps optimizer state in fp32
        state["momentum_buffer"] = state["momentum_buffer"].float()

    resumed_weight = _weight(first.detach())
    resumed = Muon([("block.weight", resumed_weight)], lr=0.1)
    resumed.load_state_dict(saved)
    assert resumed.state[resumed_weight]["momentum_buffer"].dtype == torch.float32
    resumed_weight.grad = grads[2]
    resumed.step()
    momentum = resumed.state[resumed_weight]["momentum_buffer"]
    assert momentum.dtype == torch.bfloat16
    torch.testing.assert_close(momentum, uninterrupted.state[straight]["momentum_buffer"])
    torch.testing.assert_close(resumed_weight.detach(), straight.detach())
