"""``initialize(placements=...)``: the model's placement registry, checked against the model.

A parallelised model (AutoTP, AutoEP) comes with a `deepshard.interface.PlacementRegistry`
saying, per parameter, how the mesh shards it and which group reduces it (expert weights over
``dp`` only). ``initialize`` hands it to ``deepshard.zero.shard`` at every stage, so ZeRO lays
expert and dense parameters out per group. Without one the engine describes every parameter as
whole on every rank, reduced over the dense data-parallel axes.

The registry must describe this model on this mesh: one built for another topology, a name that
is not one of the model's parameters, or a trainable parameter without a placement is a
`ConfigError` naming ``initialize(placements=)`` and the parameter, raised before ZeRO touches
the model.
"""

from __future__ import annotations

import torch

from deepshard.interface import PlacementRegistry, Topology
from deepshard.interface.errors import ConfigError

__all__ = ["engine_placements"]

_ARG = "initialize(placements=)"


def engine_placements(
    placements: PlacementRegistry | None, module: torch.nn.Module, topology: Topology
) -> PlacementRegistry:
    """The registry ZeRO shards ``module`` with: ``placements`` checked, else the default.

    Args:
        placements: The caller's registry, or ``None`` (every parameter whole on every rank).
        module: The model as it will be sharded (cast, parallelised).
        topology: The training mesh's axis sizes.

    Raises:
        ConfigError: ``placements`` is not a registry, was built for another topology, names
            a parameter the model does not have, or lacks a trainable parameter.
    """
    named = list(module.named_parameters())
    if placements is None:
        return PlacementRegistry.replicated(named, topology)
    if not isinstance(placements, PlacementRegistry):
        raise ConfigError(
            f"{_ARG}: expected a deepshard.interface.PlacementRegistry, got "
            f"{type(placements).__name__}; build one with PlacementRegistry.replicated(...)"
        )
    if placements.topology != topology:
        raise ConfigError(
            f"{_ARG}: the registry was built for topology {_sizes(placements.topology)} but "
            f"the training mesh is {_sizes(topology)}; build the registry from the same "
            "topology as the mesh (the config's parallel sizes)"
        )
    names = {name for name, _ in named}
    unknown = sorted(name for name in placements if name not in names)
    if unknown:
        raise ConfigError(
            f"{_ARG}: {unknown[0]!r} is not a parameter of the model"
            f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}; key the registry "
            "by the names of model.named_parameters() of the model passed to initialize"
        )
    missing = [name for name, p in named if p.requires_grad and name not in placements]
    if missing:
        raise ConfigError(
            f"{_ARG}: parameter {missing[0]!r} has no placement"
            f"{f' (nor {len(missing) - 1} more)' if len(missing) > 1 else ''}; set one for "
            "every trainable parameter (ParamPlacement.replicated for a whole one)"
        )
    return placements


def _sizes(topology: Topology) -> dict[str, int]:
    return dict(zip(topology.axis_names, topology.shape, strict=True))
