"""Learning-rate schedules with DeepSpeed's names, parameters and value sequences.

``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` and ``LRRangeTest`` take the
keys of a DeepSpeed ``scheduler`` section and produce DeepSpeed's values step for step; any
``torch.optim.lr_scheduler`` class whose arguments JSON can express works by name as well.

Every schedule writes ``group["lr"]`` of the optimizer's param groups (``OneCycle`` also the
momentum: ``betas[0]`` or ``momentum``), starting at construction; call ``step()`` once per
applied optimizer step, after ``optimizer.step()``. ``state_dict()`` is plain JSON.

Example:
    >>> import torch
    >>> from deepshard.interface.config import SchedulerConfig
    >>> from deepshard.optimizers.schedules import build_scheduler
    >>> model = torch.nn.Linear(2, 2)
    >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    >>> config = SchedulerConfig(type="WarmupLR", params={"warmup_num_steps": 10})
    >>> schedule = build_scheduler(config, optimizer)
    >>> schedule.get_last_lr()
    [0.0]
"""

from __future__ import annotations

from deepshard.optimizers._schedule_base import LRSchedule, ParamGroupOwner
from deepshard.optimizers._schedule_build import DEEPSPEED_SCHEDULES, build_scheduler
from deepshard.optimizers._schedule_cycle import LRRangeTest, OneCycle
from deepshard.optimizers._schedule_torch import TorchSchedule
from deepshard.optimizers._schedule_warmup import WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = [
    "DEEPSPEED_SCHEDULES",
    "LRRangeTest",
    "LRSchedule",
    "OneCycle",
    "ParamGroupOwner",
    "TorchSchedule",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "build_scheduler",
]
