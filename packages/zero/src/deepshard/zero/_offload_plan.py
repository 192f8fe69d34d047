"""What optimizer offload runs, decided before anything is built: sub-groups, the step, refusals.

**Sub-groups.** Each rank's master partition of a param group is stepped in consecutive ranges
of at most ``sub_group_size`` elements (`plan_sub_groups`); they are the unit of the pipeline
(copy the gradients of sub-group k+1 to the host while k steps, read its state ahead from NVMe,
write k-1's behind) and they never cross a param group, whose hyper-parameters they share.

**The step** (`adam_rule`). When the inner optimizer is torch's ``Adam``/``AdamW`` or
DeepShard's ``Adam`` family (``AdamW``, ``CPUAdam``), the host runs DeepShard's CPU Adam kernel
on the host masters with the hyper-parameters read from the inner optimizer's param groups at
every step (so LR schedules keep working) and the moments in the offload's own host buffers or
files. Any other optimizer (torch SGD, DeepShard Lion...) is itself stepped on host master views,
with its state in host memory; that needs ``zero_force_ds_cpu_optimizer: false`` for a
non-DeepShard class (DeepSpeed refuses client optimizers the same way) and ``device: "cpu"``.

**Refusals** (`offload_config_problems`, `offload_problems`), as ``(key path, message)`` like
every ZeRO refusal: offload at stage 0 (nothing is partitioned, use stage 1), partial offload
(``ratio`` below 1) other than at stage 3 with ``device: "cpu"`` and an Adam optimizer,
``super_offload``, ``sub_group_size`` 0, a full-gradient transform (Muon)
below stage 3 (at stage 3 Newton–Schulz runs on the device on the whole reduced gradient and
Muon itself steps the host masters, so ``device: "cpu"`` only, as for any non-Adam optimizer),
an optimizer that only steps device tensors (``capturable=True``), and the two cases above.
``nvme`` without ``nvme_path`` and ``offload_param`` below stage 3 are refused by the config
schema itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.interface.config import ZeroConfig

__all__ = [
    "AdamHyper",
    "SubGroup",
    "adam_rule",
    "offload_config_problems",
    "offload_device",
    "offload_problems",
    "plan_sub_groups",
]

_KEY = "zero_optimization.offload_optimizer"


@dataclass(frozen=True)
class SubGroup:
    """One range of one param group's master partition, stepped as a unit.

    Attributes:
        group: The param group.
        index: Position among the group's sub-groups.
        start: First element of the group's partition it covers.
        stop: One past its last element.
        hyper: The inner optimizer's param group whose hyper-parameters step it; ``None``: the
            same as ``group`` (stages 1-2, where partitions are per param group; at stage 3
            ``group`` is the unit).
    """

    group: int
    index: int
    start: int
    stop: int
    hyper: int | None = None

    @property
    def param_group(self) -> int:
        """The inner optimizer's param group it belongs to."""
        return self.group if self.hyper is None else self.hyper

    @property
    def numel(self) -> int:
        """Elements of the sub-group."""
        return self.stop - self.start


def plan_sub_groups(
    ranges: Sequence[tuple[int, int, int, int]], sub_group_size: int
) -> tuple[SubGroup, ...]:
    """Every stepped range of the partitions cut into sub-groups of at most ``sub_group_size``.

    Args:
        ranges: ``(group, lo, hi, param group)``: elements ``[lo, hi)`` of group ``group``'s
            partition (a unit at stages 0-2), stepped with ``param group``'s hyper-parameters
            (`deepshard.zero._master_views`), in partition order.
        sub_group_size: The most elements per sub-group (``zero_optimization.sub_group_size``),
            at least 1.

    Returns:
        The sub-groups in partition order, numbered within their group; none for an empty
        range. ``hyper`` is left ``None`` where the param group has the group's index.
    """
    if sub_group_size < 1:
        # offload_problems refuses 0 for a config; a direct caller gets the same words.
        raise ValueError(
            f"zero_optimization.sub_group_size must be >= 1 (elements per offloaded sub-group), "
            f"got {sub_group_size}; use a positive count such as 1e9"
        )
    subs: list[SubGroup] = []
    counts: dict[int, int] = {}
    for group, lo, hi, param_group in ranges:
        hyper = None if param_group == group else param_group
        for start in range(lo, hi, sub_group_size):
            index = counts.get(group, 0)
            counts[group] = index + 1
            subs.append(SubGroup(group, index, start, min(start + sub_group_size, hi), hyper))
    return tuple(subs)


@dataclass(frozen=True)
class AdamHyper:
    """The CPU Adam kernel's arguments of one param group, read at a step."""

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool
    bias_correction: bool


AdamRule = Callable[[Mapping[str, Any]], AdamHyper]
"""Reads one param group of the inner optimizer as CPU Adam hyper-parameters."""

_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def _is_deepshard_adam(cls: type) -> bool:
    # deepshard.optimizers sits in ZeRO's own row, so it cannot be imported; its Adam family is
    # recognised by the defining class instead (AdamW and CPUAdam derive from it).
    return any(
        c.__module__ == "deepshard.optimizers.adam" and c.__name__ == "Adam" for c in cls.__mro__
    )


