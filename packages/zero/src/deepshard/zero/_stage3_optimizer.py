"""The optimizer side of ZeRO stage 3: masters of each unit's partition and the step.

``ZeroOptimizer(inner, sharded_module)`` builds this class. The model side (`ShardedModule`)
already reduce-scattered every gradient into this rank's gradient partition of its unit; what
is left is the arithmetic of stages 0-2 on those partitions:

1. **Masters.** The trainable prefix of each unit's partition (frozen parameters sit at the
   end of the unit's layout, `deepshard.zero._units`) gets an fp32 master (16-bit with the
   ``*_master_weights_and_grads`` switches; a view of the partition itself in that dtype);
   frozen parameters get neither a master nor state. The inner optimizer's param groups keep
   their hyper-parameters but their ``params`` become *master views*: for every parameter of a
   group, the range of its unit's partition this rank holds, consecutive ranges of one group
   merged into one view (alignment padding between them is zero and stays zero under an
   element-wise update), at most 1 MiB each for a known element-wise optimizer. So param groups
   never decide how gradients are communicated.
2. **Step.** The overflow flag and the global norm take one all-reduce over the group
   (`deepshard.zero._step`); an overflow skips everything; otherwise one factor unscales and
   clips, and the inner optimizer steps the views in *sub-groups* of at most ``sub_group_size``
   elements (views of other sub-groups have no gradient then, so torch optimizers skip them).
   The masters are copied into the partitions in the parameter dtype and the model side is told
   its gathered parameters are stale; no all-gather follows: the next forward gathers.
3. **Full-gradient transforms** (Muon): before the norm, the units holding transformed
   matrices gather their reduced gradients and each matrix's update replaces its gradient
   pieces (`deepshard.zero._stage3_muon`).

With ``offload_optimizer`` the masters (still only the trainable prefixes) and moments live on
the host or in files and step 2 runs on the host per sub-group (`deepshard.zero._stage3_offload`;
with Muon, step 3 still runs on the device first and Muon steps the host masters itself, so
``device: "cpu"`` only); the partitions themselves
may live on the host or in files too (``offload_param``, `deepshard.zero._param_offload`), and
``offload_states`` moves the stage-3 state types (`deepshard.zero._stage3_states`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from deepshard.comm import CommsLogger, Group, resolve_group
from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.interface.errors import CheckpointError, CommError, ConfigError
from deepshard.zero._full_grads import FullGradTransform
from deepshard.zero._master_dtype import check_param_dtypes, master_dtype_problems
from deepshard.zero._offload_plan import offload_problems
from deepshard.zero._optimizer_check import master_view_numel, optimizer_problems
from deepshard.zero._rgroups import mixed_group_problems
from deepshard.zero._settings import zero_problems
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._shards import ParamShard
from deepshard.zero._stage3_masters import (
    device_masters,
    follow_partition,
    master_grads,
    master_ranges,
    merged_ranges,
)
from deepshard.zero._stage3_muon import Stage3FullGrads
from deepshard.zero._stage3_offload import build_stage3_offload, follow_partitions
from deepshard.zero._stage3_owner import Stage3PartitionAccess
from deepshard.zero._stage3_states import Stage3States
from deepshard.zero._step import NormSettings, StepResult, checked_norm
from deepshard.zero._tp import sharded_tp_grads, tp_problems
from deepshard.zero.layout import FlatLayout
from deepshard.zero.norms import check_norm_type, scale_factor
from deepshard.zero.optimizer import ZeroOptimizer
from deepshard.zero.reduction import GradientReduction

__all__ = ["Stage3Optimizer"]

View = tuple[int, torch.Tensor, int, int]
"""``(unit, master view, lo, hi)``: a view of a unit's master and its range."""


