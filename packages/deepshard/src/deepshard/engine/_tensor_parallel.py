"""What `initialize` checks about tensor parallelism, and the first step's input check.

The tensor-parallel degree comes from ``tensor_parallel.autotp_size`` (DeepSpeed's training key)
or ``tensor_parallel.tp.tp_size`` (its inference-style key); both may be given only when they
agree. It becomes the ``tp`` axis of the mesh, innermost, so a TP group is adjacent ranks (one
node); data parallelism and ZeRO run over the remaining axes. A caller's mesh must have the
same ``tp`` size as the config when the config names one. AutoTP's ``dtype`` is what the
engine casts the model to, so one set explicitly must be the engine's precision. DeepShard
builds every process group from the mesh, so an explicit ``tp_group`` is refused.

**Inputs within a TP group.** Tensor-parallel ranks compute one model together, so they must
feed it the same batch (the loader `initialize` builds does: it shards data by the batch
group, ``dp × ep``). A user's own loader that shards by global rank would instead train on
mismatched halves without any error. `TpInputCheck` compares a fingerprint of the first
forward's inputs across the TP group (one all-reduce of a few numbers, once) and fails with
"inputs differ within the tensor-parallel group" when they differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from deepshard.comm import ParallelDims, all_reduce
from deepshard.interface import PlacementRegistry
from deepshard.interface.config import DeepShardConfig
from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.autotp import TPPlan

__all__ = [
    "TpInputCheck",
    "apply_tensor_parallel",
    "check_tp_layout",
    "input_fingerprint",
    "tp_config_problems",
]

_AUTOTP = "tensor_parallel.autotp_size"
_TP_SIZE = "tensor_parallel.tp.tp_size"


def _engine_dtype(config: DeepShardConfig) -> str:
    return "fp16" if config.fp16.enabled else "bf16" if config.bf16.enabled else "fp32"


def tp_config_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """``(key, message)`` for contradictory tensor-parallel settings (sizes, dtype)."""
    tp = config.tensor_parallel
    problems = []
    if tp.autotp_size > 1 and tp.tp.tp_size > 1 and tp.autotp_size != tp.tp.tp_size:
        problems.append(
            (
                _AUTOTP,
                f"{tp.autotp_size} contradicts {_TP_SIZE} = {tp.tp.tp_size}; set one of them",
            )
        )
    engine = _engine_dtype(config)
    if config.tensor_parallel.size > 1 and "dtype" in tp.model_fields_set and tp.dtype != engine:
        problems.append(
            (
                "tensor_parallel.dtype",
                f"{tp.dtype} contradicts the engine's precision {engine} (fp16.enabled / "
                "bf16.enabled); remove tensor_parallel.dtype or make the two agree",
            )
        )
    return problems


def check_tp_layout(
    config: DeepShardConfig, *, world_size: int | None = None, dims: ParallelDims | None = None
) -> None:
    """Refuse a tensor-parallel degree that the world or the caller's mesh cannot hold.

    Args:
        config: The validated config.
        world_size: The world ``initialize`` will lay out (no mesh given).
        dims: The caller's mesh, as `ParallelDims`.

    Raises:
        ConfigError: The degree does not divide the world, or differs from the mesh's ``tp``.
    """
    size, key = (
        config.tensor_parallel.size,
        _AUTOTP if config.tensor_parallel.autotp_size > 1 else _TP_SIZE,
    )
    if world_size is not None and world_size % size:
        raise ConfigError(
            f"{key}: {size} does not divide the world size {world_size}; tensor-parallel "
            "groups are adjacent ranks, so pick a divisor of the number of ranks"
        )
    if dims is not None and size > 1 and dims.topology.tp != size:
        raise ConfigError(
            f"{key}: {size} differs from the mesh's tp axis of size {dims.topology.tp}; "
            "remove the key (the mesh decides) or build the mesh with the same tp"
        )


def apply_tensor_parallel(
    model: torch.nn.Module, config: DeepShardConfig, *, dims: ParallelDims
) -> PlacementRegistry | None:
    """Split ``model`` over the mesh's ``tp`` axis (`deepshard.autotp.parallelize`), before the
    cast; ``None`` (nothing done) when ``tp`` has one rank.

    Gradients that are partial sums over TP are left to ZeRO, which sums them at the step
    (`deepshard.autotp.defer_grad_allreduce`).

    Returns:
        Every parameter's placement, for `deepshard.zero.shard`.
    """
    if dims.topology.tp == 1:
        return None
    from deepshard.autotp import defer_grad_allreduce, parallelize, tp_state

    parallelize(model, dims, config.tensor_parallel)
    state = tp_state(model)
    _refuse_uneven(model, state.plan, state.placements)
    defer_grad_allreduce(model)
    return state.placements


def _refuse_uneven(model: torch.nn.Module, plan: TPPlan, placements: PlacementRegistry) -> None:
    """Refuse a split ZeRO cannot lay out: a trainable parameter AutoTP cut unevenly (it has a
    shard map but no ``Shard`` placement; `deepshard.autotp._placements`).

    Raises:
        ConfigError: Naming the first such parameter, its rows per rank and the fixes.
    """
    uneven = [n for n, p in model.named_parameters() if p.requires_grad and n not in placements]
    if not uneven:
        return
    module = uneven[0].rpartition(".")[0]
    layer = plan.layer(module)
    rows = [list(per_rank) for per_rank in layer.sizes] if layer is not None else "?"
    raise ConfigError(
        f"AutoTP splits {uneven[0]!r}"
        f"{f' (and {len(uneven) - 1} more)' if len(uneven) > 1 else ''} unevenly over "
        f"tp={plan.tp_size} (rows per rank, per part: {rows}); training lays out even "
        "tensor-parallel splits only (every part a multiple of the TP size). Pad that "
        f"dimension (a vocabulary: model.resize_token_embeddings(n, pad_to_multiple_of="
        f"{plan.tp_size})), or choose a TP size that divides the KV heads",
        [(_AUTOTP, f"splits {uneven[0]!r} unevenly")],
    )


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for key in sorted(value, key=str):
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def input_fingerprint(args: Any, kwargs: Any) -> torch.Tensor:
    """A few float64 numbers that differ when the inputs do: count, sizes, sums, a
    position-weighted sum (so permuted rows differ too)."""
    out = torch.zeros(5, dtype=torch.float64)
    for tensor in _tensors((args, kwargs)):
        values = tensor.detach().reshape(-1).to("cpu", torch.float64)
        weights = torch.arange(1, values.numel() + 1, dtype=torch.float64).remainder_(997)
        out += torch.stack(
            [
                torch.tensor(1.0, dtype=torch.float64),
                torch.tensor(float(values.numel()), dtype=torch.float64),
                values.sum(),
                values.square().sum(),
                (values * weights).sum(),
            ]
        )
    return out


class TpInputCheck:
    """Checks once, at the first forward, that every TP rank of the group got the same inputs.

    Args:
        dims: The engine's mesh; nothing is checked when its ``tp`` axis has one rank.
        device: Where the collective runs (the engine's device).
    """

    def __init__(self, dims: ParallelDims, device: torch.device) -> None:
        self._group = dims.tp if dims.topology.tp > 1 else None
        self._device = device

    def __call__(self, args: Any, kwargs: Any) -> None:
        """Compare this rank's inputs with its TP peers' (a collective on the first call only).

        Raises:
            ConfigError: They differ.
        """
        group, self._group = self._group, None
        if group is None:
            return
        mine = input_fingerprint(args, kwargs)
        both = torch.cat([mine, -mine]).to(self._device)
        all_reduce(both, group=group, op="max")
        if not torch.equal(both[:5], -both[5:]):
            raise ConfigError(
                "inputs differ within the tensor-parallel group: every tp rank of a group must "
                "get the same batch; build the loader with initialize(training_data=...), or "
                "shard your data by engine.parallel_dims.batch_rank / batch_world_size instead "
                "of the global rank"
            )
