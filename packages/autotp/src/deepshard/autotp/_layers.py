"""The tensor-parallel modules that replace a model's ``nn.Linear`` and ``nn.Embedding``.

Each module is built from the module it replaces and its `LayerPlan`: it keeps this rank's
shard of the weight (the concatenation of its piece of every sub-parameter, so a fused
``gate_up_proj`` or QKV is cut per part), calls the autograd functions of
`deepshard.autotp._functions`, and holds the ``tp`` group it was given. State-dict names and
the parameters' ``requires_grad`` stay those of the replaced module, so optimizers and
checkpoints see the same names with smaller tensors.

`TPGroup` bundles what every layer needs about the group (the group, this rank, its size, and
whether backward overlaps communication); it comes from the mesh passed to ``parallelize``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from deepshard.autotp._functions import (
    column_linear,
    gather_last_dim,
    local_pieces,
    row_linear,
    split_last_dim,
    vocab_embedding,
)
from deepshard.autotp._plan_types import LayerPlan, Style
from deepshard.interface.errors import ConfigError

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPGroup",
    "VocabParallelEmbedding",
]


@dataclass(frozen=True)
class TPGroup:
    """The tensor-parallel group as the layers use it."""

    group: dist.ProcessGroup
    """The ``tp`` process group."""

    rank: int
    """This process's index in `group`."""

    size: int
    """Ranks in `group` (the plan's ``tp_size``)."""

    overlap_comm: bool = False
    """``tensor_parallel.tp_overlap_comm``: overlap the input-gradient all-reduce with the
    weight-gradient matmul in column layers."""


def _shard(param: torch.Tensor, layer: LayerPlan, rank: int, dim: int) -> nn.Parameter:
    with torch.no_grad():
        data = local_pieces(param.detach(), layer.offsets(rank), dim).clone()
    return nn.Parameter(data, requires_grad=param.requires_grad)


def _check_sizes(layer: LayerPlan, extent: int, tp: TPGroup, what: str) -> None:
    if any(len(per_rank) != tp.size for per_rank in layer.sizes) or not layer.sizes:
        raise ConfigError(
            f"the plan of {layer.module!r} gives sizes {layer.sizes}, not one entry per rank of "
            f"the TP group of {tp.size}; build the plan for tensor_parallel.autotp_size={tp.size}",
            [("tensor_parallel.autotp_size", f"plan for {layer.module!r} does not match")],
        )
    total = sum(sum(per_rank) for per_rank in layer.sizes)
    if total != extent:
        raise ConfigError(
            f"the plan of {layer.module!r} splits {total} {what} but the module has {extent}; "
            "fix the layer spec's 'shape' in tensor_parallel.partition_config.layer_specs",
            [("tensor_parallel.partition_config.layer_specs", f"shape of {layer.module!r}")],
        )


