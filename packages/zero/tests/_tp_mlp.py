"""A test-local tensor-parallel MLP, its placements and its single-process reference.

``LayerNorm(D)`` (replicated) → column-parallel ``up`` (``H / tp`` output rows per rank) →
tanh → a per-head ``scale`` of ``HEAD`` elements applied to every local head of ``up``'s output
(replicated, but each rank's gradient covers only its own heads: a partial sum over ``tp``, as
Qwen3's ``q_norm``) → row-parallel ``down`` (``H / tp`` input columns per rank, partial outputs
all-reduced over ``tp``, bias added once after the sum, so replicated). The two autograd
functions are Megatron's f/g pair: identity forward / all-reduce backward in front of the
column layer, all-reduce forward / identity backward after the row layer.

The full model (``tp = 1``) is the reference; `local_state` slices its weights for tp rank
``t``, `placements` gives the matching `ParamPlacement` of every parameter.

Test modules load this file by path: ``import_beside(__file__, "_tp_mlp.py")``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from deepshard.comm import copy_to_group, reduce_from_group

D, H, HEAD = 8, 16, 4
CLIP, LR, STEPS, MB = 1.0, 1e-2, 5, 4


class TpMlp(torch.nn.Module):
    """The MLP on one tp rank of ``tp`` (``group`` the tp mesh; ``None`` for the reference)."""

    def __init__(self, tp: int = 1, group: Any = None) -> None:
        super().__init__()
        self.group = group
        self.norm = torch.nn.LayerNorm(D)
        self.up = torch.nn.Linear(D, H // tp)
        self.scale = torch.nn.Parameter(torch.ones(HEAD))
        self.down = torch.nn.Linear(H // tp, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.group is not None:
            h = copy_to_group(h, group=self.group)
        h = torch.tanh(self.up(h))
        h = (h.unflatten(-1, (-1, HEAD)) * self.scale).flatten(-2)
        out = F.linear(h, self.down.weight)
        if self.group is not None:
            out = reduce_from_group(out, group=self.group)
        return out + self.down.bias


def full_model() -> TpMlp:
    """The reference model; its scale and norm are not the identity, so they matter."""
    torch.manual_seed(0)
    model = TpMlp()
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


SPLIT = {"up.weight": 0, "up.bias": 0, "down.weight": 1}
"""Parameters split over tp and the dim; the others are replicated."""


def local_slice(name: str, full: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """Tp rank ``t``'s slice of the full tensor ``name``."""
    if name not in SPLIT:
        return full
    return full.chunk(tp, dim=SPLIT[name])[t]


def local_model(tp: int, t: int, group: Any, dtype: torch.dtype = torch.float32) -> TpMlp:
    """Tp rank ``t``'s model, weights sliced from `full_model`."""
    model = TpMlp(tp, group)
    state = {n: local_slice(n, v, tp, t) for n, v in full_model().state_dict().items()}
    model.load_state_dict(state)
    return model.to(dtype)


def placements(model: torch.nn.Module, topology: Any) -> Any:
    """Every parameter's placement: ``Shard(dim)`` on tp for `SPLIT`, ``scale`` summed over tp."""
    from deepshard.interface import ParamPlacement, PlacementRegistry, Shard

    registry = PlacementRegistry.replicated([], topology)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    for name, param in full_model().named_parameters():
        placement = ParamPlacement.replicated(tuple(param.shape), dtype)
        if name in SPLIT:
            placement = placement.with_axis("tp", Shard(SPLIT[name]))
        elif name == "scale":
            placement = dataclasses.replace(placement, sum_over=("tp",))
        registry.set(name, placement)
    return registry


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s micro-batch (the same on every tp rank)."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randn(MB, D, generator=g), 3 * torch.randn(MB, D, generator=g)


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    return F.mse_loss(model(x.to(dtype)).float(), y)


def reference(dp: int, steps: int = STEPS) -> dict[str, Any]:
    """One process: the mean of the dp ranks' losses, clipped to `CLIP`, AdamW."""
    model = full_model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, doubled = [], [], []
    for step in range(steps):
        per_rank = [loss_of(model, *batch(step, d)) for d in range(dp)]
        torch.stack(per_rank).mean().backward()
        doubled.append(double_counted_norm(model, tp=2))
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        inner.step()
        inner.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "doubled": doubled, "params": params}


def double_counted_norm(model: torch.nn.Module, tp: int) -> float:
    """The norm a TP run would report if it counted every replicated parameter ``tp`` times."""
    total = 0.0
    for name, param in model.named_parameters():
        assert param.grad is not None
        copies = 1 if name in SPLIT else tp
        total += copies * float(param.grad.double().pow(2).sum())
    return total**0.5


GLOBAL_ROWS = 8
"""Rows of `global_batch`: every dp size (1, 2, 4) splits it evenly."""


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of ``step``; dp rank ``d`` of ``dp`` trains on `dp_rows` of it."""
    g = torch.Generator().manual_seed(5000 + step)
    return torch.randn(GLOBAL_ROWS, D, generator=g), 3 * torch.randn(GLOBAL_ROWS, D, generator=g)


def dp_rows(tensors: tuple[torch.Tensor, ...], dp: int, d: int) -> tuple[torch.Tensor, ...]:
    """Dp rank ``d``'s equal share of each tensor's rows (the mean over ranks is the mean)."""
    return tuple(t.chunk(dp)[d] for t in tensors)


def reference_run(steps: int) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """One process on `global_batch`: losses and the parameters after every step."""
    model = full_model()
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, params = [], []
    for step in range(steps):
        loss = loss_of(model, *global_batch(step))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        inner.step()
        inner.zero_grad()
        losses.append(loss.item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return losses, params
