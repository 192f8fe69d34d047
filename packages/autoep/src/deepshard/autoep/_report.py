"""What `parallelize_experts` did, as data: replaced blocks, placements, shard maps, swaps."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from deepshard.interface import PlacementRegistry, ShardMap

__all__ = ["ParamSwap", "ReplacedBlock", "ReplacementReport"]


@dataclass(frozen=True)
class ReplacedBlock:
    """One MoE block that was replaced."""

    name: str
    """Its module name in the model (``model.layers.1.mlp``)."""

    preset: str
    """The preset that described it."""

    num_experts: int
    """``E``, its global expert count."""

    local_experts: tuple[int, int]
    """``[lo, hi)``: the global ids of the experts this rank keeps."""

    layout: str
    """``"fused"`` (3-D ``gate_up_proj``/``down_proj``) or ``"module_list"``."""

    correction_bias: str | None
    """Fully qualified name of its score-correction bias, kept in place (None: none)."""


@dataclass(frozen=True, eq=False)
class ParamSwap:
    """A new parameter built from old ones, for moving optimizer membership and state."""

    name: str
    """The new parameter's fully qualified name."""

    new: torch.nn.Parameter
    """The parameter now in the model."""

    sources: tuple[torch.nn.Parameter, ...]
    """The parameters it was built from (no longer in the model)."""

    derive: Callable[[Sequence[torch.Tensor]], torch.Tensor] = field(repr=False)
    """Builds the new tensor's counterpart from one tensor per source, in ``sources`` order
    (the same slicing/stacking that built ``new``; applied to optimizer moments too)."""


@dataclass(frozen=True, eq=False)
class ReplacementReport:
    """The result of `parallelize_experts`.

    ``placements`` holds every parameter of the replaced model (dense ones replicated and
    reduced over ``dp × ep × sp``; expert ones ``Shard(0)`` on ``ep`` and reduced over ``dp``),
    ``shard_maps`` the expert parameters' maps (a contiguous split of dim 0 over the ``ep``
    ranks) so that checkpoints reshard across expert-parallel sizes.
    """

    blocks: tuple[ReplacedBlock, ...]
    """Every replaced block, in module order."""

    placements: PlacementRegistry
    """Every parameter's placement, by fully qualified name."""

    shard_maps: Mapping[str, ShardMap]
    """The expert parameters' shard maps over the ``ep`` axis, by fully qualified name."""

    swaps: tuple[ParamSwap, ...]
    """Each new expert parameter and its sources (what `remap_optimizer` reads)."""

    @property
    def expert_parameter_names(self) -> tuple[str, ...]:
        """Fully qualified names of the expert-parallel parameters."""
        return tuple(s.name for s in self.swaps)

    @property
    def discarded(self) -> tuple[torch.nn.Parameter, ...]:
        """Every parameter the replacement removed from the model."""
        return tuple(p for s in self.swaps for p in s.sources)
