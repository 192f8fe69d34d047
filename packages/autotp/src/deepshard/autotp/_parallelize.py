"""``parallelize``: apply a `TPPlan` to a plain model, in place, from outside it.

Every module the plan splits is replaced by its TP layer (`deepshard.autotp._layers`), built
from the module's own weights, so a model loaded with ``from_pretrained`` keeps its values;
parameters of replicated-with-grad-allreduce modules get their gradients summed over TP once
per backward (`ReplicatedGradReducer`). What was done is kept per model, on the model: the plan
(`plan_of`) and a `TPModelState` (`tp_state`) with the placements and shard maps the ZeRO and
checkpoint packages read. Nothing is kept anywhere else, so two models in one process never
share metadata, and dropping the model frees everything.

**Blocks where some rank holds nothing.** With more TP ranks than KV heads, the trailing ranks
hold no rows of an attention block's column layers (their row-parallel partial sum is zero, so
results stay exact). A Hugging Face attention forward cannot run on zero heads (it reshapes
with ``-1``), so on those ranks the block is replaced by `_HeadlessBlock`, which runs the same
collectives on empty tensors. To keep the backward collectives in the same order on every rank
although the graphs differ, such a block's column layers do not reduce their input gradient
one by one: the block's input is reduced once (`copy_to_tp`) on every rank.

**Head-count attributes** (``num_heads``, ``num_key_value_heads``, and ``hidden_size`` where it
is the attention width) are rewritten to this rank's share only on the modules that directly
hold split layers. Transformers 5's Llama and Qwen3 attention read none of them (they reshape
with ``-1`` and keep ``num_key_value_groups``, a ratio a KV-group split preserves). Phi-3's
reads ``config.num_attention_heads`` at every forward to cut its fused QKV output, so such a
block gets a view of the model config with this rank's head counts, all else read from (and
written to) the shared config. Bloom builds its ALiBi bias for every head in the model's
forward; each split attention narrows it to its own heads (a pre-hook), keeping their slopes.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from deepshard.autotp._describe import PLAN_ATTRIBUTE
from deepshard.autotp._functions import copy_to_tp
from deepshard.autotp._grad_sync import ReplicatedGradReducer
from deepshard.autotp._heads import Q_HEADS, count, narrow_alibi, rewrite_heads
from deepshard.autotp._layers import TPGroup, build_layer
from deepshard.autotp._placements import build_placements, sharded_parameters
from deepshard.autotp._plan import make_plan
from deepshard.autotp._plan_types import LayerPlan, Style, TPPlan
from deepshard.autotp._warnings import AutoTPWarning
from deepshard.comm import ParallelDims
from deepshard.interface.config import TensorParallelConfig
from deepshard.interface.errors import ConfigError, TopologyError
from deepshard.interface.placement import PlacementRegistry
from deepshard.interface.shard_map import ShardMap
from deepshard.interface.topology import Topology

__all__ = ["TPModelState", "parallelize", "tp_state"]

STATE_ATTRIBUTE = "_deepshard_tp_state"
_SPLIT = (Style.COLUMN, Style.ROW, Style.VOCAB)
_KEY = "tensor_parallel.autotp_size"


@dataclass(frozen=True, eq=False)
class TPModelState:
    """What ``parallelize`` did to one model (kept on that model only)."""

    plan: TPPlan
    """The plan that was applied."""

    tp: TPGroup = field(repr=False)
    """The ``tp`` group, this rank and its size."""

    placements: PlacementRegistry = field(repr=False)
    """Every parameter's placement (see `deepshard.autotp._placements`)."""

    shard_maps: dict[str, ShardMap] = field(repr=False)
    """Where each sharded parameter's TP shards lie in the whole tensor, by name."""

    full_shapes: dict[str, tuple[int, ...]] = field(repr=False)
    """The unsharded shape of each sharded parameter, by name."""

    reducer: ReplicatedGradReducer | None = field(repr=False)
    """Sums replicated-with-grad-allreduce gradients over TP; None when there are none."""


