"""Muon (MomentUm Orthogonalized by Newton–Schulz) with an auxiliary Adam, as DeepSpeed has it.

For a hidden matrix parameter with gradient ``g`` and momentum ``m`` (kept in ``g``'s dtype)::

    m = beta*m + (1-beta)*g                       # only if g is finite, see below
    u = (1-beta)*g + beta*m                       # Nesterov
    O = newton_schulz(u) * sqrt(max(1, rows/cols))
    p = p * (1 - lr*wd) - lr*O

Every other parameter (embeddings, ``lm_head``, 1-D ones; see ``_muon_groups``) takes Adam
with betas (0.9, 0.95) and eps 1e-10 unless told otherwise. A 4-D (convolution) update is
orthogonalized as ``(out_channels, rest)`` and scaled by that matrix's rows/cols (DeepSpeed
reads the last two dimensions of the 4-D tensor there, the kernel's height/width); a 3-D one
as a batch of matrices (stacked experts). Two more deliberate differences from DeepSpeed's
class: a parameter without a gradient is skipped like in any torch optimizer (DeepSpeed fills
in zeros to keep its rank round-robin in step, which a single optimizer does not have), and
``p.grad`` is left as it was (DeepSpeed writes the Nesterov blend into it).

**Non-finite gradients.** A loss scaler discards an overflowed step, but ZeRO folds the
gradient into the momentum while it reduces gradients, before the overflow is known (it calls
`muon_update` on the full gradient then). One overflow would poison the momentum for the rest
of the run. So `muon_update` leaves the momentum untouched when the gradient holds an inf or
NaN (decided on the device, no host synchronization) and returns the non-finite gradient as
the update, so the overflow check that follows still sees it and the step is skipped. Without
ZeRO the engine, like ``torch.amp.GradScaler``, simply does not call `Muon.step` on overflow.

**Partitioned parameters.** A Muon parameter stored as a flat 1-D partition (a ZeRO master
piece at stages 1-2, a partitioned parameter at stage 3; told through ``param_shapes``) cannot
be orthogonalized piecewise: its gradient must already hold the update, computed by
`muon_update` on the full reduced gradient (ZeRO's ``full_grad_transform``), and `Muon.step`
applies only the weight decay and the learning rate to it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.interface.params import ParamShapes
from deepshard.optimizers._adam_step import ADAM_IMPLS, AdamSettings, adam_step
from deepshard.optimizers._checks import (
    check_betas,
    check_choice,
    check_gradient,
    check_hyperparameters,
)
from deepshard.optimizers._muon_groups import layer_shape, split_group
from deepshard.optimizers._newton_schulz import NS_METHODS, newton_schulz
from deepshard.optimizers._state import restore_saved_dtypes
from deepshard.optimizers.adam import ParamsT

__all__ = ["Muon", "muon_update"]

NS_STEPS = 5
MUON_LR = 0.02
ADAM_LR = 3e-4


def _as_matrices(update: torch.Tensor) -> torch.Tensor:
    if update.ndim >= 4:
        return update.reshape(update.shape[0], -1)
    return update


def muon_update(
    grad: torch.Tensor,
    momentum: torch.Tensor,
    *,
    beta: float = 0.95,
    ns_method: str = "gram",
    ns_steps: int = NS_STEPS,
    nesterov: bool = True,
) -> torch.Tensor:
    """Folds ``grad`` into ``momentum`` and returns the orthogonalized update.

    Args:
        grad: The full (unpartitioned) gradient, 2-D or more; left unchanged.
        momentum: The momentum buffer, same shape and dtype as ``grad``; updated in place
            unless ``grad`` holds an inf or NaN.
        beta: Momentum coefficient.
        ns_method: ``"gram"`` or ``"standard"`` Newton–Schulz.
        ns_steps: Newton–Schulz iterations.
        nesterov: Use the Nesterov blend of gradient and momentum.

    Returns:
        The update in ``grad``'s dtype and shape, scaled by ``sqrt(max(1, rows/cols))``; the
        gradient itself when it is not finite.

    Raises:
        ConfigError: ``grad`` has fewer than 2 dimensions, or ``momentum`` does not match it.
    """
    if grad.ndim < 2:
        raise ConfigError(
            f"muon_update orthogonalizes matrices, got a gradient of shape {tuple(grad.shape)}; "
            "1-D parameters belong to the auxiliary Adam"
        )
    if momentum.shape != grad.shape or momentum.dtype != grad.dtype:
        raise ConfigError(
            f"the momentum ({momentum.dtype}, {tuple(momentum.shape)}) must match the gradient "
            f"({grad.dtype}, {tuple(grad.shape)}); cast it with momentum.to(grad.dtype)"
        )
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1.0 - beta), momentum))
    blended = grad.lerp(momentum, beta) if nesterov else momentum
    matrices = _as_matrices(blended)
    rows, cols = matrices.shape[-2], matrices.shape[-1]
    ortho = newton_schulz(matrices, steps=ns_steps, method=ns_method)
    ortho = ortho * math.sqrt(max(1.0, rows / cols))
    update = ortho.to(grad.dtype).reshape(grad.shape)
    return torch.where(finite, update, grad)


class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices plus an auxiliary Adam for everything else, in one optimizer.

    Args:
        params: ``model.named_parameters()`` (names decide embeddings and ``lm_head``),
            ``(name, parameter)`` pairs, param groups (with named or plain parameters), or plain
            parameters together with ``names``. A group's own settings win (see
            ``_muon_groups``); a group with ``use_muon`` is taken as it is.
        lr: Learning rate of both halves unless ``muon_lr`` / ``adam_lr`` say otherwise
            (``None``: 0.02 for Muon, 3e-4 for Adam).
        momentum: Muon momentum coefficient.
        weight_decay: Decoupled weight decay of both halves.
        ns_method: ``"gram"`` (default) or ``"standard"`` Newton–Schulz.
        betas: Adam moment decay rates.
        eps: Adam denominator term.
        muon_lr: Learning rate of the Muon half.
        adam_lr: Learning rate of the Adam half.
        adam_w_mode: Decoupled weight decay in the Adam half (else L2 on the gradient).
        names: Parameter names by name, e.g. ``dict(model.named_parameters())``, for plain
            parameters.
        param_shapes: Layer shapes of parameters stored partitioned (from the ZeRO package).
        adam_impl: Implementation of the Adam half (see `Adam`).
        fp32_optimizer_states: Keep Adam moments in fp32.

    Raises:
        ConfigError: A setting out of range, an unknown ``ns_method``, or a matrix parameter
            without a name.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | None = None,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        ns_method: str = "gram",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-10,
        *,
        muon_lr: float | None = None,
        adam_lr: float | None = None,
        adam_w_mode: bool = True,
        names: Mapping[str, torch.Tensor] | None = None,
        param_shapes: ParamShapes | None = None,
        adam_impl: str = "auto",
        fp32_optimizer_states: bool = True,
    ) -> None:
        self.adam_w_mode = bool(adam_w_mode)
        self.adam_impl = check_choice("adam_impl", adam_impl, ADAM_IMPLS)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)
        self.param_shapes = param_shapes
        self._names = {id(p): name for name, p in (names or {}).items()}
        self._halves: dict[bool, dict[str, Any]] = {
            True: {"lr": _first(muon_lr, lr, MUON_LR), "momentum": momentum,
                   "weight_decay": weight_decay, "ns_method": ns_method},
            False: {"lr": _first(adam_lr, lr, ADAM_LR), "betas": betas, "eps": eps,
                    "weight_decay": weight_decay},
        }  # fmt: skip
        self._incoming_groups = 0
        super().__init__(params, {})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Splits a group into its Muon and Adam halves and adds each (see ``_muon_groups``)."""
        halves = split_group(
            param_group,
            index=self._incoming_groups,
            names=self._names,
            shapes=self.param_shapes,
            halves=self._halves,
        )
        self._incoming_groups += 1
        for half in halves:
            _check_half(half, self.param_shapes)
            super().add_param_group(half)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state dict; tensors keep their saved dtype (a momentum saved in fp32 is cast
        to the gradient's dtype on the next step)."""
        super().load_state_dict(state_dict)
        restore_saved_dtypes(self, state_dict)

    def _momentum(self, param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        state = self.state[param]
        buffer: torch.Tensor | None = state.get("momentum_buffer")
        if buffer is None:
            buffer = torch.zeros_like(grad, memory_format=torch.contiguous_format)
        elif buffer.dtype != grad.dtype or buffer.device != grad.device:
            buffer = buffer.to(dtype=grad.dtype, device=grad.device)
        state["momentum_buffer"] = buffer
        return buffer

    def _step_muon(self, group: dict[str, Any]) -> None:
        lr, weight_decay = float(group["lr"]), float(group["weight_decay"])
        for param in group["params"]:
            grad = param.grad
            if grad is None:
                continue
            check_gradient(param, grad, "Muon")
            if param.ndim < 2:
                update = grad  # a flat partition: ZeRO already put the update in the gradient
            else:
                momentum = self._momentum(param, grad)
                update = muon_update(
                    grad, momentum, beta=float(group["momentum"]), ns_method=group["ns_method"]
                )
            param.mul_(1.0 - lr * weight_decay)
            param.add_(update, alpha=-lr)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Performs one optimization step of both halves.

        Args:
            closure: Re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None without a closure.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._step_muon(group)
                continue
            adam_step(
                group["params"],
                self.state,
                AdamSettings.from_group(group, adamw_mode=self.adam_w_mode),
                impl=self.adam_impl,
                fp32_optimizer_states=self.fp32_optimizer_states,
                num_threads=None,
                owner="Muon's auxiliary Adam",
            )
        return loss


def _first(*values: float | None) -> float:
    return next(v for v in values if v is not None)


def _check_half(group: dict[str, Any], shapes: ParamShapes | None) -> None:
    check_hyperparameters(lr=group.get("lr"), weight_decay=group.get("weight_decay"))
    if group["use_muon"]:
        flat = [tuple(p.shape) for p in group["params"] if len(layer_shape(p, shapes)) < 2]
        if flat:
            raise ConfigError(
                f"a use_muon=True group holds parameters of shapes {flat}; Muon updates "
                "matrices only, put 1-D parameters in a use_muon=False group"
            )
        check_hyperparameters(momentum=group.get("momentum"))
        if not 0.0 <= float(group["momentum"]) < 1.0:
            raise ConfigError.from_problems([("momentum", "must be in [0, 1)")])
        check_choice("ns_method", group.get("ns_method"), NS_METHODS)
    else:
        group["betas"] = check_betas(group.get("betas"))
        check_hyperparameters(eps=group.get("eps"))
