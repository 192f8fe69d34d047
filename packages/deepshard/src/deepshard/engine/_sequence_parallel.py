"""How the engine applies ``sequence_parallel_size``: Ulysses for the model, shards for the loader.

With an ``sp`` axis above 1, ``initialize`` hands the (uncast) model to
`deepshard.sequence_parallel.apply_ulysses` before anything else touches it (parallelize, then
cast, then shard), and wraps the loader it builds in `UlyssesDataLoaderAdapter`, so each
sequence-parallel rank reads its shard of the batch its peers read. Nothing else changes:
dense gradients are already averaged over ``dp × ep × sp`` (ZeRO's group), which together with
the SP loss (`deepshard.sequence_parallel.sp_mean_loss`) gives the whole sequence's gradient,
and batch sizes already count only the ranks that read different samples (``dp × ep``).

**With tensor parallelism on the same mesh** (``tp`` innermost, so a TP group is adjacent ranks
and an ``sp`` group holds ranks of one TP coordinate), AutoTP runs after Ulysses and splits the
attention heads by KV group first; each TP rank's attention then sees ``heads / tp`` query and
``kv / tp`` KV heads (the projections reshape with ``-1``), and the exchange over ``sp`` splits
those local heads again, reading the counts from the tensors of each call. The loss reduction
and the loader follow the ``sp`` group, so TP peers compute the same shard with the same loss;
ZeRO partitions over ``dp × ep × sp`` and sums the TP-partial gradients as for TP alone. What
can fail is the head split: local heads that ``sp`` cannot divide (``plan_heads``'s rules) are
refused here, before anything is built, with the counts after TP, instead of at the first
forward with counts the user never wrote.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from deepshard.comm import ParallelDims
from deepshard.interface import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel import (
    UlyssesDataLoaderAdapter,
    apply_ulysses,
    plan_heads,
    tile_hf_model,
)

__all__ = ["apply_sequence_parallel", "check_head_split", "shard_loader"]


def apply_sequence_parallel(
    model: torch.nn.Module, config: DeepShardConfig, *, dims: ParallelDims
) -> None:
    """Applies Ulysses to ``model`` when the mesh has an ``sp`` axis above 1, then the tiled
    MLP / logits loss the ``sequence_parallel`` section switches on (at any ``sp`` size).

    Args:
        model: The caller's model, before the cast.
        config: The whole config (its ``sequence_parallel`` section is read).
        dims: The training mesh.

    Raises:
        ConfigError: ``sequence_parallel_size`` above 1, or tiling, for a model that cannot
            take it; the message names the key and what to do.
    """
    section = config.sequence_parallel
    if dims.sp.size() > 1:
        check_head_split(model, config, dims=dims)
        try:
            apply_ulysses(model, dims, disable_in_eval=section.disable_in_eval)
        except ConfigError as exc:
            raise ConfigError.from_problems([("sequence_parallel_size", str(exc))]) from exc
    if not (section.tiled_mlp or section.tiled_logits_loss):
        return
    try:
        tile_hf_model(
            model,
            mlp=section.tiled_mlp,
            mlp_shards=section.tiled_mlp_shards,
            logits_loss=section.tiled_logits_loss,
            logits_shards=section.tiled_logits_shards,
            sp_group=dims.sp,
            disable_in_eval=section.disable_in_eval,
        )
    except ConfigError as exc:
        key = "tiled_mlp" if section.tiled_mlp else "tiled_logits_loss"
        raise ConfigError.from_problems([(f"sequence_parallel.{key}", str(exc))]) from exc


def _local_heads(model: torch.nn.Module, tp: int) -> list[tuple[int, int]] | None:
    """``(query, KV)`` heads of each TP rank's attention, as AutoTP splits them (by KV group);
    None when the model's config does not give the head counts."""
    from deepshard.autotp import AutoTPMeta, kv_group_split

    meta = AutoTPMeta.from_model_config(getattr(model, "config", None))
    heads, kv = meta.num_attention_heads, meta.num_kv_heads
    if heads is None or kv is None:
        return None
    group = heads // kv
    return [(n * group, n) for n in kv_group_split(kv, tp, kv)]


def check_head_split(
    model: torch.nn.Module, config: DeepShardConfig, *, dims: ParallelDims
) -> None:
    """Refuse a ``sequence_parallel_size`` that cannot split each TP rank's attention heads.

    Every TP rank holding heads must be able to deal its query and KV heads over the ``sp``
    ranks with each query head beside its KV head (`deepshard.sequence_parallel.plan_heads`). A
    model without head counts in its config, or TP layer specs of the user's own (whose split
    this cannot predict), is left to the check each attention call makes.

    Raises:
        ConfigError: Naming ``sequence_parallel_size``, the counts per TP rank and the fix.
    """
    tp = dims.topology.tp
    partition = config.tensor_parallel.partition_config
    if tp > 1 and partition is not None and partition.layer_specs:
        return
    local = _local_heads(model, tp)
    if local is None:
        return
    sp = dims.sp.size()
    for q, kv in local:
        if q == 0:  # AutoTP's headless block: no attention call, nothing to split
            continue
        try:
            plan_heads(q, kv, sp)
        except ConfigError as exc:
            problem = ("sequence_parallel_size", _split_problem(tp, exc))
            raise ConfigError.from_problems([problem]) from exc


def _split_problem(tp: int, exc: ConfigError) -> str:
    if tp == 1:
        return str(exc)
    return (
        f"the attention heads left on a TP rank by tensor_parallel.autotp_size {tp} (AutoTP "
        f"splits heads by KV group first, Ulysses splits each rank's share again): {exc} Or "
        "change tensor_parallel.autotp_size."
    )


def shard_loader(
    loader: DataLoader[Any] | None, *, dims: ParallelDims
) -> DataLoader[Any] | UlyssesDataLoaderAdapter | None:
    """``loader`` wrapped so each ``sp`` rank gets its sequence shard (unchanged at sp = 1)."""
    if loader is None or dims.sp.size() == 1:
        return loader
    return UlyssesDataLoaderAdapter(loader, parallel_dims=dims)