def tp_state(model: nn.Module) -> TPModelState:
    """The `TPModelState` of a model ``parallelize`` was applied to.

    Raises:
        ConfigError: ``model`` was not parallelized.
    """
    state = vars(model).get(STATE_ATTRIBUTE)
    if not isinstance(state, TPModelState):
        raise ConfigError(
            f"{type(model).__name__} has not been tensor-parallelized; call "
            "deepshard.autotp.parallelize(model, mesh) first",
            [("tensor_parallel.autotp_size", "model not parallelized")],
        )
    return state


def _resolve(mesh: DeviceMesh | ParallelDims) -> tuple[DeviceMesh, Topology]:
    if isinstance(mesh, ParallelDims):
        return mesh.tp, mesh.topology
    names = tuple(mesh.mesh_dim_names or ())
    if names == Topology.AXES:
        return mesh["tp"], Topology(**dict(zip(names, mesh.shape, strict=True)))
    if names == ("tp",):
        return mesh, Topology(tp=mesh.size())
    raise TopologyError(
        f"parallelize needs ParallelDims, the five-axis mesh of deepshard.comm.build_mesh, or "
        f"a 1-D mesh named 'tp'; got a mesh with axes {names or '(unnamed)'}"
    )


def _check_config(size: int, config: TensorParallelConfig | None) -> None:
    wanted = config.autotp_size if config is not None else 0
    if wanted not in (0, size):
        raise ConfigError(
            f"tensor_parallel.autotp_size is {wanted} but the mesh's tp axis has {size} ranks; "
            "make them equal (or leave autotp_size at 0 to follow the mesh)",
            [("tensor_parallel.autotp_size", f"{wanted} != tp axis {size}")],
        )


def _check_plan(plan: TPPlan, size: int) -> None:
    if plan.tp_size != size:
        raise ConfigError(
            f"the plan is for {plan.tp_size} TP ranks but the mesh's tp axis has {size}; make "
            f"the plan with tp_size={size}",
            [("tensor_parallel.autotp_size", f"plan for {plan.tp_size} ranks")],
        )


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def _starved_blocks(plan: TPPlan) -> set[str]:
    """Parents of column layers in which some rank holds no rows."""
    return {
        _parent(layer.module)
        for layer in plan.layers
        if layer.style is Style.COLUMN
        and any(layer.local_size(rank) == 0 for rank in range(plan.tp_size))
    }


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    if not child:
        raise ConfigError(
            "the plan splits the model itself (module ''); name its submodules instead",
            [("tensor_parallel.partition_config.layer_specs", "module ''")],
        )
    setattr(model.get_submodule(parent), child, module)


