"""An overflowed step under dynamic loss scaling leaves Muon's momentum unchanged.

Two orders exist. Without ZeRO (stage 0) the scaler checks the gradients and does not call
``step`` at all (torch.amp.GradScaler, DeepSpeed's fp16 optimizers). Under ZeRO the gradient is
folded into the momentum by `muon_update` while gradients are reduced, before the overflow
check; there `muon_update` itself must leave the momentum alone and pass the overflow on. Both
are played here, the second with a small scaler written in this file.
"""

from __future__ import annotations

import math

import torch

from deepshard.optimizers import Muon, muon_update

SHAPE = (6, 10)


def _batch(seed: int) -> torch.Tensor:
    return torch.randn(4, SHAPE[1], generator=torch.Generator().manual_seed(seed))


def _loss(weight: torch.Tensor, seed: int) -> torch.Tensor:
    return (_batch(seed) @ weight.T).square().mean()


def _momentum(optimizer: Muon, weight: torch.Tensor) -> torch.Tensor:
    return optimizer.state[weight]["momentum_buffer"].clone()


def test_grad_scaler_skips_the_overflowed_step() -> None:
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    weight = torch.nn.Parameter(start.clone())
    optimizer = Muon([("block.weight", weight)], lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    for seed, inject in ((1, False), (2, True), (3, False)):
        optimizer.zero_grad()
        scaler.scale(_loss(weight, seed)).backward()
        if inject:
            assert weight.grad is not None
            weight.grad[0, 0] = math.inf
            momentum, value = _momentum(optimizer, weight), weight.detach().clone()
        scaler.step(optimizer)
        scaler.update()
        if inject:
            assert torch.equal(_momentum(optimizer, weight), momentum)
            assert torch.equal(weight.detach(), value)
            assert scaler.get_scale() == 2.0**11

    # The run equals one that never saw the overflowed batch.
    clean = torch.nn.Parameter(start.clone())
    reference = Muon([("block.weight", clean)], lr=0.05)
    for seed in (1, 3):
        reference.zero_grad()
        _loss(clean, seed).backward()
        reference.step()
    torch.testing.assert_close(weight.detach(), clean.detach())
    torch.testing.assert_close(_momentum(optimizer, weight), _momentum(reference, clean))


class FlatShapes:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        return self.shape


class ZeroOrderScaler:
    """Dynamic loss scaling in ZeRO's order: Muon's momentum is updated before the check."""

    def __init__(self, optimizer: Muon, weight: torch.nn.Parameter, scale: float) -> None:
        self.optimizer, self.weight, self.scale = optimizer, weight, scale
        self.momentum = torch.zeros(SHAPE)
        self.skipped = 0

    def train_step(self, seed: int, inject: bool) -> None:
        self.weight.grad = None
        full = self.weight.detach().view(SHAPE).requires_grad_()
        (self.scale * _loss(full, seed)).backward()
        assert full.grad is not None
        grad = full.grad / self.scale
        if inject:
            grad[0, 0] = math.inf
        update = muon_update(grad, self.momentum, beta=0.95)  # "during reduction"
        self.weight.grad = update.reshape(-1)
        if not torch.isfinite(self.weight.grad).all():
            self.scale /= 2
            self.skipped += 1
            return
        self.optimizer.step()


def test_momentum_survives_an_overflow_seen_after_the_muon_update() -> None:
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))
    flat = torch.nn.Parameter(start.clone().reshape(-1))
    optimizer = Muon([("block.weight", flat)], lr=0.05, param_shapes=FlatShapes(SHAPE))
    loop = ZeroOrderScaler(optimizer, flat, scale=2.0**12)
    loop.train_step(1, inject=False)
    momentum, value = loop.momentum.clone(), flat.detach().clone()
    loop.train_step(2, inject=True)
    assert loop.skipped == 1 and loop.scale == 2.0**11
    assert torch.equal(loop.momentum, momentum)
    assert torch.equal(flat.detach(), value)
    loop.train_step(3, inject=False)

    clean = torch.nn.Parameter(start.clone())
    reference = Muon([("block.weight", clean)], lr=0.05)
    for seed in (1, 3):
        reference.zero_grad()
        _loss(clean, seed).backward()
        reference.step()
    torch.testing.assert_close(flat.detach().view(SHAPE), clean.detach())
    torch.testing.assert_close(loop.momentum, _momentum(reference, clean))


def test_a_direct_step_on_a_nan_gradient_keeps_the_momentum() -> None:
    weight = torch.nn.Parameter(torch.randn(SHAPE))
    optimizer = Muon([("block.weight", weight)], lr=0.05)
    weight.grad = torch.randn(SHAPE)
    optimizer.step()
    momentum = _momentum(optimizer, weight)
    weight.grad = torch.full(SHAPE, math.nan)
    optimizer.step()
    assert torch.equal(_momentum(optimizer, weight), momentum)
    # The update is the non-finite gradient, as for any optimizer: skipping is the scaler's call.
    assert not torch.isfinite(weight.detach()).any()
