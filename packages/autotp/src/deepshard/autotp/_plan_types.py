"""The data an AutoTP plan is made of: one `LayerPlan` per module that tensor parallelism
touches, gathered in a `TPPlan`.

A plan is pure data (frozen dataclasses, no tensors, no modules), so choosing it
(`deepshard.autotp._plan`) and applying it (`deepshard.autotp._layers`, ``parallelize``) are
separate steps, each tested on its own: the plan is what ``describe_plan`` prints and what the
tests assert on.

How a weight is cut: the split dimension of the weight (dim 0 for a column-parallel Linear's
``[out, in]`` weight and for a vocab-parallel embedding's ``[vocab, hidden]`` weight, dim 1 for
a row-parallel Linear) is made of one or more consecutive *sub-parameters* (one for a plain
projection; gate and up for a fused ``gate_up_proj``; q, k and v for a fused QKV). Each
sub-parameter is split on its own, rank ``r`` getting ``sizes[s][r]`` rows of sub-parameter
``s``; rank ``r``'s shard is the concatenation, in sub-parameter order, of its piece of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["LayerPlan", "Style", "TPPlan"]


class Style(str, Enum):
    """How one module is tensor-parallelised."""

    COLUMN = "column"
    """Output features split: weight (and bias) rows; the input gradient is all-reduced."""

    ROW = "row"
    """Input features split: weight columns; the output is all-reduced, the bias added once."""

    VOCAB = "vocab"
    """An embedding split along its vocabulary (dim 0 of the weight)."""

    REPLICATE = "replicate"
    """Left whole on every rank, gradients untouched (what ``skip`` specs and routers get)."""

    REPLICATE_GRAD_ALLREDUCE = "replicate_grad_allreduce"
    """Whole on every rank, gradient all-reduced over TP (norms applied to sharded heads)."""


@dataclass(frozen=True)
class LayerPlan:
    """What tensor parallelism does to one module."""

    module: str
    """The module's fully qualified name in the model (``"model.layers.0.self_attn.q_proj"``)."""

    style: Style
    """How it is split."""

    sizes: tuple[tuple[int, ...], ...] = ()
    """Per sub-parameter, the rows (along the split dimension) each TP rank holds; each inner
    tuple has one entry per rank and sums to the sub-parameter's size. Empty for the two
    replicated styles."""

    gather_output: bool = False
    """COLUMN only: all-gather the output back to full width (uneven shards allowed)."""

    source: str = ""
    """Where the decision came from: ``"partition_config.layer_specs[2]"``, ``"preset:llama"``,
    ``"tp_plan"``, ``"heuristic"``; printed by ``describe_plan``."""

    def local_size(self, rank: int) -> int:
        """Rows of the split dimension that TP rank ``rank`` holds (all sub-parameters)."""
        return sum(per_rank[rank] for per_rank in self.sizes)

    def offsets(self, rank: int) -> tuple[tuple[int, int], ...]:
        """For TP rank ``rank``, each sub-parameter's ``(start, length)`` in the full split
        dimension, in order: the slices whose concatenation is the rank's shard."""
        ranges, base = [], 0
        for per_rank in self.sizes:
            ranges.append((base + sum(per_rank[:rank]), per_rank[rank]))
            base += sum(per_rank)
        return tuple(ranges)


@dataclass(frozen=True)
class TPPlan:
    """A model's whole AutoTP plan: every module it touches, for one TP size."""

    tp_size: int
    """The number of ranks in the tensor-parallel group."""

    layers: tuple[LayerPlan, ...]
    """One entry per touched module, in the model's module order."""

    def layer(self, module: str) -> LayerPlan | None:
        """The plan of the module named ``module``, or None when TP leaves it alone."""
        return next((entry for entry in self.layers if entry.module == module), None)