class _ReduceBlockInput:
    """A forward pre-hook: the block's input goes through `copy_to_tp` (see module doc)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def __call__(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            return (copy_to_tp(args[0], group=self.group), *args[1:]), kwargs
        if "hidden_states" not in kwargs:
            raise ConfigError(
                f"{type(module).__name__} was called without a positional input or "
                "hidden_states=; AutoTP cannot find the input of a block some ranks hold no "
                "rows of: lower tensor_parallel.autotp_size to the KV heads",
                [("tensor_parallel.autotp_size", "more ranks than KV heads")],
            )
        return args, {
            **kwargs,
            "hidden_states": copy_to_tp(kwargs["hidden_states"], group=self.group),
        }


class _HeadlessBlock(nn.Module):
    """A block on a rank that holds none of its column rows (more TP ranks than KV heads).

    It keeps the original children (so parameter names do not change) and runs the
    collectives the other ranks run, on empty tensors: its input reduced once in backward, the
    column layers (and replicated-with-grad-allreduce norms, fed empty head tensors so that
    their gradient is a zero that takes part in the reduction), and the row layer's forward
    all-reduce, whose result is returned as Hugging Face attention does, ``(output, None)``.
    """

    def __init__(self, block: nn.Module, layers: list[LayerPlan], tp: TPGroup) -> None:
        super().__init__()
        for name, child in block.named_children():
            self.add_module(name, child)
        local = {layer.module.rpartition(".")[2]: layer.style for layer in layers}
        self.columns = [n for n, s in local.items() if s is Style.COLUMN]
        self.norms = [n for n, s in local.items() if s is Style.REPLICATE_GRAD_ALLREDUCE]
        rows = [n for n, s in local.items() if s is Style.ROW]
        if len(rows) != 1:
            raise ConfigError(
                f"a block with no rows on TP rank {tp.rank} needs exactly one row-parallel "
                f"layer to all-reduce into, found {rows}; lower tensor_parallel.autotp_size",
                [("tensor_parallel.autotp_size", "more ranks than KV heads")],
            )
        self.row, self.group = rows[0], tp.group
        self.layer_idx: int | None = getattr(block, "layer_idx", None)
        self.head_dim: int | None = getattr(block, "head_dim", None)

    def forward(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``(row(Σ column(x)), None)`` on empty features; ``x`` is the first input.

        A KV cache passed as ``past_key_values`` gets this layer's (empty) keys and values, so
        its length, which generation reads to place new tokens, is the other ranks'.
        """
        x = args[0] if args else kwargs["hidden_states"]
        cache = kwargs.get("past_key_values")
        if cache is not None and self.layer_idx is not None and self.head_dim is not None:
            empty = x.new_zeros((x.shape[0], 0, x.shape[1], self.head_dim))
            cache.update(empty, empty, self.layer_idx)
        x = copy_to_tp(x, group=self.group)
        outs = [self.get_submodule(name)(x) for name in self.columns]
        total = outs[0]
        for out in outs[1:]:
            total = total + out
        lead = total.shape[:-1]
        for name in self.norms:
            norm = self.get_submodule(name)
            width = next(norm.parameters()).shape[-1]
            total = total + norm(total.reshape(*lead, 0, width)).reshape(*lead, 0)
        return self.get_submodule(self.row)(total), None


def _replace_layers(
    model: nn.Module, plan: TPPlan, tp: TPGroup, starved: set[str]
) -> list[tuple[str, nn.Parameter]]:
    replicated: list[tuple[str, nn.Parameter]] = []
    for layer in plan.layers:
        module = model.get_submodule(layer.module)
        if layer.style in _SPLIT:
            reduce = _parent(layer.module) not in starved
            _set_submodule(
                model, layer.module, build_layer(module, layer, tp, reduce_input_grad=reduce)
            )
        elif layer.style is Style.REPLICATE_GRAD_ALLREDUCE:
            prefix = f"{layer.module}." if layer.module else ""
            replicated += [(prefix + n, p) for n, p in module.named_parameters() if p.requires_grad]
    return replicated


def _adjust_blocks(model: nn.Module, plan: TPPlan, tp: TPGroup, starved: set[str]) -> None:
    by_parent: dict[str, list[LayerPlan]] = defaultdict(list)
    for layer in plan.layers:
        by_parent[_parent(layer.module)].append(layer)
    for parent, layers in by_parent.items():
        if not any(layer.style in _SPLIT for layer in layers):
            continue
        block = model.get_submodule(parent)
        heads = next((count(getattr(block, a, None)) for a in Q_HEADS if hasattr(block, a)), None)
        rewrite_heads(block, layers, tp.rank)
        columns = [layer for layer in layers if layer.style is Style.COLUMN]
        if columns:
            narrow_alibi(block, columns[0], heads, tp.rank)
        if parent not in starved:
            continue
        columns = [layer for layer in layers if layer.style is Style.COLUMN]
        if all(layer.local_size(tp.rank) == 0 for layer in columns):
            _set_submodule(model, parent, _HeadlessBlock(block, layers, tp))
        else:
            block.register_forward_pre_hook(_ReduceBlockInput(tp.group), with_kwargs=True)


