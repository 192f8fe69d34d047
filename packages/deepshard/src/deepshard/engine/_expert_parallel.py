"""What `initialize` does with ``expert_parallel.enabled``: AutoEP before the cast.

The expert-parallel degree is ``expert_parallel.autoep_size``; it is the ``ep`` axis of the mesh
(`DeepShardConfig.topology` lays it out), so a caller's mesh must have the same ``ep`` size.
`deepshard.autoep.parallelize_experts` replaces every MoE block (each rank keeps ``E / ep``
experts) and writes every parameter's placement: expert weights reduced over ``dp``, dense ones
over ``dp × ep × sp``. ZeRO partitions each kind over its own group from those placements, so
an ``initialize(placements=)`` registry would describe the unreplaced model and is refused.

The replacement swaps parameter objects, so whatever was built on the old ones is moved onto
the new ones before ZeRO sees it (DeepSpeed's #8377 trained the discarded experts instead): a
user-built optimizer through `deepshard.autoep.remap_optimizer`, and ``model_parameters``
(tensors or param groups) by `remap_parameters`, each new expert tensor in the group its
sources were in.

With ``ep = sp = 1`` the experts' group ``dp`` is the dense group, so every parameter is
described as whole and reduced over it (one reduction group for ZeRO).

A model built under `deepshard.zero.Init` (stage 3, checked by `_init_built`) holds only
slices: AutoEP reads it through a `deepshard.zero.Repartition`, which makes one MoE block's
experts whole at a time and partitions the block's new stacks over ``dp`` before the next
block is read; the model is then sharded anew with AutoEP's placements (expert and dense
units), so ZeRO takes that `ShardedModule` as it takes any Init-built one.

**With AutoTP on the same mesh** (``tensor_parallel.autotp_size > 1``, mesh ``dp × ep × tp``)
AutoEP runs first, so AutoTP plans only what is left: attention, dense MLPs and the LM head are
split over ``tp``, while the expert stacks (no longer Linears) and the router stay whole. Each
``tp`` rank of an ``ep`` group therefore holds the same local experts and, since AutoTP's
row-parallel outputs are all-reduced, feeds the EP layer the same full hidden states: the
experts' dispatch runs once per ``tp`` rank over that rank's ``ep`` group, and every ``tp`` rank
computes the same expert and router gradients, so they need no ``tp`` reduction (their
placements say ``Replicate`` on ``tp``, which also makes the gradient norm count them once).
The registry ZeRO gets is AutoTP's (dense parameters, split or whole, reduced over
``dp × ep × sp``) with AutoEP's expert placements (``Shard(0)`` on ``ep``, reduced over ``dp``)
in place of the experts' (`with_expert_placements`).

**Expert tensor parallelism** (``expert_tensor_parallel_size`` = ``autotp_size``): each local
expert is split over ``tp`` instead (`deepshard.autoep._replace`), its outputs summed over
``tp`` before the combine; the stacks' placements then say ``Shard`` on ``tp`` too, so ZeRO
sums their norm over ``tp`` and the checkpoint's maps span ``dp × ep × tp``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from deepshard.comm import ParallelDims
from deepshard.interface import PlacementRegistry, Replicate, Topology
from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.zero import Repartition, sharded_module_of

if TYPE_CHECKING:
    from deepshard.autoep import ReplacementReport

__all__ = [
    "ExpertParallelResult",
    "apply_expert_parallel",
    "check_ep_layout",
    "remap_parameters",
    "with_expert_placements",
]

_KEY = "expert_parallel.autoep_size"


def check_ep_layout(
    config: DeepShardConfig, *, dims: ParallelDims, placements: PlacementRegistry | None
) -> None:
    """Refuse an AutoEP setting that the mesh or the other arguments contradict.

    Args:
        config: The validated config.
        dims: The training mesh.
        placements: ``initialize(placements=)``.

    Raises:
        ConfigError: ``autoep_size`` differs from the mesh's ``ep``, the expert tensor
            parallel size from its ``tp``, or a placement registry was passed.
    """
    section = config.expert_parallel
    if not section.enabled:
        return
    if section.autoep_size != dims.topology.ep:
        raise ConfigError(
            f"{_KEY}: {section.autoep_size} differs from the mesh's ep axis of size "
            f"{dims.topology.ep}; build the mesh with Topology(ep={section.autoep_size}, ...) "
            "or pass no mesh (initialize lays the config's ep out)"
        )
    etp = section.expert_tensor_parallel_size
    if etp > 1 and etp != dims.topology.tp:
        raise ConfigError(
            f"expert_parallel.expert_tensor_parallel_size: {etp} differs from the mesh's tp "
            f"axis of size {dims.topology.tp}; experts are split over the ranks AutoTP splits "
            f"the dense layers over, so set tensor_parallel.autotp_size to {etp}, or set this "
            "to 1 (every tp rank keeps its ep group's experts whole)"
        )
    if placements is not None:
        raise ConfigError(
            "initialize(placements=) together with expert_parallel.enabled: AutoEP writes the "
            "placements of the model it replaces; drop the argument"
        )


def remap_parameters(params: Iterable[Any], report: ReplacementReport) -> list[Any]:
    """``model_parameters`` (tensors or param-group dicts) moved onto the replaced experts.

    Each swap's sources are dropped; the new parameter takes the place of the first of them,
    in that source's group. A swap none of whose sources is listed adds nothing.

    Args:
        params: What the caller gave as ``model_parameters``, read once.
        report: The `deepshard.autoep.ReplacementReport`.

    Raises:
        ConfigError: One swap's sources are in different param groups.
    """
    items = list(params)
    grouped = [isinstance(item, dict) for item in items]
    groups: list[list[Any]] = (
        [list(item["params"]) for item in items] if all(grouped) and items else [items]
    )
    for swap in report.swaps:
        ids = {id(p) for p in swap.sources}
        holders = [i for i, g in enumerate(groups) if any(id(p) in ids for p in g)]
        if len(holders) > 1:
            raise ConfigError(
                f"model_parameters: the tensors {swap.name} is built from are in param groups "
                f"{holders}; put all experts of one block in one group"
            )
        for i in holders:
            first = next(j for j, p in enumerate(groups[i]) if id(p) in ids)
            kept = [p for j, p in enumerate(groups[i]) if j == first or id(p) not in ids]
            groups[i] = [swap.new if id(p) in ids else p for p in kept]
    if all(grouped) and items:
        return [{**item, "params": g} for item, g in zip(items, groups, strict=True)]
    return groups[0]


class ExpertParallelResult(NamedTuple):
    """What `apply_expert_parallel` gives `initialize`."""

    placements: PlacementRegistry | None
    """Every parameter's placement after the replacement; ``None`` when AutoEP is off."""

    model_parameters: Iterable[Any] | None
    """``initialize(model_parameters=)`` moved onto the new expert tensors."""

    expert_names: tuple[str, ...]
    """The parameters whose placement is AutoEP's own (the expert stacks; none at ep = sp = 1)."""