class ColumnParallelLinear(nn.Module):
    """A Linear whose output features (weight rows, bias entries) are split over TP ranks.

    The input is whole on every rank; the output is this rank's features, or the whole output
    (re-assembled in the original order) with ``gather_output``.
    """

    def __init__(
        self, linear: nn.Linear, layer: LayerPlan, tp: TPGroup, *, reduce_input_grad: bool = True
    ) -> None:
        super().__init__()
        _check_sizes(layer, linear.out_features, tp, "output features")
        self.tp, self.layer = tp, layer
        self.reduce_input_grad = reduce_input_grad
        self.in_features = linear.in_features
        self.out_features = layer.local_size(tp.rank)
        self.full_out_features = linear.out_features
        self.weight = _shard(linear.weight, layer, tp.rank, 0)
        self.bias = None if linear.bias is None else _shard(linear.bias, layer, tp.rank, 0)
        self._pieces = tuple(layer.offsets(r) for r in range(tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` for this rank's features (all of them with ``gather_output``)."""
        group = self.tp.group if self.reduce_input_grad else None
        out = column_linear(x, self.weight, self.bias, group=group, overlap=self.tp.overlap_comm)
        if self.layer.gather_output:
            out = gather_last_dim(out, self._pieces, rank=self.tp.rank, group=self.tp.group)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} of "
            f"{self.full_out_features}, tp_rank={self.tp.rank}/{self.tp.size}, "
            f"gather_output={self.layer.gather_output}"
        )


class RowParallelLinear(nn.Module):
    """A Linear whose input features (weight columns) are split; the output is all-reduced.

    The input is normally this rank's features already (the output of a column layer); a whole
    input is split here first. The bias stays whole and is added once, after the reduction.
    """

    def __init__(self, linear: nn.Linear, layer: LayerPlan, tp: TPGroup) -> None:
        super().__init__()
        _check_sizes(layer, linear.in_features, tp, "input features")
        self.tp, self.layer = tp, layer
        self.in_features = layer.local_size(tp.rank)
        self.full_in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = _shard(linear.weight, layer, tp.rank, 1)
        self.bias = linear.bias
        self._pieces = tuple(layer.offsets(r) for r in range(tp.size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``Σᵣ xᵣ Wᵣᵀ + b`` over the TP ranks."""
        if x.shape[-1] == self.full_in_features and self.full_in_features != self.in_features:
            x = split_last_dim(x, self._pieces, rank=self.tp.rank, group=self.tp.group)
        return row_linear(x, self.weight, self.bias, group=self.tp.group)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} of {self.full_in_features}, "
            f"out_features={self.out_features}, tp_rank={self.tp.rank}/{self.tp.size}"
        )


class VocabParallelEmbedding(nn.Module):
    """An embedding whose vocabulary (weight rows) is split into contiguous ranges."""

    def __init__(self, embedding: nn.Embedding, layer: LayerPlan, tp: TPGroup) -> None:
        super().__init__()
        _check_sizes(layer, embedding.num_embeddings, tp, "vocabulary rows")
        if len(layer.sizes) != 1:
            raise ConfigError(
                f"{layer.module!r}: a vocab-parallel embedding is one sub-parameter, the plan "
                f"gives {len(layer.sizes)}; drop 'shape' from its layer spec",
                [("tensor_parallel.partition_config.layer_specs", f"shape of {layer.module!r}")],
            )
        if embedding.max_norm is not None or embedding.sparse:
            raise ConfigError(
                f"{layer.module!r}: an embedding with max_norm or sparse=True cannot be split "
                "by vocabulary; leave it whole with a 'skip' layer spec",
                [("tensor_parallel.partition_config.layer_specs", f"skip {layer.module!r}")],
            )
        self.tp, self.layer = tp, layer
        ((self.start, self.num_embeddings),) = layer.offsets(tp.rank)
        self.full_num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.weight = _shard(embedding.weight, layer, tp.rank, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of ``ids`` (whole on every rank)."""
        return vocab_embedding(
            ids, self.weight, start=self.start, padding_idx=self.padding_idx, group=self.tp.group
        )

    def extra_repr(self) -> str:
        return (
            f"rows {self.start}..{self.start + self.num_embeddings} of "
            f"{self.full_num_embeddings}, embedding_dim={self.embedding_dim}"
        )


def build_layer(
    module: nn.Module, layer: LayerPlan, tp: TPGroup, *, reduce_input_grad: bool = True
) -> nn.Module:
    """The TP module replacing ``module`` as ``layer`` says (column, row or vocab).

    ``reduce_input_grad=False`` builds a column layer whose input gradient is left partial
    (its block reduces its input once, `deepshard.autotp._functions.copy_to_tp`).

    Raises:
        ConfigError: The module is not of the type the style needs, or the sizes do not fit.
    """
    wanted: type[nn.Module] = nn.Embedding if layer.style is Style.VOCAB else nn.Linear
    if type(module) is not wanted and not isinstance(module, wanted):
        raise ConfigError(
            f"{layer.module!r} is a {type(module).__name__}; a {layer.style.value} split needs "
            f"an nn.{wanted.__name__}: change or 'skip' its layer spec",
            [("tensor_parallel.partition_config.layer_specs", f"{layer.module!r}")],
        )
    if layer.style is Style.COLUMN:
        assert isinstance(module, nn.Linear)
        return ColumnParallelLinear(module, layer, tp, reduce_input_grad=reduce_input_grad)
    if layer.style is Style.ROW:
        assert isinstance(module, nn.Linear)
        return RowParallelLinear(module, layer, tp)
    assert isinstance(module, nn.Embedding)
    return VocabParallelEmbedding(module, layer, tp)
