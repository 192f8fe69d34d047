"""The optimizer side of ZeRO stage 3: fp32 masters of each unit's partition and the step.

``ZeroOptimizer(inner, sharded_module)`` builds this class. The model side (`ShardedModule`)
already reduce-scattered every gradient into this rank's gradient partition of its unit; what
is left is the arithmetic of stages 0-2 on those partitions:

1. **Masters.** Each unit's partition gets an fp32 master (the partition itself when it is
   fp32). The inner optimizer's param groups keep their hyper-parameters but their ``params``
   become *master views*: for every parameter of a group, the range of its unit's partition
   this rank holds, consecutive ranges of one group merged into one view (alignment padding
   between them is zero and stays zero under an element-wise update), at most 1 MiB each for a
   known element-wise optimizer. So param groups never decide how gradients are communicated.
2. **Step.** The overflow flag and the global norm take one all-reduce over the group
   (`deepshard.zero._step`); an overflow skips everything; otherwise one factor unscales and
   clips, and the inner optimizer steps the views in *sub-groups* of at most ``sub_group_size``
   elements (views of other sub-groups have no gradient then, so torch optimizers skip them).
   The masters are copied into the partitions in the parameter dtype and the model side is told
   its gathered parameters are stale; no all-gather follows: the next forward gathers.

With ``offload_optimizer`` the masters and moments live on the host or in files and step 2
runs on the host per sub-group (`deepshard.zero._stage3_offload`); the partitions themselves
may live on the host or in files too (``offload_param``, `deepshard.zero._param_offload`), and
``offload_states`` moves the stage-3 state types (`deepshard.zero._stage3_states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from deepshard.comm import CommsLogger, Group, resolve_group
from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.interface.errors import CheckpointError, CommError, ConfigError
from deepshard.zero._offload_plan import offload_problems
from deepshard.zero._optimizer_check import master_view_numel, optimizer_problems
from deepshard.zero._settings import zero_problems
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._shards import ParamShard
from deepshard.zero._stage3_offload import build_stage3_offload, device_masters
from deepshard.zero._stage3_states import Stage3States
from deepshard.zero._step import NormSettings, StepResult, checked_norm
from deepshard.zero.layout import FlatLayout
from deepshard.zero.norms import check_norm_type, scale_factor
from deepshard.zero.optimizer import ZeroOptimizer
from deepshard.zero.reduction import GradientReduction

__all__ = ["Stage3Optimizer"]

View = tuple[int, torch.Tensor, int, int]
"""``(unit, master view, lo, hi)``: a view of a unit's master and its range."""


