"""`ShardedModule`: the handle of a model partitioned by `deepshard.zero.shard` (ZeRO stage 3).

Hooks, all on DeepShard's side (the model keeps its class, parameters and names):

* **forward pre/post** on every unit's module: gather (and prefetch), then release as the
  `deepshard.zero._fetcher.Fetcher` decides; the root's hooks bracket a forward pass.
* **output gradients**: the forward post-hook puts a hook on each output tensor that requires
  grad (``torch.utils._pytree`` flattening, so tuples, dicts and HF ``ModelOutput`` work); the
  first gradient to arrive re-gathers the unit for its backward and prefetches the units before
  it. The first backward hook of a pass queues an autograd end-of-pass callback.
* **post-accumulate-grad** on every trainable parameter: the gradient leaves ``param.grad``;
  when a unit has all of them it is released, and units are reduce-scattered into their
  gradient partitions in one fixed order on every rank (reverse unit order) through a
  `deepshard.zero._scheduler.BucketScheduler`, at most two in flight with ``overlap_comm``.
* **end of pass**: units whose parameters got no gradient are reduced with zeros (so every rank
  issues the same collectives), every reduction is waited for, and everything not resident is
  released.

Observers (the optimizer side) are told when a backward pass begins and ends.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.autograd import Variable

from deepshard.comm import CommsLogger
from deepshard.interface.errors import CommError, ConfigError
from deepshard.zero._fetcher import Fetcher
from deepshard.zero._gather_waits import GatherWaits
from deepshard.zero._outside_graphs import outside_graphs
from deepshard.zero._passes import dense
from deepshard.zero._policy import ZeroPolicy
from deepshard.zero._scheduler import BucketScheduler
from deepshard.zero._shard_info import ShardInfo
from deepshard.zero._unit_state import UnitState
from deepshard.zero._units import UnitPlan

__all__ = ["ParamHook", "PassObserver", "ShardedModule", "UnitHook", "register_param_hook"]

PassObserver = tuple[Callable[[], None], Callable[[], None]]
"""``(on_begin, on_end)`` of every backward pass."""


class UnitHook:
    """The forward pre-hook on a unit's module; it names the `ShardedModule` it belongs to."""

    def __init__(self, sharded: ShardedModule, index: int) -> None:
        self.sharded, self.index = sharded, index
        self.positions: list[int] = []

    @outside_graphs
    def __call__(self, module: torch.nn.Module, args: Any) -> None:
        self.sharded._pre_forward(self)

    @outside_graphs
    def post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The forward post-hook."""
        self.sharded._post_forward(self, output)


class ParamHook:
    """The post-accumulate-grad hook on every parameter a unit owns; it names the `ShardedModule`.

    Frozen parameters get one too (it never fires for them), so any owned parameter leads to
    its `ShardedModule` (`deepshard.zero._lookup`) without an attribute on the parameter.

    It holds the `ShardedModule` weakly: a parameter's hooks are not visited by Python's cycle
    collector while autograd's C++ side shares the tensor, so a strong reference here would
    pin the model forever once the caller drops it. The model keeps the `ShardedModule` alive
    through its units' forward hooks (`UnitHook`), so the reference is live while training.
    """

    def __init__(self, sharded: ShardedModule, index: int, slot_index: int) -> None:
        self._sharded = weakref.ref(sharded)
        self.index, self.slot_index = index, slot_index

    @property
    def sharded(self) -> ShardedModule | None:
        """The owner, or ``None`` once the model (and with it the owner) was freed."""
        return self._sharded()

    def __call__(self, param: torch.Tensor) -> None:
        sharded = self._sharded()
        if sharded is not None:
            sharded._on_grad(self.index, self.slot_index, param)


class ShardedModule:
    """A model whose parameters are partitioned over a data-parallel group (build with `shard`).

    Args:
        module: The model.
        plans: Its units.
        states: Their run-time state (partitions, buffers).
        infos: Every owned parameter's `ShardInfo` by ``id``.
        group: The data-parallel group (a ProcessGroup).
        policy: The knobs.
        logger: Records the collectives.
        tp_group: The tensor-parallel group when the placements shard over ``tp``.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        plans: tuple[UnitPlan, ...],
        states: list[UnitState],
        infos: dict[int, ShardInfo],
        group: torch.distributed.ProcessGroup,
        policy: ZeroPolicy,
        logger: CommsLogger | None,
        *,
        tp_group: torch.distributed.ProcessGroup | None = None,
    ) -> None:
        self.module, self.plans, self.units = module, plans, states
        self.group, self.policy, self._infos = group, policy, infos
        self.tp_group = tp_group
        """The tensor-parallel group the step combines the norm over; ``None`` without it."""
        self._logger = logger
        self._externals = [set(p.external) for p in plans]
        self.gather_waits = GatherWaits()
        """The exposed (blocking) gather time and prefetch counts, running totals."""
        self.fetcher = Fetcher(states, policy, self._externals, self.gather_waits)
        members = {p.index: len(s.trainable) for p, s in zip(plans, states, strict=True)}
        order = [p.index for p in reversed(plans)]
        inflight = 2 if policy.overlap_comm else 0
        self._scheduler = BucketScheduler(order, members, self._launch, inflight)
        self._arrived: list[set[int]] = [set() for _ in plans]
        self._observers: list[PassObserver] = []
        self._writers: list[Callable[[Sequence[int]], None]] = []
        self._in_pass = False
        self._passes = 0
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._attach()

    # --- hooks ------------------------------------------------------------------------

    def _attach(self) -> None:
        for plan in self.plans:
            hook = UnitHook(self, plan.index)
            self._hooks.append(plan.module.register_forward_pre_hook(hook))
            self._hooks.append(plan.module.register_forward_hook(hook.post))
            for slot_index, param in enumerate(plan.params):
                self._hooks.append(
                    register_param_hook(param, ParamHook(self, plan.index, slot_index))
                )

    def _pre_forward(self, hook: UnitHook) -> None:
        root = hook.index == 0
        if root:
            self.fetcher.begin_forward()
        hook.positions.append(self.fetcher.acquire(hook.index, record=not root))

    def _post_forward(self, hook: UnitHook, output: Any) -> None:
        position = hook.positions.pop()
        grad = torch.is_grad_enabled()
        if grad and hook.index != 0:
            self._hook_outputs(hook.index, position, output)
        self.fetcher.after_forward(hook.index, position, grad_enabled=grad)
        if hook.index == 0:
            self.fetcher.end_forward(grad_enabled=grad)

    def _hook_outputs(self, index: int, position: int, output: Any) -> None:
        tensors = [
            t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
        ]

        def on_grad(grad: torch.Tensor) -> None:
            self._begin_pass_once()
            self.fetcher.acquire_for_backward(index, position)

        for tensor in tensors:
            tensor.register_hook(on_grad)  # type: ignore[no-untyped-call]

    def _on_grad(self, index: int, slot_index: int, param: torch.Tensor) -> None:
        if slot_index not in self.units[index].trainable:  # unfrozen after shard(): not ours
            return
        grad, param.grad = param.grad, None
        if grad is None:
            return
        self._begin_pass_once()
        self.units[index].take_grad(slot_index, dense(grad))
        self._arrived[index].add(slot_index)
        self._scheduler.arrived(index, slot_index)
        if len(self._arrived[index]) == len(self.units[index].trainable):
            self.fetcher.grads_complete(index)

    # --- backward passes --------------------------------------------------------------

    def add_pass_observer(self, on_begin: Callable[[], None], on_end: Callable[[], None]) -> None:
        """Call ``on_begin`` when a backward pass starts and ``on_end`` once it is reduced."""
        self._observers.append((on_begin, on_end))

    @property
    def in_pass(self) -> bool:
        """Whether a backward pass is running."""
        return self._in_pass

    def _begin_pass_once(self) -> None:
        if self._in_pass:
            return
        self._begin_pass()
        Variable._execution_engine.queue_callback(self._end_pass)

    def _begin_pass(self) -> None:
        for on_begin, _ in self._observers:
            on_begin()
        self._in_pass = True
        self._passes += 1
        self._scheduler.begin(reducing=True)
        for seen in self._arrived:
            seen.clear()

    def _end_pass(self) -> None:
        self._in_pass = False
        self._scheduler.flush()
        self.fetcher.end_backward()
        missing = sum(count for _, count in self._scheduler.missing())
        if missing and not self.policy.ignore_unused_parameters:
            raise ConfigError.from_problems(
                [
                    (
                        "zero_optimization.ignore_unused_parameters",
                        f"false, but {missing} parameters got no gradient in this backward "
                        "pass; set it to true (they then count as zero) or freeze them",
                    )
                ]
            )
        for _, on_end in self._observers:
            on_end()

    def _launch(self, index: int) -> Callable[[], None]:
        return self.units[index].launch_reduce(
            self.policy.reduction,
            accum_dtype=self.policy.grad_accum_dtype,
            bucket_numel=self.policy.reduce_bucket_size,
            async_op=self.policy.overlap_comm,
        )

    def backward(self, loss: torch.Tensor, *, retain_graph: bool = False) -> None:
        """``loss.backward()``; a rank whose loss reached no unit still takes part in the
        reductions (with zeros)."""
        before = self._passes
        loss.backward(retain_graph=retain_graph)  # type: ignore[no-untyped-call]
        if self._passes == before:
            self._begin_pass()
            self._end_pass()

    # --- what the optimizer side reads and writes -------------------------------------

    def grad_partitions(self) -> list[torch.Tensor | None]:
        """Each unit's reduced gradient partition (``None`` before its first reduction)."""
        return [u.grad_partition for u in self.units]

    def clear_grads(self) -> None:
        """Drop the gradient partitions (the step consumed them)."""
        for u in self.units:
            u.grad_partition = None
            u.pending.clear()

    def add_partition_observer(self, on_written: Callable[[Sequence[int]], None]) -> None:
        """Call ``on_written(units)`` on `partitions_written` (the optimizer's masters follow)."""
        self._writers.append(on_written)

    def partitions_written(self, units: Sequence[int]) -> None:
        """``units``' partitions were written from outside a step (`GatheredParameters`)."""
        for on_written in self._writers:
            on_written(units)

    def hold(self, units: Sequence[int]) -> None:
        """Gather ``units`` and keep them gathered until as many `unhold` calls.

        Raises:
            CommError: During a backward pass.
        """
        if self._in_pass:
            raise CommError("ZeRO stage-3 parameters were gathered by hand during a backward pass")
        self.fetcher.pin(units)

    def unhold(self, units: Sequence[int]) -> None:
        """End one `hold`; a unit nobody holds or runs any more is released (resident too)."""
        self.fetcher.unpin(units)

    def release_unused(self, units: Sequence[int]) -> None:
        """Release each of ``units`` that nothing holds or runs (resident ones too)."""
        self.fetcher.release_unused(units)

    @property
    def comms_logger(self) -> CommsLogger | None:
        """Records the collectives."""
        return self._logger

    def partitions_updated(self) -> None:
        """The partitions changed (optimizer step): release everything gathered, now stale."""
        self.fetcher.release_all()

    # --- inspection -------------------------------------------------------------------

    @property
    def mixed_groups(self) -> bool:
        """Whether some unit is partitioned over a group other than `group` (expert
        parameters, `deepshard.zero._rgroups`)."""
        return any(u.group is not self.group for u in self.units)

    def shard_info(self, param: torch.Tensor) -> ShardInfo:
        """The full shape, dtype, this rank's slice and the `ShardMap` of ``param``.

        Raises:
            ConfigError: ``param`` is not a parameter of this sharded model.
        """
        info = self._infos.get(id(param))
        if info is None:
            raise ConfigError(
                "shard_info() got a tensor that is not a parameter of this sharded module; pass "
                "one of module.parameters()"
            )
        return info

    def unit_of(self, module: torch.nn.Module) -> int:
        """Index of the unit whose module is ``module`` (the root is 0).

        Raises:
            ConfigError: ``module`` is not a unit's module.
        """
        for plan in self.plans:
            if plan.module is module:
                return plan.index
        raise ConfigError(
            f"{type(module).__name__} is not a unit of this sharded module; units are "
            f"{[p.name or '<root>' for p in self.plans]}"
        )

    def is_gathered(self, module: torch.nn.Module) -> bool:
        """Whether the unit of ``module`` is gathered (or being gathered): every plan of it,
        one per reduction group (`deepshard.zero._rgroups`)."""
        first = self.units[self.unit_of(module)]
        states = [s for s in self.units if s.plan.module is module] or [first]
        return all(s.gathered or s.in_flight for s in states)

    def live_numel(self) -> int:
        """Gathered (or in-flight) elements of non-resident units right now."""
        return self.fetcher.live_numel()

    def peak_live_numel(self, *, reset: bool = False) -> int:
        """Most live elements since construction or the last reset."""
        peak = self.fetcher.peak_live
        if reset:
            self.fetcher.peak_live = self.fetcher.live_numel()
        return peak

    def partition_bytes(self) -> int:
        """Bytes of this rank's parameter partitions in device memory (none when offloaded)."""
        return sum(u.home.device_bytes for u in self.units)

    def gradient_bytes(self) -> int:
        """Bytes of this rank's gradient partitions right now."""
        grads = [g for g in self.grad_partitions() if g is not None]
        return sum(g.numel() * g.element_size() for g in grads)

    # --- user API ---------------------------------------------------------------------

    def register_external_parameter(self, module: torch.nn.Module, param: torch.Tensor) -> None:
        """Make the unit of ``module`` gather ``param``'s unit whenever it runs.

        Raises:
            ConfigError: ``module`` is not a unit, or ``param`` not a parameter of this model.
        """
        owner = self.shard_info(param).unit
        user = self.unit_of(module)
        if owner != user:
            self._externals[user].add(owner)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every parameter whole inside (reading or copying weights); released again after."""
        if self._in_pass:
            raise CommError("ShardedModule.gathered() was entered during a backward pass")
        for u in self.units:
            u.start_gather()
        for u in self.units:
            u.wait_gather()
        try:
            yield
        finally:
            self.fetcher.release_idle()

    def close(self) -> None:
        """Remove the parameter swap files (``offload_param`` nvme); no forward may follow."""
        for u in self.units:
            u.home.close()

    def detach_units(self) -> list[UnitState]:
        """Remove every hook and hand the units over, still partitioned (a re-shard reads
        them: `deepshard.zero.Repartition`); this object is unusable afterwards."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        units = list(self.units)
        self.units.clear()
        self.fetcher.units.clear()
        return units

    def remove_hooks(self) -> None:
        """Give the model its whole parameters back (own storage) and remove every hook."""
        for u in self.units:
            u.start_gather()
        for u in self.units:
            u.wait_gather()
        for plan in self.plans:
            for param in plan.params:
                param.data = param.data.clone()
        for u in self.units:
            u.buffer.untyped_storage().resize_(0)
            u.gathered = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def register_param_hook(
    param: torch.nn.Parameter, hook: Callable[[torch.Tensor], None]
) -> torch.utils.hooks.RemovableHandle:
    """``param.register_post_accumulate_grad_hook(hook)``, for a frozen parameter too."""
    frozen = not param.requires_grad
    param.requires_grad_(True)  # torch refuses hooks on frozen tensors; it never fires there
    try:
        handle: torch.utils.hooks.RemovableHandle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
    finally:
        param.requires_grad_(not frozen)
    return handle
