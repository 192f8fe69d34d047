"""`Repartition`: replace parameters of an ``Init``-built model, then shard it anew (stage 3).

A model built under `deepshard.zero.Init` is a `ShardedModule` from the start: every parameter
is a slice on each rank, and its full values exist nowhere. A transformation that swaps
parameters (AutoEP: each MoE block's experts become this rank's ``E / ep`` stacks, partitioned
over the expert data-parallel group ``dp`` instead of the dense one) works through this object,
the ZeRO side of `deepshard.interface.PartitionedParams`, block by block:

1. `Repartition.gathered` makes one block's source parameters whole (`GatheredParameters`: the
   units owning them are held gathered; nothing is written back on exit);
2. the transformation builds the block's new parameters from them, whole, and hands them to
   `Repartition.partition`, which cuts each into this rank's slice of its group at once
   (`deepshard.zero._init_slices.InitSlices`, as ``Init`` does while a model is built);
3. the block's gathered sources are released on leaving the block.

So at most one block's sources and new parameters are whole at a time (DeepSpeed's #8424
built every layer's ZeRO-3 experts before partitioning any).

`Repartition.finish` then turns the model into a new `ShardedModule` with the placements the
transformation wrote (several reduction groups: expert and dense units, `_rgroups`): the old
one's hooks are removed, the units are planned again from the full shapes, and each new unit is
made whole just before it keeps its chunk, from the new slices (one all-gather per parameter)
or from the old unit holding the parameter (gathered, copied out, released; an old unit is
freed once nothing of the model is left in it). Parameters the model no longer has (the
replaced experts) are never made whole again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepshard.comm import ParallelDims, resolve_group
from deepshard.interface import PlacementRegistry
from deepshard.interface.errors import ConfigError
from deepshard.zero._gathered import GatheredParameters
from deepshard.zero._init_slices import InitSlices
from deepshard.zero._rgroups import reduction_groups
from deepshard.zero._shard import build_sharded
from deepshard.zero._sharded import ShardedModule
from deepshard.zero._unit_state import UnitState

__all__ = ["Repartition"]


class Repartition:
    """Swap parameters of a model built under `deepshard.zero.Init`, then re-shard it.

    Implements `deepshard.interface.PartitionedParams`. Every rank of the model's group calls
    the same methods in the same order (gathering and `finish` are collectives).

    Args:
        sharded: The model's `ShardedModule` (``sharded_module_of(model)``).
        parallel_dims: The training mesh; new expert parameters are partitioned over its
            ``expert_dp`` group, new dense ones over ``dense_dp`` (which must be the group the
            model was built over).

    Raises:
        ConfigError: The model keeps its partitions on the host or in files
            (``offload_param``), which a re-shard does not read yet.
    """

    def __init__(self, sharded: ShardedModule, *, parallel_dims: ParallelDims) -> None:
        if sharded.policy.param_offload is not None:
            raise ConfigError(
                "zero_optimization.offload_param together with expert_parallel.enabled on a "
                "model built under deepshard.zero.Init is not built yet; build the model "
                "without Init (initialize partitions it) or leave offload_param out"
            )
        self._old: ShardedModule | None = sharded
        self._dims = parallel_dims
        device = next((u.buffer.device for u in sharded.units), torch.device("cpu"))
        logger = sharded.comms_logger

        def slices(group: torch.distributed.ProcessGroup) -> InitSlices:
            return InitSlices(group, dtype=None, device=device, logger=logger)

        self._experts = slices(resolve_group(parallel_dims.expert_dp))
        self._dense = slices(resolve_group(parallel_dims.dense_dp))

    def _sharded(self) -> ShardedModule:
        if self._old is None:
            raise ConfigError("Repartition: finish() was called already; make a new one")
        return self._old

    # --- deepshard.interface.PartitionedParams ------------------------------------------

    def full_shape(self, param: torch.Tensor) -> tuple[int, ...]:
        """The full shape of ``param``: of the model, new (partitioned here) or whole."""
        for store in (self._experts, self._dense):
            if store.holds(param):
                return store.full_shapes()[id(param)]
        try:
            return self._sharded().shard_info(param).shape
        except ConfigError:  # a tensor ZeRO does not own is whole
            return tuple(param.shape)

    def gathered(self, params: Sequence[torch.Tensor]) -> GatheredParameters:
        """``GatheredParameters(params)``: whole inside, released (changes dropped) after."""
        self._sharded()
        return GatheredParameters(params)

    def partition(self, params: Sequence[torch.nn.Parameter], *, expert: bool) -> None:
        """Keep this rank's slice of each whole new parameter (over ``dp`` for experts)."""
        store = self._experts if expert else self._dense
        for param in params:
            store.partition(param)

    # --- the new ShardedModule ----------------------------------------------------------

    def finish(self, module: torch.nn.Module, placements: PlacementRegistry) -> ShardedModule:
        """Shard ``module`` (the transformed model) anew with ``placements``; one unit whole
        at a time.

        Args:
            module: The model the old `ShardedModule` was built on, after the swaps.
            placements: Every parameter's placement, with full shapes (the transformation's).

        Returns:
            The new `ShardedModule` (`deepshard.zero.sharded_module_of` finds it).
        """
        old = self._sharded()
        self._old = None
        source = _Sources(old, module, (self._experts, self._dense))
        del old  # the sources hold its units now; each goes as soon as it is read out
        dims = self._dims
        pg = resolve_group(dims.dense_dp)
        groups = reduction_groups(module, pg, dims, placements)
        policy, logger = source.policy, source.logger
        return build_sharded(module, pg, policy, placements, logger, source=source, groups=groups)


class _Sources:
    """`deepshard.zero._shard.ParamSource` over an old `ShardedModule`'s units and new slices."""

    def __init__(
        self, old: ShardedModule, module: torch.nn.Module, stores: Sequence[InitSlices]
    ) -> None:
        self.policy, self.logger = old.policy, old.comms_logger
        self._stores = stores
        live = {id(p) for p in module.parameters()}
        self._unit_of: dict[int, int] = {}
        self._shapes: dict[int, tuple[int, ...]] = {}
        for index, plan in enumerate(old.plans):
            for param in plan.params:
                if id(param) in live:
                    self._unit_of[id(param)] = index
                    self._shapes[id(param)] = old.shard_info(param).shape
        self._units: list[UnitState | None] = list(old.detach_units())
        self._left = [sum(id(p) in live for p in u.plan.params) for u in self._units if u]
        for index, left in enumerate(self._left):
            if left == 0:
                self._units[index] = None  # only replaced parameters: never read again

    def full_shapes(self) -> Mapping[int, tuple[int, ...]]:
        """Full shapes of the old model's parameters still in the model and of the new ones."""
        shapes = dict(self._shapes)
        for store in self._stores:
            shapes.update(store.full_shapes())
        return shapes

    def materialize(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Make ``params`` whole in storage of their own (a collective per unit or slice)."""
        for store in self._stores:
            store.materialize(params)
        by_unit: dict[int, list[torch.nn.Parameter]] = {}
        for param in params:
            index = self._unit_of.pop(id(param), None)
            if index is not None:
                by_unit.setdefault(index, []).append(param)
        for index, members in sorted(by_unit.items()):
            state = self._units[index]
            assert state is not None, "a unit was freed before all its parameters were read"
            state.wait_gather()
            for param in members:
                param.data = param.data.clone()  # off the unit's buffer, which is freed now
            state.release()
            self._left[index] -= len(members)
            if self._left[index] == 0:
                self._units[index] = None  # its partition goes with it