def _warn_nothing_split(model: nn.Module, plan: TPPlan) -> None:
    """A plan that splits no layer has every TP rank compute the whole model: said with an
    `AutoTPWarning` naming the layers AutoTP does not split when the model has them
    (transformers' ``Conv1D`` in GPT-2), instead of running without tensor parallelism and
    without a word. (A warning, not an error: a toy model on a TP mesh is legitimate.)"""
    tp_size = plan.tp_size
    if tp_size == 1 or any(layer.style in _SPLIT for layer in plan.layers):
        return
    conv = [name for name, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    why = (
        f"; its projections are transformers' Conv1D ({conv[0]}, ...), which AutoTP does not "
        "split (it splits nn.Linear and nn.Embedding)"
        if conv
        else ""
    )
    warnings.warn(
        f"AutoTP found nothing to split in {type(model).__name__}, so every one of the "
        f"{tp_size} tensor-parallel ranks computes the whole model{why}; set {_KEY} to 1, or "
        "name the layers in tensor_parallel.partition_config.layer_specs",
        AutoTPWarning,
        stacklevel=3,
    )


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | ParallelDims,
    config: TensorParallelConfig | None = None,
    *,
    plan: TPPlan | None = None,
    placements: PlacementRegistry | None = None,
) -> nn.Module:
    """Split ``model`` over the ``tp`` axis of ``mesh``, in place, and return it.

    Args:
        model: A plain model (e.g. a Hugging Face ``PreTrainedModel``), on its final device.
        mesh: `ParallelDims`, the mesh of ``deepshard.comm.build_mesh``, or a 1-D ``tp`` mesh.
        config: The ``tensor_parallel`` section (``tp_overlap_comm``, plan sources...).
        plan: The plan to apply; ``make_plan(model, tp_size, config)`` when None.
        placements: A registry to write the placements into; a new one when None (it is
            `TPModelState.placements` either way).

    Returns:
        ``model``, its split modules replaced.

    Raises:
        ConfigError: Sizes that disagree, a module the plan cannot split, a model that was
            already parallelized.
        TopologyError: A mesh without a ``tp`` axis.
    """
    if STATE_ATTRIBUTE in vars(model):
        raise ConfigError(
            f"{type(model).__name__} is already tensor-parallelized; parallelize a fresh model",
            [("tensor_parallel.autotp_size", "parallelize called twice")],
        )
    tp_mesh, topology = _resolve(mesh)
    group = tp_mesh.get_group()
    overlap = config.tp_overlap_comm if config is not None else False
    tp = TPGroup(group, tp_mesh.get_local_rank(), tp_mesh.size(), overlap)
    _check_config(tp.size, config)
    if plan is None:
        plan = make_plan(model, tp.size, config)
    _check_plan(plan, tp.size)
    _warn_nothing_split(model, plan)
    full_shapes = {
        name: tuple(param.shape)
        for layer in plan.layers
        for name, param in _named_split_params(model, layer)
    }
    starved = _starved_blocks(plan)
    replicated = _replace_layers(model, plan, tp, starved)
    _adjust_blocks(model, plan, tp, starved)
    reducer = ReplicatedGradReducer(replicated, group) if replicated else None
    registry, maps = build_placements(
        model, plan, topology, full_shapes=full_shapes, registry=placements
    )
    model.__dict__[PLAN_ATTRIBUTE] = plan
    model.__dict__[STATE_ATTRIBUTE] = TPModelState(plan, tp, registry, maps, full_shapes, reducer)
    return model


def _named_split_params(model: nn.Module, layer: LayerPlan) -> list[tuple[str, torch.Tensor]]:
    module = model.get_submodule(layer.module)
    found = []
    for local_name, _ in sharded_parameters(layer):
        param = getattr(module, local_name, None)
        if isinstance(param, torch.Tensor):
            found.append((f"{layer.module}.{local_name}", param))
    return found
