"""`ZeroOptimizer`: ZeRO stages 0, 1 and 2 around any element-wise torch optimizer.

What happens to a model under data parallelism over a group of ``W`` ranks:

1. **Construction.** The model side (`deepshard.zero.shard` at stage 0-2, or built from the
   param groups by the params-only form, one unit per group; `deepshard.zero._resident`) holds
   each unit's trainable parameters in one flat, 16-byte aligned buffer cut into buckets of
   ``reduce_bucket_size`` elements (at most 4M on CPU). This rank's fp32 *master* of a unit is
   its partition (stages 1-2: its chunk of every bucket; stage 0: everything, and for an fp32
   model the buffer itself). The inner optimizer's param groups are re-pointed at master views
   of at most 1 MiB (`deepshard.zero._master_views`), so its state is partitioned too, while
   hyper-parameters (``lr``...) stay in ``param_groups`` for LR schedulers; param groups never
   decide how gradients are communicated.
2. **Backward.** A post-accumulate-grad hook hands each gradient to a gradient store
   (`deepshard.zero._gradients`) and frees ``param.grad``. Stage 0 all-reduces and stage 1
   reduce-scatters the buckets during the backward pass that ends a gradient-accumulation cycle
   (earlier passes only accumulate locally); stage 2 reduce-scatters at every pass and keeps only
   this rank's gradient partition. Collectives start as buckets fill and are waited for when
   the pass ends (an autograd end-of-pass callback).
3. **Step** (at the boundary). The global gradient norm and the overflow check take one
   all-reduce (none at stage 0, whose gradients are already identical everywhere). On overflow
   the step is skipped: masters, inner state and parameters stay untouched. Otherwise the
   gradients are unscaled and clipped by one factor, the inner optimizer steps the masters,
   and the updated masters come back into the model: copied at stage 0 (nothing to copy when
   the buffer is its own master), all-gathered in ``allgather_bucket_size`` calls at stages 1-2.

A *full-gradient transform* (Muon's Newton–Schulz) sees the whole reduced gradient of every
parameter of the param groups it is given, at the step, before the norm; its update replaces
the gradient (`deepshard.zero._full_grads`). Those groups are a full-gradient path of their own
(`deepshard.interface.FullGradientPath`, `deepshard.zero._full_grad_path`) with its own gradient
store; the ordinary store never sees them. `full_shape` tells the inner optimizer the real shape
of what it steps (`deepshard.interface.ParamShapes`).

Loss scaling, accumulation and the forward pass are the caller's (the engine): it marks the pass
ending a cycle (`set_boundary`, ``backward(is_boundary=)``) and passes the scale to `step`.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import torch

from deepshard.comm import CommsLogger, Group, resolve_group
from deepshard.interface import PlacementRegistry
from deepshard.interface.config import AioConfig, ZeroConfig
from deepshard.interface.errors import CommError, ConfigError
from deepshard.zero._full_grad_path import FullGroupsPath, StoreChoice
from deepshard.zero._full_grad_store import split_store
from deepshard.zero._full_grads import FullGradTransform
from deepshard.zero._gradients import StoreSettings
from deepshard.zero._master_dtype import check_param_dtypes, master_dtype_problems
from deepshard.zero._master_views import plan_master_views
from deepshard.zero._offload import build_offload, offload_problems
from deepshard.zero._optimizer_check import master_view_numel, optimizer_problems
from deepshard.zero._optimizer_reads import ZeroReads
from deepshard.zero._owner import ZeroPartitionAccess
from deepshard.zero._pass_control import PassControl
from deepshard.zero._passes import BackwardPasses
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._resident import (
    ResidentModule,
    model_side_problems,
    resident_from_param_groups,
    sharded_section,
)
from deepshard.zero._resident_groups import norm_inputs, refresh_units, unit_shards
from deepshard.zero._rgroups import mixed_group_problems
from deepshard.zero._settings import uses_reduce_scatter, zero_problems
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._shards import ParamShard
from deepshard.zero._state_dict import load_partitioned_state, partitioned_state
from deepshard.zero._state_shards import StateShardAccess
from deepshard.zero._states import StateOffload
from deepshard.zero._step import NormSettings, StepResult, checked_norm, step_inner
from deepshard.zero._tp import resident_tp_grads, tp_problems
from deepshard.zero.layout import plan_gather_calls
from deepshard.zero.norms import check_norm_type, scale_factor
from deepshard.zero.reduction import GradientReduction

__all__ = ["ParamShard", "StepResult", "ZeroOptimizer"]


class ZeroOptimizer(
    PassControl,
    StateShardAccess,
    StateOffload,
    ZeroPartitionAccess,
    ZeroReads,
    torch.optim.Optimizer,
):
    """Wraps ``optimizer`` so its state, master weights and (stage 2) gradients are partitioned.

    Args:
        optimizer: The inner optimizer, built on the model's parameters and not yet stepped. It
            must be element-wise (see `deepshard.zero.is_zero_safe`) unless
            ``zero_allow_untested_optimizer``.
        sharded: The model side at stages 0-2 (`deepshard.zero.shard` with a ``ZeroPolicy`` of
            that stage); its policy holds the group, bucket sizes and gradient settings, its
            stage must be ``config``'s. ``None``: the params-only form, which needs ``group``.
        group: Without ``sharded``: the data-parallel group (a ProcessGroup or a 1-D mesh such
            as ``mesh["dp"]``).
        config: The ``zero_optimization`` section. Read: ``stage`` (0-2), ``reduce_bucket_size``
            and ``allgather_bucket_size`` (at most 4M elements for CPU parameters, see
            `deepshard.zero._settings`), ``overlap_comm`` (stage 2; stages 0-1 always overlap),
            ``reduce_scatter``, ``compute_grad_norm``, ``ignore_unused_parameters``. Gradients are
            always contiguous and parameters always 16-byte aligned (``contiguous_gradients``,
            ``parameter_alignment``); ``offload_optimizer`` and ``sub_group_size`` run the step
            on the host (`deepshard.zero._offload`); stage-3 keys are refused or unused.
        gradient_clipping: Clip the global gradient norm to this; 0 disables.
        norm_type: Order of the norm used for clipping and reported (``math.inf`` allowed).
        reduction: Without ``sharded``: ``gradient_allreduce_op``, ``prescale_gradients``,
            ``gradient_predivide_factor`` and ``communication_data_type``.
        grad_accum_dtype: Without ``sharded``: dtype gradients are accumulated in; ``None``
            uses the model dtype.
        zero_allow_untested_optimizer: Accept an optimizer not known to be element-wise.
        comms_logger: Records every collective ZeRO issues.
        named_parameters: Without ``sharded``: ``model.named_parameters()``: names for
            `shard_maps`, and the registration order, which sets the order buckets are reduced
            in (reverse buffer order without it).
        placements: Without ``sharded`` (``shard`` takes them otherwise): every parameter's
            placement by name (its global shape and reduction axes;
            `deepshard.zero._placements`), which `shard_maps` are derived from; ``group`` must
            be the parameters' reduction group. None: every parameter whole on every rank of
            ``group``, described as a one-axis ``dp`` mesh.
        full_grad_transform: ``(grad, buffer, param_group) -> update``, applied at each step to
            the full reduced gradient of every parameter in ``transformed_params`` (see
            `deepshard.zero._full_grads`; e.g. Muon's `muon_update` with the momentum as the
            buffer). Passing one declares that the inner optimizer is element-wise once those
            gradients hold finished updates, so the element-wise check is skipped.
        transformed_params: The parameters whose gradients the transform replaces; they must
            make up whole param groups of ``optimizer`` (such as Muon's ``use_muon`` groups).
        aio: The ``aio`` section (NVMe offload).
        zero_force_ds_cpu_optimizer: With offload, refuse an optimizer stepped as itself on the
            host (not Adam/AdamW, not DeepShard's).
        master_dtype: Dtype of the masters and of the reduced gradients the inner optimizer
            steps them with: fp32, or 16 bits (``bf16_master_weights_and_grads`` /
            ``fp16_master_weights_and_grads``: stages 1-3, a model in that dtype; on the device
            the optimizer's states follow, with offload `state_dtype` decides; see
            `deepshard.zero._master_dtype`).
        state_dtype: With optimizer offload, the dtype of the moments the CPU Adam kernel keeps
            (``bf16_optimizer_states``); None: fp32 unless the optimizer says
            ``fp32_optimizer_states=False``. On the device the inner optimizer allocates its own.

    Raises:
        ConfigError: Unsupported settings, an unsuitable optimizer, param groups mixing dtypes,
            ``transformed_params`` without a transform or not forming whole param groups, a
            stage other than the sharded module's, or neither ``sharded`` nor ``group``.
        TopologyError: A parameter's placement is missing or does not fit it, or ``group`` is
            not the parameters' reduction group.
        CommError: ``group`` is a mesh with more than one axis, or not a group.
    """

    _full: FullGroupsPath

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> ZeroOptimizer:
        """``ZeroOptimizer(inner, sharded_module)`` with a stage-3 `ShardedModule` is a
        `Stage3Optimizer`; with a `ResidentModule` (stages 0-2) or ``group=`` it is this class."""
        if cls is ZeroOptimizer and args and isinstance(args[0], ShardedModule):
            from deepshard.zero._stage3_optimizer import Stage3Optimizer  # it subclasses this

            return super().__new__(Stage3Optimizer)
        return super().__new__(cls)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        sharded: ResidentModule | None = None,
        *,
        group: Group | None = None,
        config: ZeroConfig | None = None,
        gradient_clipping: float = 1.0,
        norm_type: float = 2.0,
        reduction: GradientReduction | None = None,
        grad_accum_dtype: torch.dtype | None = None,
        zero_allow_untested_optimizer: bool = False,
        comms_logger: CommsLogger | None = None,
        named_parameters: Iterable[tuple[str, torch.Tensor]] = (),
        placements: PlacementRegistry | None = None,
        full_grad_transform: FullGradTransform | None = None,
        transformed_params: Iterable[torch.Tensor] = (),
        aio: AioConfig | None = None,
        zero_force_ds_cpu_optimizer: bool = True,
        master_dtype: torch.dtype = torch.float32,
        state_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = sharded_section(config, sharded)
        transformed = full_grad_transform is not None
        allow_untested = zero_allow_untested_optimizer or transformed
        # Every refusal at once, before anything is built.
        problems = zero_problems(self.config, gradient_clipping=gradient_clipping, sharded=False)
        problems += optimizer_problems(optimizer, allow_untested=allow_untested)
        problems += offload_problems(
            self.config, optimizer, zero_force_ds_cpu_optimizer, transformed
        )
        given: dict[str, object] = {"group": group, "reduction": reduction}
        given |= {"grad_accum_dtype": grad_accum_dtype}
        given |= {"placements": placements, "comms_logger": comms_logger}
        problems += model_side_problems(self.config, sharded, given)
        problems += tp_problems(sharded, transformed=transformed)
        problems += master_dtype_problems(self.config, master_dtype, transformed=transformed)
        if sharded is not None and sharded.mixed_groups:
            problems += mixed_group_problems(self.config, transformed=transformed)
        if problems:
            raise ConfigError.from_problems(problems)
        if sharded is None:  # the params-only form; resolve_group refuses a missing group
            policy = ZeroPolicy.from_config(
                self.config, reduction=reduction, grad_accum_dtype=grad_accum_dtype
            )
            sharded = resident_from_param_groups(
                optimizer.param_groups,
                resolve_group(group),
                policy,
                comms_logger,
                named_parameters,
                placements,
            )
        self._master_dtype, self._state_dtype = master_dtype, state_dtype
        self._build(optimizer, sharded, gradient_clipping, norm_type, aio)
        self._full_path(optimizer, full_grad_transform, transformed_params)

    def _build(
        self,
        optimizer: torch.optim.Optimizer,
        resident: ResidentModule,
        gradient_clipping: float,
        norm_type: float,
        aio: AioConfig | None,
    ) -> None:
        """Masters over the resident units' layouts, shard maps, gradient settings."""
        self.inner, self.gradient_clipping = optimizer, gradient_clipping
        self.norm_type = check_norm_type(norm_type)
        self._resident, self._policy = resident, resident.policy
        self._group, self._logger = resident.group, resident.comms_logger
        self._partitions, self._partition_rank = resident.partition_count, resident.partition_rank
        self._params, self._flat = resident.params, [u.flat for u in resident.units]
        self._device, self._unit_ranks = resident.device, resident.partition_ranks
        check_param_dtypes(self._master_dtype, [flat.buffer.dtype for flat in self._flat])
        ranks = zip(self._flat, self._unit_ranks, strict=True)
        self._masters = [flat.master_partition(r, self._master_dtype) for flat, r in ranks]
        self._gather_calls = [
            plan_gather_calls(f.layout, max_numel=resident.gather_numel) for f in self._flat
        ]
        self._shards = unit_shards(resident)
        self._tp = resident_tp_grads(resident, self._shards)
        self._settings = StoreSettings(
            self._device,
            self._group,
            self._policy.reduction,
            use_reduce_scatter=uses_reduce_scatter(self.config.reduce_scatter, self._device),
            accum_dtype=self._policy.grad_accum_dtype,
            master_dtype=self._master_dtype,
            logger=self._logger,
            param_positions=resident.param_positions,
            layout_groups=tuple(u.group for u in resident.units) if resident.mixed_groups else None,
        )
        self._aio = aio

    def _full_path(
        self,
        optimizer: torch.optim.Optimizer,
        full_grad_transform: FullGradTransform | None,
        transformed_params: Iterable[torch.Tensor],
    ) -> None:
        """Map the param groups onto master views, then offload, stores and hooks."""
        ranges = [
            (v.unit, v.lo, v.hi, v.group)
            for v in plan_master_views(
                self._params, self.layouts, self._unit_ranks, optimizer.param_groups, (), None
            )
        ]
        dtypes = tuple(flat.buffer.dtype for flat in self._flat)
        overlap = self._policy.overlap_comm
        self._full = FullGroupsPath.build(
            full_grad_transform,
            list(transformed_params),
            params=self._params,
            layouts=self.layouts,
            names=self._resident.names,
            masters=self._masters,
            rank=self._partition_rank,
            param_groups=optimizer.param_groups,
            store=StoreChoice(self._settings, dtypes, self.config.stage, overlap),
            view_numel=master_view_numel(optimizer, transformed=full_grad_transform is not None),
        )
        self._offload = build_offload(
            self.config, optimizer, self._masters, self._flat, self._aio, ranges,
            master_dtype=self._master_dtype, state_dtype=self._state_dtype,
        )  # fmt: skip
        if self._offload is not None:  # host masters: the device keeps a compute-dtype copy
            self._masters, self._full.views = self._offload.device_partitions, self._offload.views
        self._store = split_store(
            self._settings,
            self._full.store,
            self._full.flags,
            self.layouts,
            dtypes,
            stage=self.config.stage,
            overlap=self._policy.overlap_comm,
        )
        self._passes = BackwardPasses(
            self._store, ignore_unused_parameters=self._policy.ignore_unused_parameters
        )
        self._hooks = self._passes.attach(self._params, self.layouts)
        self._offloaded = {}  # the `offload_states` bookkeeping (deepshard.zero._states)
        self._passes.guard = self.check_resident

    # --- step ---------------------------------------------------------------------------

    def step(  # type: ignore[override]
        self, closure: None = None, *, loss_scale: float = 1.0
    ) -> StepResult:
        """Unscale, check, clip and apply the reduced gradients, then refresh the parameters.

        Args:
            closure: Not supported (must be ``None``).
            loss_scale: The factor the loss was multiplied by before backward.

        Returns:
            Whether the step was skipped for overflow, and the gradient norm.

        Raises:
            CommError: No boundary backward pass happened since the last step.
            ConfigError: A closure, or a non-positive loss scale.
        """
        if closure is not None or not loss_scale > 0:
            raise ConfigError("ZeroOptimizer.step takes no closure and a loss_scale > 0")
        self.check_resident("step()")
        if not self._passes.ready:
            raise CommError(
                "step() needs gradients reduced at an accumulation boundary: run a backward "
                "pass with is_boundary=True (outside no_sync()) since the last step"
            )
        norm, overflow = self._apply_gradients(loss_scale)
        # the gradients are spent: the store marks them stale (the next pass overwrites them)
        self._store.clear()
        self._passes.consume()
        if not overflow:
            self._refresh_params()
        self._last_overflow = overflow
        return StepResult(overflow=overflow, grad_norm=norm)

    @property
    def overflow(self) -> bool:
        """Whether the last `step` was skipped because the gradients were not finite
        (DeepSpeed's ``optimizer.overflow``, which accelerate-style code reads)."""
        return bool(self.__dict__.get("_last_overflow", False))

    def _apply_gradients(self, loss_scale: float) -> tuple[float | None, bool]:
        """Check, clip and step the masters with this rank's gradients; ``(norm, overflow)``."""
        grads = self._store.partition_grads()
        counted, group = norm_inputs(self._resident, grads)
        settings = (self.config.compute_grad_norm, self.norm_type, group, self._device)
        norm_settings = NormSettings(*settings, self._logger, self._tp)
        transform = None
        if self._full.active:
            args = (grads, loss_scale, self.inner.param_groups)
            transform = functools.partial(self._full.apply, *args)
        norm, overflow = checked_norm(counted, loss_scale, norm_settings, transform)
        if not overflow:
            factor = scale_factor(norm, clip=self.gradient_clipping, loss_scale=loss_scale)
            if self._offload is not None:
                self._offload.step(self.inner, grads, factor)
            else:
                step_inner(self.inner, self._full.views, grads, factor)
        return norm, overflow

    def _refresh_params(self) -> None:
        refresh_units(self._resident, self._masters, self._gather_calls, self._logger)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop accumulated gradients (``step`` already does after every step).

        Args:
            set_to_none: Accepted for compatibility; ZeRO always releases ``param.grad``.
        """
        if self._passes.in_pass:
            raise CommError("zero_grad() was called inside a backward pass")
        self.check_resident("zero_grad()")
        self._store.clear()
        self._passes.consume()
        for params in self._params:
            for param in params:
                param.grad = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused: ZeRO lays out every group's buffers at construction."""
        raise ConfigError(
            "ZeroOptimizer cannot take new param groups; add them to the inner optimizer "
            "before wrapping it"
        )

    # --- what the engine, schedulers and checkpoints read -------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's masters, inner-optimizer state and transform buffers (same layout to
        reload)."""
        self.check_resident("state_dict()")
        return partitioned_state(self, self._full, self._offload)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict` from a run with the same layout; refreshes the parameters.

        Every rank of the group must call it (stages 1-2 all-gather the parameters).

        Raises:
            CheckpointError: The state was saved with another stage, world or layout.
        """
        self.check_resident("load_state_dict()")
        load_partitioned_state(self, self._full, self._offload, state_dict)
        self._refresh_params()

    def close(self) -> None:
        """Release the offloaded state (NVMe swap files are removed); no step may follow."""
        if self._offload is not None:
            self._offload.close()

    def remove_hooks(self) -> None:
        """Detach ZeRO from the model's parameters (gradients then stay in ``param.grad``)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
