"""Which inner optimizers ZeRO may wrap, and how it cuts their tensors.

ZeRO hands the inner optimizer 1-D fp32 tensors: this rank's partition of each param group, where
parameters are cut at arbitrary element boundaries, itself cut into views of at most 1 MiB (see
`deepshard.zero._flat_params`; an optimizer merely allowed as untested gets each partition whole,
as one tensor). That is equivalent to stepping the original parameters only for an
*element-wise* optimizer: one whose update of an element depends on that element's gradient and
state alone (Adam, AdamW, SGD, Adagrad, Lion...), never on the parameter's shape or on other
elements (Muon, Shampoo, LAMB's per-tensor trust ratio).

An optimizer class declares itself safe with a class attribute::

    class MyAdam(torch.optim.Optimizer):
        zero_safe = True  # element-wise update: ZeRO may partition it

(``deepshard.optimizers`` sets it on its element-wise optimizers; the attribute is duck-typed,
so no import of ``deepshard.zero`` is needed). Any other optimizer needs the config's top-level
``"zero_allow_untested_optimizer": true``.
"""

from __future__ import annotations

import torch

from deepshard.zero._flat_params import MASTER_VIEW_NUMEL

__all__ = ["ZERO_SAFE_ATTRIBUTE", "is_zero_safe", "master_view_numel", "optimizer_problems"]

ZERO_SAFE_ATTRIBUTE = "zero_safe"
"""Class attribute that, set to ``True``, declares an optimizer element-wise (ZeRO-safe)."""

_TESTED: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.SGD,
    torch.optim.Adagrad,
)


def is_zero_safe(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is known to be element-wise: a tested torch class or marked safe."""
    cls = type(optimizer)
    return cls in _TESTED or getattr(cls, ZERO_SAFE_ATTRIBUTE, False) is True


def master_view_numel(optimizer: torch.optim.Optimizer, *, transformed: bool) -> int | None:
    """The most elements per master view the inner optimizer steps.

    Bounded views (`MASTER_VIEW_NUMEL`) for an optimizer known to be element-wise, or one whose
    non-element-wise groups a full-gradient transform handles (``transformed``): cutting is
    exact for them. ``None`` (whole partitions) for one merely allowed as untested, which then
    sees what it always saw.
    """
    elementwise = is_zero_safe(optimizer) or transformed
    return MASTER_VIEW_NUMEL if elementwise else None


def optimizer_problems(optimizer: object, *, allow_untested: bool) -> list[tuple[str, str]]:
    """Why ZeRO cannot wrap ``optimizer``, as ``(key path, message)`` (no key: not a setting).

    Args:
        optimizer: The inner optimizer.
        allow_untested: The config's ``zero_allow_untested_optimizer``.

    Returns:
        Empty when it can; else the problem: not a ``torch.optim.Optimizer``; it already has
        state (it must be wrapped before its first step); or it is untested and
        ``allow_untested`` is false.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [("", f"ZeRO wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")]
    if optimizer.state:
        message = (
            f"{type(optimizer).__name__} already has state; wrap it with ZeRO before its "
            "first step (ZeRO re-creates the state on the partitioned fp32 master weights)"
        )
        return [("", message)]
    if allow_untested or is_zero_safe(optimizer):
        return []
    return [
        (
            "zero_allow_untested_optimizer",
            f"{type(optimizer).__qualname__} is not known to be element-wise, which "
            'ZeRO\'s flat partitions need; set "zero_allow_untested_optimizer": true '
            "(top level of the config) to use it anyway, or mark the class "
            f"`{ZERO_SAFE_ATTRIBUTE} = True` if its update is element-wise",
        )
    ]
