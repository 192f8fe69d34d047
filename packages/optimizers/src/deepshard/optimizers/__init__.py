"""Optimizers and LR schedules: Adam/AdamW (CPU kernel, fused, foreach), CPUAdam, Lion, Muon.

The schedules (DeepSpeed's ``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``,
``LRRangeTest``, and torch's by name) live in ``deepshard.optimizers.schedules`` and are
re-exported here; `add_schedule_arguments` / `schedule_config_from_args` bring DeepSpeed's
schedule tuning flags (``--lr_schedule``, ``--warmup_*`` ...) into a config.
"""

from deepshard.optimizers._schedule_args import add_schedule_arguments, schedule_config_from_args
from deepshard.optimizers.adam import Adam, AdamW, CPUAdam
from deepshard.optimizers.build import build_optimizer
from deepshard.optimizers.lion import Lion
from deepshard.optimizers.muon import Muon, muon_update
from deepshard.optimizers.schedules import (
    LRRangeTest,
    LRSchedule,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_scheduler,
)

__all__ = [
    "Adam",
    "AdamW",
    "CPUAdam",
    "LRRangeTest",
    "LRSchedule",
    "Lion",
    "Muon",
    "OneCycle",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "add_schedule_arguments",
    "build_optimizer",
    "build_scheduler",
    "muon_update",
    "schedule_config_from_args",
]
