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
from deepshard.sequence_parallel import UlyssesDataLoaderAdapter, apply_ulysses

__all__ = ["apply_sequence_parallel", "shard_loader"]


def apply_sequence_parallel(
    model: torch.nn.Module, config: DeepShardConfig, *, dims: ParallelDims
) -> None:
    """Applies Ulysses to ``model`` when the mesh has an ``sp`` axis above 1.

    Args:
        model: The caller's model, before the cast.
        config: The whole config (its ``sequence_parallel`` section is read).
        dims: The training mesh.

    Raises:
        ConfigError: ``sequence_parallel_size`` above 1 for a model Ulysses cannot wrap; the
            message names the key and what to do.
    """
    if dims.sp.size() == 1:
        return
    try:
        apply_ulysses(
            model,
            dims,
            disable_in_eval=config.sequence_parallel.disable_in_eval,
        )
    except ConfigError as exc:
        raise ConfigError.from_problems([("sequence_parallel_size", str(exc))]) from exc


def shard_loader(
    loader: DataLoader[Any] | None, *, dims: ParallelDims
) -> DataLoader[Any] | UlyssesDataLoaderAdapter | None:
    """``loader`` wrapped so each ``sp`` rank gets its sequence shard (unchanged at sp = 1)."""
    if loader is None or dims.sp.size() == 1:
        return loader
    return UlyssesDataLoaderAdapter(loader, parallel_dims=dims)
