"""How the engine applies ``sequence_parallel_size``: Ulysses for the model, shards for the loader.

With an ``sp`` axis above 1, ``initialize`` hands the (uncast) model to
`deepshard.sequence_parallel.apply_ulysses` before anything else touches it (parallelize, then
cast, then shard), and wraps the loader it builds in `UlyssesDataLoaderAdapter`, so each
sequence-parallel rank reads its shard of the batch its peers read. Nothing else changes:
dense gradients are already averaged over ``dp × ep × sp`` (ZeRO's group), which together with
the SP loss (`deepshard.sequence_parallel.sp_mean_loss`) gives the whole sequence's gradient,
and batch sizes already count only the ranks that read different samples (``dp × ep``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader

from deepshard.comm import ParallelDims
from deepshard.interface import DeepShardConfig
from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel import UlyssesDataLoaderAdapter, apply_ulysses, tile_hf_model

__all__ = ["apply_sequence_parallel", "shard_loader"]


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


def shard_loader(
    loader: DataLoader[Any] | None, *, dims: ParallelDims
) -> DataLoader[Any] | UlyssesDataLoaderAdapter | None:
    """``loader`` wrapped so each ``sp`` rank gets its sequence shard (unchanged at sp = 1)."""
    if loader is None or dims.sp.size() == 1:
        return loader
    return UlyssesDataLoaderAdapter(loader, parallel_dims=dims)