def _is_deepshard_optimizer(cls: type) -> bool:
    return cls.__module__.startswith("deepshard.optimizers")


def adam_rule(optimizer: torch.optim.Optimizer) -> AdamRule | None:
    """How to read ``optimizer``'s groups for the CPU Adam kernel; ``None`` when it is not Adam.

    torch ``Adam``/``AdamW`` and DeepShard's ``Adam`` family qualify unless a group asks for
    what the kernel does not do (``amsgrad``, ``maximize``, ``capturable``, ``differentiable``);
    such an optimizer is then stepped itself on the host masters.
    """
    cls = type(optimizer)
    deepshard = _is_deepshard_adam(cls)
    if cls not in (torch.optim.Adam, torch.optim.AdamW) and not deepshard:
        return None
    if any(group.get(flag) for group in optimizer.param_groups for flag in _UNSUPPORTED_FLAGS):
        return None

    def read(group: Mapping[str, Any]) -> AdamHyper:
        beta1, beta2 = group["betas"]
        if deepshard:
            adamw = bool(group.get("adam_w_mode", True))
        else:
            adamw = cls is torch.optim.AdamW or bool(group.get("decoupled_weight_decay", False))
        return AdamHyper(
            lr=float(group["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            adamw_mode=adamw,
            bias_correction=bool(group.get("bias_correction", True)),
        )

    return read


def offload_device(config: ZeroConfig) -> str:
    """``"cpu"``, ``"nvme"`` or ``"none"``: where the optimizer state goes."""
    section = config.offload_optimizer
    return "none" if section is None else section.device


def offload_config_problems(config: ZeroConfig) -> list[tuple[str, str]]:
    """The settings of ``config`` optimizer offload refuses whatever the optimizer.

    Args:
        config: The ``zero_optimization`` section.

    Returns:
        ``(key path, message)`` pairs; empty without offload or when it can run.
    """
    if offload_device(config) == "none":
        return []
    problems = []
    if config.stage == 0:
        problems.append((_KEY, "needs stage 1, 2 or 3 (stage 0 partitions nothing); set stage 1"))
    section = config.offload_optimizer
    assert section is not None, "offload_device said there is a section"
    if section.ratio < 1.0 and (config.stage != 3 or section.device != "cpu"):
        problems.append(
            (
                f"{_KEY}.ratio",
                f"{section.ratio} (partial offload) needs stage 3 and device 'cpu' (got stage "
                f"{config.stage}, device {section.device!r}); set it to 1.0 or use those",
            )
        )
    if section.super_offload:
        problems.append(
            (f"{_KEY}.super_offload", "(Superchip offload) is not supported; set it to false")
        )
    if config.sub_group_size < 1:
        problems.append(("zero_optimization.sub_group_size", "must be >= 1 with offload_optimizer"))
    return problems


def offload_problems(
    config: ZeroConfig, optimizer: object, force_cpu_optimizer: bool, transformed: bool
) -> list[tuple[str, str]]:
    """Why optimizer offload cannot step ``optimizer`` on the host, as ``(key path, message)``.

    The optimizer-independent settings are `offload_config_problems` (part of
    `deepshard.zero.zero_problems`).

    Args:
        config: The ``zero_optimization`` section.
        optimizer: The inner optimizer.
        force_cpu_optimizer: The top-level ``zero_force_ds_cpu_optimizer``.
        transformed: A full-gradient transform (Muon) is used.

    Returns:
        Empty without offload or when it can run.
    """
    device = offload_device(config)
    if device == "none":
        return []
    problems = []
    if transformed and config.stage < 3:
        problems.append(
            (
                _KEY,
                "Muon with optimizer offload runs at ZeRO stage 3 only (stages 1-2 keep its "
                "full-gradient groups on the device); set stage 3 or remove the offload section",
            )
        )
    if not isinstance(optimizer, torch.optim.Optimizer) or adam_rule(optimizer) is not None:
        return problems
    section = config.offload_optimizer
    if section is not None and section.ratio < 1.0:
        problems.append(
            (
                f"{_KEY}.ratio",
                f"partial offload steps its device share with the CPU Adam kernel's formula, and "
                f"{type(optimizer).__qualname__} is not Adam (or asks for amsgrad/maximize); "
                "set ratio to 1.0 or use Adam/AdamW",
            )
        )
    name = type(optimizer).__qualname__
    if any(group.get("capturable") for group in optimizer.param_groups):
        problems.append(
            (_KEY, f"{name} with capturable=True steps device tensors only; set capturable=False")
        )
    if device == "nvme":
        problems.append(
            (
                f"{_KEY}.device",
                f'"nvme" swaps the state of DeepShard\'s CPU Adam only, and {name} is not Adam '
                '(or asks for amsgrad/maximize); use device "cpu" or an Adam/AdamW optimizer',
            )
        )
    if force_cpu_optimizer and not _is_deepshard_optimizer(type(optimizer)):
        problems.append(
            (
                "zero_force_ds_cpu_optimizer",
                f"offload steps {name} itself on the host, which is slow; use Adam/AdamW (run "
                "with the CPU kernel) or set zero_force_ds_cpu_optimizer to false",
            )
        )
    return problems
