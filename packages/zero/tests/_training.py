"""Shared by the distributed ZeRO tests: the odd-sized MLP, its data, the engine-style training
loop under `ZeroOptimizer`, and the single-process reference it must match.

The layer sizes 13→37→29→7 (with biases) give parameters of 481, 37, 1073, 29, 203 and 7
elements: none is a multiple of the alignment, so parameters straddle partition boundaries at 2
and 4 ranks. Every step uses a global batch of `GLOBAL_BATCH` samples; with ``W`` ranks and
``ga`` accumulation steps, rank ``r`` at micro-step ``m`` takes rows ``(m·W + r)·mb ...`` with
``mb = GLOBAL_BATCH / (W·ga)``, so the ranks together see exactly the reference's batch.

Test modules load this file by path (pytest's importlib mode keeps ``tests/`` off ``sys.path``):
``_training = import_beside(__file__, "_training.py")`` (`deepshard.testing`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

SIZES = (13, 37, 29, 7)
GLOBAL_BATCH = 16
LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 1.0
STEPS = 5


def make_model(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    """The MLP 13→37→29→7 with tanh, same initial weights for a given seed."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers).to(dtype)


def param_groups(params: list[torch.Tensor]) -> list[dict[str, Any]]:
    """Weights decay, biases do not: two groups with different hyper-parameters."""
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": WEIGHT_DECAY},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def lr_factor(step: int) -> float:
    """The LR schedule every run uses (a scheduler on the wrapper must change ``lr``)."""
    return 1.0 / (1.0 + 0.5 * step)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: inputs and (large, so clipping triggers) targets."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_BATCH, SIZES[0], generator=gen), 3 * torch.randn(
        GLOBAL_BATCH, SIZES[-1], generator=gen
    )


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE in fp32 of the model run in its own dtype."""
    dtype = next(model.parameters()).dtype
    return F.mse_loss(model(x.to(dtype)).float(), y)


def train_zero(
    group: Any,
    rank: int,
    world: int,
    *,
    stage: int,
    ga: int,
    dtype: torch.dtype,
    steps: int = STEPS,
    zero_kwargs: dict[str, Any] | None = None,
    config_kwargs: dict[str, Any] | None = None,
    inner_factory: Any = None,
    keep: list[Any] | None = None,
) -> dict[str, Any]:
    """Train the MLP under ZeRO the way the engine will; return what each step produced.

    ``inner_factory(param_groups, lr)`` builds the inner optimizer (torch's AdamW by default);
    ``keep`` receives the `ZeroOptimizer`, for a test to inspect after training.

    Stage 1 drives its passes with plain ``loss.backward()`` and ``no_sync()`` instead of
    ``ZeroOptimizer.backward``, so both ways are checked against the reference.
    """
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = make_model(dtype)
    factory = inner_factory if inner_factory is not None else torch.optim.AdamW
    inner = factory(param_groups(list(model.parameters())), lr=LR)
    config = ZeroConfig(stage=stage, **(config_kwargs or {}))
    zero = ZeroOptimizer(
        inner,
        group=group,
        config=config,
        gradient_clipping=CLIP,
        named_parameters=model.named_parameters(),
        **(zero_kwargs or {}),
    )
    if keep is not None:
        keep.append(zero)
    scheduler = torch.optim.lr_scheduler.LambdaLR(zero, lr_factor)
    mb = GLOBAL_BATCH // (world * ga)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        total = 0.0
        for m in range(ga):
            rows = slice((m * world + rank) * mb, (m * world + rank + 1) * mb)
            loss = loss_fn(model, x[rows], y[rows]) / ga
            if stage == 1:  # the DDP way: plain backward, no_sync() around non-boundary passes
                with zero.no_sync() if m < ga - 1 else contextlib.nullcontext():
                    loss.backward()
            else:  # the engine way
                zero.backward(loss, is_boundary=m == ga - 1)
            total += loss.item()
        result = zero.step()
        scheduler.step()
        losses.append(total)
        norms.append(result.grad_norm)
    params = [p.detach().float().clone() for p in model.parameters()]
    return {"losses": losses, "norms": norms, "params": params}


def reference(dtype: torch.dtype, steps: int = STEPS) -> dict[str, Any]:
    """One process, the whole batch: AdamW + clip_grad_norm_ on fp32 masters.

    For fp32 the masters are the model's parameters. For bf16 the model runs in bf16 and its
    gradients are copied to fp32 masters, which AdamW steps and which are copied back, the
    mixed-precision recipe ZeRO implements.
    """
    model = make_model(dtype)
    params = list(model.parameters())
    masters = params if dtype == torch.float32 else [p.detach().float() for p in params]
    inner = torch.optim.AdamW(param_groups(masters), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lr_factor)
    losses, norms = [], []
    for step in range(steps):
        x, y = batch(step)
        model.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.float()
        norms.append(torch.nn.utils.clip_grad_norm_(masters, CLIP).item())
        inner.step()
        scheduler.step()
        with torch.no_grad():
            for master, param in zip(masters, params, strict=True):
                param.copy_(master)
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": [p.detach().float() for p in params]}


def initial_params(dtype: torch.dtype) -> list[torch.Tensor]:
    """The parameters before training, as fp32."""
    return [p.detach().float() for p in make_model(dtype).parameters()]