def apply_expert_parallel(
    model: torch.nn.Module,
    config: DeepShardConfig,
    *,
    dims: ParallelDims,
    optimizer: Any,
    model_parameters: Iterable[Any] | None,
) -> ExpertParallelResult:
    """Replace ``model``'s MoE blocks over the mesh's ``ep`` axis, before AutoTP and the cast.

    Nothing is done (no placements, ``model_parameters`` as given) when ``expert_parallel`` is
    not enabled.

    Args:
        model: The model `initialize` trains.
        config: The validated config (its ``expert_parallel`` section).
        dims: The training mesh (checked by `check_ep_layout`).
        optimizer: ``initialize(optimizer=)``; a built optimizer is remapped in place.
        model_parameters: ``initialize(model_parameters=)``, remapped (`remap_parameters`).

    Returns:
        The placements (for `deepshard.zero.shard`, or `with_expert_placements` under
        AutoTP; ``None`` for a model built under ``Init``, which is sharded anew here), the
        remapped ``model_parameters`` and the expert parameters' names.

    Raises:
        ConfigError: ``autoep_size`` does not divide a block's expert count, no MoE block was
            found, or the optimizer's / ``model_parameters``' groups split one block's experts.
    """
    section = config.expert_parallel
    if not section.enabled:
        return ExpertParallelResult(None, model_parameters, ())
    from deepshard.autoep import parallelize_experts, remap_optimizer

    built = sharded_module_of(model)
    if built is not None and dims.topology.tp > 1:
        raise ConfigError(
            "expert_parallel.enabled with tensor_parallel.autotp_size > 1 on a model built under "
            "deepshard.zero.Init: AutoTP splits whole weights, not Init's slices; build the model "
            "without Init (initialize partitions it)"
        )
    partitioned = Repartition(built, parallel_dims=dims) if built is not None else None
    del built  # the re-shard frees the old units one by one: hold no reference to them
    report = parallelize_experts(model, dims, section, partitioned=partitioned)
    if isinstance(optimizer, torch.optim.Optimizer):
        remap_optimizer(optimizer, report)
    if model_parameters is not None:
        model_parameters = remap_parameters(model_parameters, report)
    topology = dims.topology
    if topology.ep * topology.sp == 1:
        # The expert group (dp) is then the dense group itself: one group for ZeRO, and every
        # expert whole on the rank (an EP = 1 run, e.g. loading an EP = 2 checkpoint).
        shape_of = partitioned.full_shape if partitioned is not None else lambda p: tuple(p.shape)
        named = [(n, _Shaped(shape_of(p), p.dtype)) for n, p in model.named_parameters()]
        whole = PlacementRegistry.replicated(named, topology)
        if partitioned is not None:
            partitioned.finish(model, whole)
            return ExpertParallelResult(None, model_parameters, ())
        if section.expert_tensor_parallel_size == 1:
            return ExpertParallelResult(whole, model_parameters, ())
        # expert TP: the stacks stay split over tp, reduced over the dense group like the rest
        for swap in report.swaps:
            split = report.placements[swap.name].with_axis("ep", Replicate())
            whole.set(swap.name, replace(split, reduce_over=Topology.dense_dp_axes))
        names = tuple(swap.name for swap in report.swaps)
        return ExpertParallelResult(whole, model_parameters, names)
    names = tuple(swap.name for swap in report.swaps)
    if partitioned is not None:
        partitioned.finish(model, report.placements)
        return ExpertParallelResult(None, model_parameters, names)
    return ExpertParallelResult(report.placements, model_parameters, names)


class _Shaped:
    """A parameter's full shape and dtype, as `PlacementRegistry.replicated` reads them."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.shape, self.dtype = shape, dtype


def with_expert_placements(
    tp_placements: PlacementRegistry | None, ep: ExpertParallelResult
) -> PlacementRegistry | None:
    """One registry for a model AutoEP and then AutoTP parallelized.

    AutoTP described every parameter it saw (the experts as whole dense tensors, which they are
    not); the expert parameters take AutoEP's placements instead, everything else keeps
    AutoTP's. Without AutoTP this is AutoEP's registry, without AutoEP AutoTP's.
    """
    if tp_placements is None or ep.placements is None:
        return tp_placements if ep.placements is None else ep.placements
    merged = PlacementRegistry(tp_placements.topology)
    experts = set(ep.expert_names)
    for name, placement in tp_placements.items():
        merged.set(name, ep.placements[name] if name in experts else placement)
    return merged
