"""PyTorch's own schedules by name, behind the same small interface as DeepSpeed's.

A config may name any class of ``torch.optim.lr_scheduler`` whose arguments JSON can express
(``{"type": "StepLR", "params": {"step_size": 10}}``). `TorchSchedule` wraps the instance so
that `get_last_lr` returns floats and `state_dict` is plain JSON: torch keeps `MultiStepLR`'s
milestones as a ``Counter`` (whose int keys JSON would turn into strings) and a capturable lr
as a tensor, so the wrapper writes those as lists and floats and reads them back by the type
the live scheduler holds.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

import torch
from torch.optim import lr_scheduler

__all__ = ["REFUSED_TORCH_SCHEDULES", "TorchSchedule", "torch_schedule_classes"]

_CALLABLE_MESSAGE = (
    "takes a Python callable, which a JSON config cannot express; build the schedule in Python "
    "and hand the object over instead"
)
_COMPOSITE_MESSAGE = (
    "combines other scheduler objects, which a JSON config cannot express; build it in Python "
    "and hand the object over instead"
)

REFUSED_TORCH_SCHEDULES: dict[str, str] = {
    "LambdaLR": _CALLABLE_MESSAGE,
    "MultiplicativeLR": _CALLABLE_MESSAGE,
    "SequentialLR": _COMPOSITE_MESSAGE,
    "ChainedScheduler": _COMPOSITE_MESSAGE,
    "ReduceLROnPlateau": (
        "needs a validation metric at every step(), and the engine steps the schedule once per "
        "optimizer step without one; call it yourself from the training loop"
    ),
    "LRScheduler": "is the abstract base class; name a concrete schedule",
    "_LRScheduler": "is the abstract base class; name a concrete schedule",
}
"""``torch.optim.lr_scheduler`` names a config cannot use, with the reason and the way out."""


def torch_schedule_classes() -> dict[str, type[lr_scheduler.LRScheduler]]:
    """The ``torch.optim.lr_scheduler`` classes a config may name, by name."""
    found: dict[str, type[lr_scheduler.LRScheduler]] = {}
    for name in getattr(lr_scheduler, "__all__", dir(lr_scheduler)):
        cls = getattr(lr_scheduler, name, None)
        if (
            inspect.isclass(cls)
            and issubclass(cls, lr_scheduler.LRScheduler)
            and name not in REFUSED_TORCH_SCHEDULES
        ):
            found[name] = cls
    return found


def callable_params(cls: type) -> set[str]:
    """Constructor parameters of `cls` annotated as callables (not expressible in JSON)."""
    return {
        name
        for name, param in inspect.signature(cls).parameters.items()
        if "Callable" in str(param.annotation)
    }


def _to_plain(value: Any) -> Any:
    if isinstance(value, Counter):
        return sorted(value.elements())
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_to_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _to_plain(item) for key, item in value.items()}
    return value


def _from_plain(value: Any, like: Any) -> Any:
    """`value` read back into the container type `like` (the live scheduler's own value) has."""
    if isinstance(like, Counter):
        return Counter(value)
    if isinstance(like, tuple):
        return tuple(value)
    return value


class TorchSchedule:
    """A ``torch.optim.lr_scheduler`` instance with a float `get_last_lr` and a JSON state.

    Attributes:
        scheduler: The wrapped torch scheduler.
    """

    def __init__(self, scheduler: lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def step(self) -> None:
        """Advances the torch schedule by one step (call it after ``optimizer.step()``)."""
        self.scheduler.step()

    def get_last_lr(self) -> list[float]:
        """The learning rate of each param group, as last written into the optimizer."""
        return [float(lr) for lr in self.scheduler.get_last_lr()]

    def state_dict(self) -> dict[str, Any]:
        """The torch scheduler's state with counters and tensors written as plain lists/floats."""
        return {key: _to_plain(value) for key, value in self.scheduler.state_dict().items()}

    def load_state_dict(self, state_dict: dict[str, Any], /) -> None:
        """Restores a state saved by `state_dict` (or by the torch scheduler itself)."""
        live = self.scheduler.state_dict()
        restored = {key: _from_plain(value, live.get(key)) for key, value in state_dict.items()}
        self.scheduler.load_state_dict(restored)