def _ranges(sharded: ShardedModule, group_params: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """``(unit, lo, hi)`` of every trainable parameter's local piece in its unit's partition."""
    out = []
    for param in group_params:
        if not param.requires_grad:
            continue
        info = sharded.shard_info(param)
        if info.local_numel:
            out.append((info.unit, info.local_offset, info.local_offset + info.local_numel))
    return sorted(out)


def _merged(
    ranges: list[tuple[int, int, int]], sharded: ShardedModule, max_numel: int | None
) -> list[tuple[int, int, int]]:
    """Consecutive ranges of one unit merged across padding, then cut to ``max_numel``."""
    merged: list[tuple[int, int, int]] = []
    for unit, lo, hi in ranges:
        alignment = sharded.plans[unit].layout.alignment
        if merged and merged[-1][0] == unit and lo - merged[-1][2] < alignment:
            merged[-1] = (unit, merged[-1][1], hi)
        else:
            merged.append((unit, lo, hi))
    if max_numel is None:
        return merged
    return [
        (unit, start, min(start + max_numel, hi))
        for unit, lo, hi in merged
        for start in range(lo, hi, max_numel)
    ]


class Stage3Optimizer(Stage3States, ZeroOptimizer):
    """ZeRO stage 3's optimizer side around an element-wise ``optimizer``.

    Args:
        optimizer: The inner optimizer, built on the sharded model's parameters, not stepped.
        sharded: The model side (`deepshard.zero.shard`).
        config: The ``zero_optimization`` section (``compute_grad_norm``, ``sub_group_size``).
        gradient_clipping: Clip the global gradient norm to this; 0 disables.
        norm_type: Order of the norm.
        zero_allow_untested_optimizer: Accept an optimizer not known to be element-wise.
        comms_logger: Records the norm's all-reduce.
        group: If given, it must be the sharded module's group.
        aio: The ``aio`` section (NVMe optimizer offload).
        zero_force_ds_cpu_optimizer: With offload, refuse an optimizer stepped as itself on the
            host unless it is DeepShard's.

    Raises:
        ConfigError: Unsupported settings, an unsuitable optimizer, a parameter that is not the
            sharded model's, or ``group`` other than the sharded module's.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sharded: ShardedModule,
        *,
        config: ZeroConfig | None = None,
        gradient_clipping: float = 1.0,
        norm_type: float = 2.0,
        zero_allow_untested_optimizer: bool = False,
        comms_logger: CommsLogger | None = None,
        group: Group | None = None,
        aio: AioConfig | None = None,
        zero_force_ds_cpu_optimizer: bool = True,
    ) -> None:
        self.config = config if config is not None else ZeroConfig(stage=3)
        problems = zero_problems(self.config, gradient_clipping=gradient_clipping, sharded=True)
        problems += optimizer_problems(optimizer, allow_untested=zero_allow_untested_optimizer)
        problems += offload_problems(self.config, optimizer, zero_force_ds_cpu_optimizer, False)
        if problems:
            raise ConfigError.from_problems(problems)
        if group is not None and resolve_group(group) is not sharded.group:
            raise ConfigError(
                "ZeroOptimizer got a group other than its ShardedModule's; stage 3 reduces over "
                "the group the model was sharded on, so leave group= out"
            )
        self.inner, self.gradient_clipping = optimizer, gradient_clipping
        self.norm_type = check_norm_type(norm_type)
        self.sharded, self._logger = sharded, comms_logger
        self._group = sharded.group
        self._partitions, self._partition_rank = self._group.size(), self._group.rank()
        self._device = sharded.units[0].buffer.device
        ranges = [
            _merged(_ranges(sharded, list(g["params"])), sharded, self.config.sub_group_size)
            for g in optimizer.param_groups
        ]
        self._offload = build_stage3_offload(self.config, optimizer, sharded, ranges, aio)
        self._masters = [] if self._offload is not None else device_masters(sharded)
        self._views = (
            []
            if self._offload is not None
            else self._map_param_groups(master_view_numel(optimizer, transformed=False))
        )
        self._sub_groups = self._cut_sub_groups(self.config.sub_group_size)
        self._boundary_flag = True
        self._run_boundary: bool | None = None
        self._no_sync_depth, self._pass_boundary, self._ready = 0, False, False
        self._offloaded = {}  # `offload_states` bookkeeping (deepshard.zero._stage3_states)
        sharded.add_pass_observer(self._on_begin, self._on_end)

    def _map_param_groups(self, max_numel: int | None) -> list[View]:
        views: list[View] = []
        for group in self.inner.param_groups:
            ranges = _merged(_ranges(self.sharded, list(group["params"])), self.sharded, max_numel)
            mine = [(u, self._masters[u][lo:hi], lo, hi) for u, lo, hi in ranges]
            group["params"] = [view for _, view, _, _ in mine]
            views.extend(mine)
        return views

    def _cut_sub_groups(self, size: int) -> list[list[View]]:
        groups: list[list[View]] = [[]]
        fill = 0
        for view in self._views:
            numel = view[3] - view[2]
            if size > 0 and groups[-1] and fill + numel > size:
                groups.append([])
                fill = 0
            groups[-1].append(view)
            fill += numel
        return groups

    # --- backward passes --------------------------------------------------------------

    def _on_begin(self) -> None:
        self.check_resident("a backward pass")
        if self._ready:
            raise CommError(
                "a backward pass followed the accumulation boundary before step(): call step() "
                "(or zero_grad() to drop the gradients) after the boundary's backward"
            )
        declared = self._boundary_flag if self._run_boundary is None else self._run_boundary
        self._pass_boundary = declared and self._no_sync_depth == 0

    def _on_end(self) -> None:
        self._ready = self._pass_boundary

    def backward(
        self, loss: torch.Tensor, *, is_boundary: bool | None = None, retain_graph: bool = False
    ) -> None:
        """``loss.backward()`` with this pass's boundary flag (see `ZeroOptimizer.backward`)."""
        self._run_boundary = is_boundary
        try:
            self.sharded.backward(loss, retain_graph=retain_graph)
        finally:
            self._run_boundary = None

    def set_boundary(self, flag: bool) -> None:
        """As `ZeroOptimizer.set_boundary`."""
        self._boundary_flag = bool(flag)

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        self._no_sync_depth += 1
        try:
            yield
        finally:
            self._no_sync_depth -= 1

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """Passes inside still reduce-scatter (only partitions are kept) but end no cycle."""
        return self._no_sync()

    # --- step -------------------------------------------------------------------------

    def step(  # type: ignore[override]
        self, closure: None = None, *, loss_scale: float = 1.0
    ) -> StepResult:
        """As `ZeroOptimizer.step`; the next forward gathers the updated parameters."""
        if closure is not None or not loss_scale > 0:
            raise ConfigError("ZeroOptimizer.step takes no closure and a loss_scale > 0")
        self.check_resident("step()")
        if not self._ready:
            raise CommError(
                "step() needs gradients reduced at an accumulation boundary: run a backward "
                "pass with is_boundary=True (outside no_sync()) since the last step"
            )
        grads = self._fp32_grads()
        device = self._device
        group = self._group if self._partitions > 1 else None
        settings = NormSettings(
            self.config.compute_grad_norm, self.norm_type, group, device, self._logger
        )
        norm, overflow = checked_norm(grads, loss_scale, settings, None)
        if not overflow:
            factor = scale_factor(norm, clip=self.gradient_clipping, loss_scale=loss_scale)
            if self._offload is not None:
                self._offload.step(self.inner, grads, factor)
            else:
                self._step_sub_groups(grads, factor)
                for state, master in zip(self.sharded.units, self._masters, strict=True):
                    if master is not state.partition:
                        state.home.write(master)
            for state in self.sharded.units:
                state.home.flush()
            self.sharded.partitions_updated()
        self.sharded.clear_grads()
        self._ready = False
        return StepResult(overflow=overflow, grad_norm=norm)

    def _fp32_grads(self) -> list[torch.Tensor]:
        out = []
        for grad, unit in zip(self.sharded.grad_partitions(), self.sharded.units, strict=True):
            if grad is None:
                numel = unit.plan.layout.partition_numel
                out.append(torch.zeros(numel, dtype=torch.float32, device=self._device))
            else:
                out.append(grad if grad.dtype == torch.float32 else grad.float())
        return out

    def _step_sub_groups(self, grads: list[torch.Tensor], factor: float) -> None:
        if factor != 1.0:
            for grad in grads:
                grad.mul_(factor)
        for sub_group in self._sub_groups:
            for unit, view, lo, hi in sub_group:
                view.grad = grads[unit][lo:hi]
            self.inner.step()
            for _, view, _, _ in sub_group:
                view.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient partitions accumulated since the last step."""
        if self.sharded.in_pass:
            raise CommError("zero_grad() was called inside a backward pass")
        self.check_resident("zero_grad()")
        self.sharded.clear_grads()
        self._ready = False

    # --- what the engine, schedulers and checkpoints read -----------------------------

    @property
    def sharded_module(self) -> ShardedModule:
        """The model side."""
        return self.sharded

    @property
    def layouts(self) -> tuple[FlatLayout, ...]:
        """Each unit's flat layout."""
        return tuple(plan.layout for plan in self.sharded.plans)

    @property
    def master_partitions(self) -> tuple[torch.Tensor, ...]:
        """This rank's fp32 master of every unit's partition (with offload, on the host)."""
        return self._offload.masters() if self._offload is not None else tuple(self._masters)

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """Masters are flat views at stage 3: always ``None``."""
        return None

    def shard_maps(self) -> tuple[ParamShard, ...]:
        """Where every element of every parameter's master lives, per rank."""
        infos = [self.sharded.shard_info(p) for plan in self.sharded.plans for p in plan.params]
        return tuple(info.shard for info in infos)

    def optimizer_state_bytes(self) -> int:
        """Bytes of inner-optimizer state on this rank."""
        tensors = [v for s in self.inner.state.values() for v in s.values()]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def master_bytes(self) -> int:
        """Bytes of fp32 masters beyond the partitions (an fp32 partition is its own master)."""
        if self._offload is not None:
            return 0  # on the host
        pairs = zip(self._masters, self.sharded.units, strict=True)
        return sum(m.numel() * m.element_size() for m, u in pairs if m is not u.partition)

    def gradient_bytes(self) -> int:
        """Bytes of gradient partitions held now."""
        return self.sharded.gradient_bytes()

    def state_dict(self) -> dict[str, Any]:
        """This rank's masters and inner state (reload with the same units and world)."""
        self.check_resident("state_dict()")
        saved = {
            "stage": 3,
            "world_size": self._partitions,
            "masters": [m.clone() for m in self.master_partitions],
            "inner": self.inner.state_dict(),
        }
        if self._offload is not None:
            saved["offload"] = self._offload.state_dict()
        return saved

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`; the partitions take the masters' values.

        Raises:
            CheckpointError: It was saved with another stage, world or layout.
        """
        self.check_resident("load_state_dict()")
        masters = state_dict.get("masters", [])
        shapes = [tuple(m.shape) for m in masters]
        if (
            state_dict.get("stage") != 3
            or state_dict.get("world_size") != self._partitions
            or shapes != [(u.plan.layout.partition_numel,) for u in self.sharded.units]
        ):
            raise CheckpointError(
                "this ZeRO stage-3 state was saved with another stage, world size or unit "
                "layout; load it into the same model, policy and world size"
            )
        self.inner.load_state_dict(state_dict["inner"])
        if self._offload is not None:
            self._offload.load_state_dict(masters, state_dict.get("offload"))
        else:
            pairs = zip(self._masters, masters, self.sharded.units, strict=True)
            for master, saved, state in pairs:
                master.copy_(saved)
                if master is not state.partition:
                    state.home.write(master)
        for state in self.sharded.units:
            state.home.flush()
        self.sharded.partitions_updated()

    @property
    def reduction(self) -> GradientReduction:
        """How gradients are combined (the model side's policy)."""
        return self.sharded.policy.reduction

    @property
    def stage(self) -> int:
        """The ZeRO stage: 3."""
        return 3

    def close(self) -> None:
        """Remove the swap files of offloaded optimizer state and parameters; no step may
        follow."""
        if self._offload is not None:
            self._offload.close()
        self.sharded.close()

    def remove_hooks(self) -> None:
        """Give the model back its whole parameters and detach every hook."""
        self.sharded.remove_hooks()
