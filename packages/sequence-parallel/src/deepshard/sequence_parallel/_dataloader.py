"""Sequence sharding of a loader's batches: sequence-parallel rank ``r`` gets shard ``r``.

Sequence-parallel peers read the same samples (the engine's loader shards data over
``dp × ep`` only, `Topology.batch_world_size`), so sharding needs no communication: every rank
cuts its own ``S/P`` consecutive tokens out of the batch it already holds. (DeepSpeed's adapter
lets each SP rank read its own sample, all-gathers the samples and works through them one per
micro-step; here the peers never read different data in the first place.)

What is cut, and how:

* ``labels`` are shifted on the *whole* sequence first (``shift_labels[t] = labels[t + 1]``,
  the last one ``-100``), then both are cut: a shard's last token predicts the first token of
  the next shard, which a shard-local shift would lose. The SP loss reads ``shift_labels``;
  ``labels`` stays so that Hugging Face models compute a loss at all.
* ``position_ids`` (``arange(S)`` per row when the batch has none) are cut, so rotary
  embeddings see whole-sequence positions and attention can rebuild the whole sequence's mask.
* A 2-D ``attention_mask`` is cut. Only right padding is accepted: attention is causal over
  whole-sequence positions, so padding after a token never reaches it, while left padding would need
  the whole mask inside every attention call. 4-D masks are refused (O(S²); pass position ids).
* Every other tensor of shape ``[b, S, ...]`` is cut along dim 1; anything else is passed on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from deepshard.comm import ParallelDims
from deepshard.interface.errors import ConfigError

__all__ = ["UlyssesDataLoaderAdapter", "shard_batch"]

_IGNORE = -100


def _check_attention_mask(mask: torch.Tensor, seq: int) -> None:
    if mask.dim() != 2 or mask.shape[1] != seq:
        raise ConfigError(
            f"attention_mask has shape {tuple(mask.shape)}; sequence parallelism takes a 2-D "
            f"[batch, {seq}] padding mask (4-D masks are O(seq²): pass position_ids instead)"
        )
    keep = mask.bool()
    # right padding: once a row's mask turns 0 it stays 0
    if bool((keep[:, 1:] & ~keep[:, :-1]).any()):
        raise ConfigError(
            "attention_mask has padding before real tokens (left padding or holes); sequence "
            "parallelism derives attention from position_ids, so pad on the right (or pack "
            "documents and restart position_ids at each one) and set the padding's labels to -100"
        )


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=_IGNORE)[..., 1:].contiguous()


def shard_batch(batch: Mapping[str, Any], *, sp_rank: int, sp_size: int) -> dict[str, Any]:
    """Sequence-parallel rank ``sp_rank``'s shard of one batch (see the module docstring).

    Args:
        batch: The whole batch: ``input_ids`` ``[b, S]``, optionally ``labels``,
            ``shift_labels``, ``position_ids``, ``attention_mask`` and other entries.
        sp_rank: This rank's index in the ``sp`` group.
        sp_size: The ``sp`` group's size; must divide ``S``.

    Returns:
        A new dict: the rank's ``S/sp_size`` tokens of every sequence-long tensor, with
        ``shift_labels`` and ``position_ids`` added.

    Raises:
        ConfigError: No 2-D ``input_ids``, ``S`` not divisible by ``sp_size``, a
            sequence-long entry of another length, or a refused ``attention_mask``.
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ConfigError(
            "sequence parallelism shards batches by their input_ids [batch, seq]; this batch "
            f"has {'no input_ids' if ids is None else f'input_ids of type {type(ids).__name__}'}"
            + ("" if not isinstance(ids, torch.Tensor) else f" shape {tuple(ids.shape)}")
        )
    rows, seq = ids.shape
    if seq % sp_size:
        raise ConfigError(
            f"sequence length {seq} is not divisible by sequence_parallel_size {sp_size}; pad "
            f"the sequences to a multiple of {sp_size} (labels -100 on the padding)"
        )
    whole = dict(batch)
    if "labels" in whole and "shift_labels" not in whole:
        whole["shift_labels"] = _shift(whole["labels"])
    if "position_ids" not in whole:
        whole["position_ids"] = torch.arange(seq, device=ids.device).expand(rows, seq)
    if "attention_mask" in whole:
        _check_attention_mask(whole["attention_mask"], seq)
    chunk = seq // sp_size
    cut = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    sharded: dict[str, Any] = {}
    for key, value in whole.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows:
            if value.shape[1] != seq:
                raise ConfigError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}, but input_ids has {seq} "
                    f"tokens; give every per-token entry the shape [batch, {seq}, ...]"
                )
            value = value[:, cut].contiguous()
        sharded[key] = value
    return sharded


class UlyssesDataLoaderAdapter:
    """Wraps a loader so that each sequence-parallel rank gets its shard of every batch.

    Every rank of an ``sp`` group must read the same batches (the loader ``initialize``
    builds does; a plain loader with the same seed and sampler does too). Iterating yields
    `shard_batch` of each batch, optionally moved to ``device``.

    Args:
        loader: Any re-iterable of dict batches (a ``DataLoader``).
        parallel_dims: The training mesh; its ``sp`` group says the rank and shard count.
        device: Where to move the shard's tensors; None leaves them where they are.

    Example:
        ``for batch in UlyssesDataLoaderAdapter(loader, parallel_dims=dims):
        loss = engine(**batch).loss``
    """

    def __init__(
        self,
        loader: Iterable[Mapping[str, Any]],
        *,
        parallel_dims: ParallelDims,
        device: torch.device | str | None = None,
    ) -> None:
        self.loader = loader
        self.sp_rank = parallel_dims.sp.get_local_rank()
        self.sp_size = parallel_dims.sp.size()
        self.device = None if device is None else torch.device(device)

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.loader:
            if not isinstance(batch, Mapping):
                raise ConfigError(
                    f"UlyssesDataLoaderAdapter needs dict batches (input_ids, labels, ...), got "
                    f"{type(batch).__name__}; return a dict from the collate function"
                )
            shard = shard_batch(batch, sp_rank=self.sp_rank, sp_size=self.sp_size)
            if self.device is not None:
                shard = {
                    k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                    for k, v in shard.items()
                }
            yield shard
