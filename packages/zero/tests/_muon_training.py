"""Shared by the Muon-under-ZeRO tests: Muon on the odd-sized MLP of `_training`, wrapped the way
the engine wraps it, the training loop, and the single-process reference.

The MLP's matrices (37×13, 29×37, 7×29: 481, 1073 and 203 elements) make up Muon's ``use_muon``
group, its biases the auxiliary-Adam group. With ``reduce_bucket_size`` 2000 the three matrices
share one bucket, so at 2 and 4 ranks the chunk boundaries cut through them (the 1073-element
one spans three ranks at 4); with 600 each matrix is a bucket of its own, still cut into ranks.

**What ZeRO computes, and so the reference.** DeepSpeed 0.19.7 puts ``muon_update``'s
orthogonalized update into the gradient partition before the step and then takes the global norm
over the partitions, so the norm used for clipping (and reported) is that of the Muon updates
together with the raw gradients of the Adam parameters, and the clip factor scales both. The
reference does the same in one process with a plain `Muon`: it previews the updates on a copy of
the momentum, takes that norm, scales the Adam gradients by the factor and the Muon update by
running the Muon group with ``lr·f`` and ``weight_decay/f`` (``p(1-lr·wd) - lr·f·u``), then steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from deepshard.optimizers import Muon, muon_update
from deepshard.testing import import_beside

_training = import_beside(__file__, "_training.py")

MUON_LR = 0.02
ADAM_LR = 1e-2
WEIGHT_DECAY = 0.1
BETA = 0.95
CLIP = 1.0
STEPS = 5


def make_muon(model: torch.nn.Module) -> Muon:
    """Muon over the model's named parameters: matrices to Muon, biases to the auxiliary Adam."""
    return Muon(
        model.named_parameters(),
        muon_lr=MUON_LR,
        adam_lr=ADAM_LR,
        weight_decay=WEIGHT_DECAY,
        momentum=BETA,
    )


def muon_transform(
    grad: torch.Tensor, momentum: torch.Tensor, group: Mapping[str, Any]
) -> torch.Tensor:
    """The full-gradient transform the engine hands ZeRO for Muon."""
    return muon_update(
        grad, momentum, beta=float(group["momentum"]), ns_method=str(group["ns_method"])
    )


def muon_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters of Muon's ``use_muon`` groups (read before ZeRO wraps the optimizer)."""
    return [p for g in optimizer.param_groups if g.get("use_muon") for p in g["params"]]


def wrap(
    model: torch.nn.Module,
    group: Any,
    *,
    stage: int,
    grad_accum_dtype: torch.dtype | None = None,
    **config: Any,
) -> Any:
    """Muon on ``model`` under ZeRO, built as the engine builds it."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    muon = make_muon(model)
    return ZeroOptimizer(
        muon,
        group=group,
        config=ZeroConfig.model_validate({"stage": stage, **config}),
        gradient_clipping=CLIP,
        grad_accum_dtype=grad_accum_dtype,
        named_parameters=model.named_parameters(),
        full_grad_transform=muon_transform,
        transformed_params=muon_params(muon),
    )


def micro_batch(
    step: int, rank: int, world: int, ga: int, micro: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows of the global batch at micro-step ``micro`` (as `_training`)."""
    x, y = _training.batch(step)
    mb = _training.GLOBAL_BATCH // (world * ga)
    rows = slice((micro * world + rank) * mb, (micro * world + rank + 1) * mb)
    return x[rows], y[rows]


def train_zero(
    group: Any, *, stage: int, ga: int, steps: int = STEPS, ended: bool = False, **config: Any
) -> dict[str, Any]:
    """Train under ZeRO the engine's way; return the norms and the final parameters.

    ``ended``: every pass non-boundary, each cycle ended by ``end_accumulation()`` (as with
    ``managed_gradient_accumulation: false``).
    """
    rank, world = group.get_rank(), group.size()
    model = _training.make_model()
    zero = wrap(model, group, stage=stage, **config)
    norms = []
    for step in range(steps):
        for micro in range(ga):
            x, y = micro_batch(step, rank, world, ga, micro)
            loss = _training.loss_fn(model, x, y) / ga
            zero.backward(loss, is_boundary=not ended and micro == ga - 1)
        if ended:
            zero.end_accumulation()
        result = zero.step()
        assert not result.overflow
        norms.append(result.grad_norm)
    return {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}


def _clip_factor(muon: Muon) -> tuple[float, float]:
    """The global norm over Muon updates (previewed) and Adam gradients, and the clip factor."""
    total = torch.zeros((), dtype=torch.float64)
    for group in muon.param_groups:
        for p in group["params"]:
            grad = p.grad
            if group["use_muon"]:
                state = muon.state[p].get("momentum_buffer", torch.zeros_like(grad))
                grad = muon_transform(grad, state.clone(), group)
            total += grad.double().pow(2).sum()
    norm = math.sqrt(float(total))
    return norm, min(1.0, CLIP / (norm + 1e-6))


def _clipped_step(muon: Muon, factor: float) -> None:
    saved = [(g["lr"], g["weight_decay"]) for g in muon.param_groups]
    for group in muon.param_groups:
        if group["use_muon"]:
            group["lr"], group["weight_decay"] = (
                group["lr"] * factor,
                group["weight_decay"] / factor,
            )
        else:
            for p in group["params"]:
                p.grad.mul_(factor)
    muon.step()
    for group, (lr, wd) in zip(muon.param_groups, saved, strict=True):
        group["lr"], group["weight_decay"] = lr, wd


def reference(steps: int = STEPS) -> dict[str, Any]:
    """One process, the whole batch, plain Muon, clipped the way ZeRO (and DeepSpeed) clips."""
    model = _training.make_model()
    muon = make_muon(model)
    norms = []
    for step in range(steps):
        x, y = _training.batch(step)
        model.zero_grad()
        _training.loss_fn(model, x, y).backward()
        norm, factor = _clip_factor(muon)
        _clipped_step(muon, factor)
        norms.append(norm)
    return {"norms": norms, "params": [p.detach().clone() for p in model.parameters()]}