class Stage3Optimizer(Stage3PartitionAccess, Stage3States, ZeroOptimizer):
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
        full_grad_transform: ``(grad, buffer, param_group) -> update`` on the whole reduced
            gradient of each of ``transformed_params`` once per step (Muon's ``muon_update``;
            see `deepshard.zero._stage3_muon`); it declares the inner optimizer element-wise
            on what remains. With ``offload_optimizer: cpu`` it still runs on the device.
        transformed_params: Whole param groups of ``optimizer`` to transform.
        aio: The ``aio`` section (NVMe optimizer offload).
        zero_force_ds_cpu_optimizer: With offload, refuse an optimizer stepped as itself on the
            host unless it is DeepShard's.
        master_dtype: fp32, or 16-bit masters (as `ZeroOptimizer`; a device-resident partition in
            that dtype is then its own master and the reduced gradients are handed over in it).
        state_dtype: With optimizer offload, the host moments' dtype (as `ZeroOptimizer`).

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
        full_grad_transform: FullGradTransform | None = None,
        transformed_params: Iterable[torch.Tensor] = (),
        aio: AioConfig | None = None,
        zero_force_ds_cpu_optimizer: bool = True,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config if config is not None else ZeroConfig(stage=3)
        transformed = full_grad_transform is not None
        allow_untested = zero_allow_untested_optimizer or transformed
        problems = zero_problems(self.config, gradient_clipping=gradient_clipping, sharded=True)
        problems += optimizer_problems(optimizer, allow_untested=allow_untested)
        problems += offload_problems(
            self.config, optimizer, zero_force_ds_cpu_optimizer, transformed
        )
        if sharded.mixed_groups:
            problems += mixed_group_problems(self.config, transformed=transformed)
        problems += tp_problems(sharded, transformed=transformed)
        problems += master_dtype_problems(self.config, master_dtype, transformed=transformed)
        if problems:
            raise ConfigError.from_problems(problems)
        check_param_dtypes(master_dtype, [unit.buffer.dtype for unit in sharded.units])
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
        # Each unit's own group rank: expert units are partitioned over their own group.
        pairs = zip(sharded.plans, sharded.units, strict=True)
        self._trainable = [plan.trainable_numel(unit.rank) for plan, unit in pairs]
        self._transforms = Stage3FullGrads(
            full_grad_transform, transformed_params, sharded, optimizer.param_groups, comms_logger
        )
        ranges = [
            merged_ranges(master_ranges(sharded, g["params"]), sharded, self.config.sub_group_size)
            for g in optimizer.param_groups
        ]
        self._offload = build_stage3_offload(
            self.config, optimizer, sharded, ranges, self._trainable, aio, master_dtype, state_dtype
        )
        self._master_dtype = master_dtype
        host_step = self._offload is not None
        masters = [] if host_step else device_masters(sharded, self._trainable, master_dtype)
        self._masters = [master for master, _ in masters]
        self._own_master = [own for _, own in masters]
        self._views = (
            []
            if self._offload is not None
            else self._map_param_groups(master_view_numel(optimizer, transformed=transformed))
        )
        self._sub_groups = self._cut_sub_groups(self.config.sub_group_size)
        self._tp = sharded_tp_grads(sharded)
        self._boundary_flag = True
        self._run_boundary: bool | None = None
        self._no_sync_depth, self._pass_boundary, self._ready = 0, False, False
        self._offloaded = {}  # `offload_states` bookkeeping (deepshard.zero._stage3_states)
        sharded.add_pass_observer(self._on_begin, self._on_end)
        sharded.add_partition_observer(self._partitions_written)

    def _partitions_written(self, units: Sequence[int]) -> None:
        """Partitions written by hand (`GatheredParameters`): the masters take the new values
        (`deepshard.zero._stage3_masters.follow_partition`), on the host too with offload."""
        if self._offload is not None:
            follow_partitions(self._offload, self.sharded, units)
            return
        for unit in units:
            if self._own_master[unit]:
                follow_partition(self._masters[unit], self.sharded.units[unit].home.read())

    def _map_param_groups(self, max_numel: int | None) -> list[View]:
        views: list[View] = []
        for group in self.inner.param_groups:
            mine_ranges = master_ranges(self.sharded, group["params"])
            ranges = merged_ranges(mine_ranges, self.sharded, max_numel)
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

    def end_accumulation(self) -> None:
        """As `ZeroOptimizer.end_accumulation`: every pass reduce-scattered into the gradient
        partitions, so ending the cycle only marks them ready.

        Raises:
            CommError: A backward pass or ``no_sync()`` is running.
        """
        if self.sharded.in_pass or self._no_sync_depth:
            where = "a backward pass" if self.sharded.in_pass else "no_sync()"
            raise CommError(f"the accumulation cycle cannot end inside {where}")
        self._ready = True

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
        grads = master_grads(
            self.sharded.grad_partitions(), self._trainable, self._master_dtype, self._device
        )
        device = self._device
        group = self._group if self._partitions > 1 else None
        settings = NormSettings(
            self.config.compute_grad_norm, self.norm_type, group, device, self._logger, self._tp
        )
        transform = None
        if self._transforms.active:

            def transform() -> None:
                self._transforms.apply(grads, loss_scale, self.inner.param_groups)

        norm, overflow = checked_norm(grads, loss_scale, settings, transform)
        if not overflow:
            factor = scale_factor(norm, clip=self.gradient_clipping, loss_scale=loss_scale)
            if self._offload is not None:
                self._offload.step(self.inner, grads, factor)
            else:
                self._step_sub_groups(grads, factor)
                self._masters_to_partitions()
            for state in self.sharded.units:
                state.home.flush()
            self.sharded.partitions_updated()
        self.sharded.clear_grads()
        self._ready = False
        self._last_overflow = overflow
        return StepResult(overflow=overflow, grad_norm=norm)

    def _masters_to_partitions(self) -> None:
        pairs = zip(self.sharded.units, self._masters, self._own_master, strict=True)
        for state, master, own in pairs:
            if own:
                state.home.write(master)

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
        """This rank's master of the trainable prefix of every unit's partition (with offload,
        on the host)."""
        return self._offload.masters() if self._offload is not None else tuple(self._masters)

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        """Masters are flat views at stage 3 (a transformed one's gradient is the finished
        update): always ``None``."""
        return None

    def shard_maps(self) -> tuple[ParamShard, ...]:
        """Where every element of every parameter's master lives, per rank."""
        infos = [self.sharded.shard_info(p) for plan in self.sharded.plans for p in plan.params]
        return tuple(info.shard for info in infos)

    def optimizer_state_bytes(self) -> int:
        """Bytes of inner-optimizer state (and full-gradient buffers) on this rank."""
        tensors = [v for s in self.inner.state.values() for v in s.values()]
        inner = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
        share = None if self._offload is None else self._offload.device_share
        moments = 0 if share is None else share.nbytes()[1]  # a partial offload's device moments
        return inner + self._transforms.nbytes() + moments

    def master_bytes(self) -> int:
        """Bytes of fp32 masters beyond the partitions (an fp32 partition is its own master)."""
        if self._offload is not None:  # on the host, but for a partial offload's device share
            share = self._offload.device_share
            return 0 if share is None else share.nbytes()[0]
        pairs = zip(self._masters, self._own_master, strict=True)
        return sum(m.numel() * m.element_size() for m, own in pairs if own)

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
            "full_grad_buffers": self._transforms.state_dict(),
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
            or shapes != [(n,) for n in self._trainable]
        ):
            raise CheckpointError(
                "this ZeRO stage-3 state was saved with another stage, world size or unit "
                "layout; load it into the same model, policy and world size"
            )
        self._transforms.load_state_dict(state_dict.get("full_grad_buffers", {}))
        self.inner.load_state_dict(state_dict["inner"])
        if self._offload is not None:
            self._offload.load_state_dict(masters, state_dict.get("offload"))
        else:
            for master, saved in zip(self._masters, masters, strict=True):
                master.copy_(saved)
            self._masters_to_partitions()
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
