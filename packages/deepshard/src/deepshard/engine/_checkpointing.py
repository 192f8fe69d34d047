"""``engine.save_checkpoint`` / ``engine.load_checkpoint`` (a mixin of the engine).

A save collects every tensor (`deepshard.engine._checkpoint_state`: ZeRO's `state_shards`, the
rest of the module, each rank's RNG rows, ``client_state`` tensors) and the engine's JSON state,
and hands them to `deepshard.checkpoint.save`, which writes them atomically as safetensors and
JSON and, with ``checkpoint.async_save``, on a background thread from a host snapshot (the next
save or load waits for it and raises its error). A load fills the same tensors in place from a
checkpoint of any stage, world size and layout (`deepshard.checkpoint.load` reshards), then
ZeRO writes back what is not live (offloaded state) and refreshes the model from the masters.

The default tag is ``global_step<N>``. With ``checkpoint.tag_validation`` other than ``IGNORE``
the ranks compare a hash of the tag before writing anything (one all-reduce); ``FAIL`` raises,
``WARN`` logs and saves under rank 0's tag (every rank writes one checkpoint together, so it
needs one name). ``IGNORE`` trusts the caller, as in DeepSpeed.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from deepshard.checkpoint import (
    SaveHandle,
    join_client_state,
    load,
    prepare_async_save,
    read_metadata,
    save,
    split_client_state,
)
from deepshard.comm import all_reduce, broadcast
from deepshard.engine import _checkpoint_state as ck
from deepshard.engine import _engine_json
from deepshard.engine._rng_state import RNG_PREFIX, capture_rng, restore_rng
from deepshard.interface.errors import CheckpointError, PartialLoadError

if TYPE_CHECKING:
    from deepshard.engine._engine import EngineParts
    from deepshard.engine.random_ltd import RandomLtdScheduler
    from deepshard.zero import ZeroOptimizer

__all__ = ["EngineCheckpointing"]

_LOG = logging.getLogger("deepshard.engine")
_CLIENT = "client_state"


class EngineCheckpointing:
    """Saving and loading the whole training state (the engine sets the attributes below)."""

    module: torch.nn.Module
    parts: EngineParts
    optimizer: ZeroOptimizer | None
    device: torch.device
    training_dataloader: Any
    random_ltd_scheduler: RandomLtdScheduler | None
    _pending_save: SaveHandle | None
    _save_prepared: bool
    _load_failure: str | None

    @property
    def _ckpt_group(self) -> dist.ProcessGroup | None:
        """The ranks a checkpoint is written by: ZeRO's group, or the world under tensor
        parallelism (ZeRO's maps then span dp × tp, `deepshard.zero._tp_maps`)."""
        if self.optimizer is not None:
            group = self.optimizer.partition_group
            tp = self.parts.dims.topology.tp
            if tp > 1 and group.size() * tp == self.parts.world.world_size:
                return self.parts.dims.world.get_group()
            if group.size() != self.parts.world.world_size:
                raise CheckpointError(
                    "engine checkpoints cover one data-parallel group spanning the world; this "
                    "run's ZeRO group is smaller (tensor/pipeline parallelism is not wired yet)"
                )
            return group
        return self.parts.dims.world.get_group() if dist.is_initialized() else None

    def _rank_and_size(self) -> tuple[int, int]:
        group = self._ckpt_group
        return (0, 1) if group is None else (group.rank(), group.size())

    def _validate_tag(self, tag: str) -> str:
        """The tag every rank saves under (see the module); refuses or warns on a mismatch."""
        mode = self.parts.config.checkpoint.tag_validation
        group = self._ckpt_group
        if mode == "IGNORE" or group is None or group.size() == 1:
            return tag
        digest = int.from_bytes(hashlib.sha256(tag.encode()).digest()[:7], "big")
        both = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        all_reduce(both, group=group, op="max")
        if int(both[0]) == -int(both[1]):
            return tag
        message = (
            f"checkpoint tag {tag!r} differs across ranks (checkpoint.tag_validation={mode}); "
            "pass the same tag on every rank (e.g. derived from engine.global_steps)"
        )
        if mode == "FAIL":
            raise CheckpointError(message)
        _LOG.warning("%s; saving under rank 0's tag", message)
        return self._rank0_tag(tag, group)

    def _rank0_tag(self, tag: str, group: dist.ProcessGroup) -> str:
        """Rank 0's ``tag`` on every rank (its UTF-8 bytes broadcast, padded to 4 KiB)."""
        data = tag.encode()[:4096]
        payload = torch.zeros(4096, dtype=torch.uint8)
        payload[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
        length = torch.tensor([len(data)], dtype=torch.int64)
        length, payload = length.to(self.device), payload.to(self.device)
        broadcast(length, group_src=0, group=group)
        broadcast(payload, group_src=0, group=group)
        return bytes(payload[: int(length)].cpu().tolist()).decode()

    def _prepare_background_save(self) -> None:
        """With ``checkpoint.async_save``, ready a first save's host buffers on a helper thread.

        Called after each applied optimizer step; acts once, after the first (the optimizer
        state exists from then on). The first background save then only copies into them,
        instead of blocking on fresh memory's page faults (`prepare_async_save`).
        """
        if self._save_prepared or not self.parts.config.checkpoint.async_save:
            return
        self._save_prepared = True
        if self._pending_save is None:  # else a save ran already and left its buffers
            rank, world = self._rank_and_size()
            tensors = ck.engine_tensors(self.module, self.optimizer)
            state: dict[str, Any] = {**tensors.module, **tensors.optimizer}
            state.update(ck.rng_tensors(capture_rng(self.device.type), rank, world))
            self._pending_save = prepare_async_save(state, group=self._ckpt_group)

    def _require_loaded(self, call: str) -> None:
        """Refuse ``call`` after a ``load_checkpoint`` that failed once it had begun filling."""
        if self._load_failure is not None:
            raise CheckpointError(
                f"{call}: the last engine.load_checkpoint failed after it had started filling "
                f"the engine's tensors ({self._load_failure}), so they are partly overwritten; "
                "load a good checkpoint with engine.load_checkpoint, or build a new engine"
            )

    def _wait_for_save(self) -> None:
        if self._pending_save is not None:
            handle, self._pending_save = self._pending_save, None
            handle.wait()

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """Save the whole training state to ``save_dir/<tag>/``; every rank must call it.

        Args:
            save_dir: The checkpoint directory (shared by every rank).
            tag: The checkpoint's name; ``global_step<N>`` by default.
            client_state: The caller's own state: JSON values and tensors, any nesting of
                dicts and lists (anything else is refused, naming its key path).
            save_latest: Point ``latest`` at this checkpoint once it is complete.
            exclude_frozen_parameters: Leave out parameters with ``requires_grad=False``.

        Returns:
            True (DeepSpeed's answer); with ``checkpoint.async_save`` the files are written in
            the background (the next save, a load or process exit waits for them).

        Raises:
            CheckpointError: A tag that differs across ranks under ``tag_validation: FAIL``,
                a bad ``client_state`` or schedule state, or a failed (earlier) save.
        """
        self._require_loaded("engine.save_checkpoint()")
        tag = f"global_step{self.parts.accumulation.global_steps}" if tag is None else str(tag)
        tag = self._validate_tag(tag)
        rank, world = self._rank_and_size()
        client_json, client_tensors = split_client_state(client_state or {}, prefix=_CLIENT)
        tensors = ck.engine_tensors(
            self.module, self.optimizer, exclude_frozen=exclude_frozen_parameters
        )
        state: dict[str, Any] = {**tensors.module, **tensors.optimizer, **client_tensors}
        state.update(ck.rng_tensors(capture_rng(self.device.type), rank, world))
        metadata = _engine_json.engine_metadata(
            self, tag, client_json, exclude_frozen=exclude_frozen_parameters
        )
        section = self.parts.config.checkpoint
        handle = save(
            state,
            save_dir,
            tag=tag,
            metadata={"engine": metadata},
            group=self._ckpt_group,
            save_latest=save_latest,
            keep_last=section.keep_last,
            async_save=section.async_save,
            after=self._pending_save,
        )
        self._pending_save = handle if section.async_save else None
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        load_module_strict: bool = True,
    ) -> tuple[str, Any]:
        """Restore a checkpoint of any ZeRO stage, world size and layout; every rank calls it.

        Args:
            load_dir: The checkpoint directory.
            tag: The tag to read; ``None`` reads the one ``latest`` names.
            load_optimizer_states: Restore the optimizer state (moments, steps, param-group
                hyper-parameters); False keeps the fresh state.
            load_lr_scheduler_states: Restore the LR schedule.
            load_module_only: Restore only the model's weights (no optimizer state, schedule,
                counters, loss scale, RNG or data position).
            load_module_strict: Refuse a checkpoint lacking or adding module tensors.

        Returns:
            ``(path of the tag directory, client_state)``.

        Raises:
            CheckpointError: No ``latest`` and no tag (the message lists the tags), damaged
                files, missing tensors, or a checkpoint not written by an engine. When it is
                raised after the load had started filling the engine's tensors (a
                `PartialLoadError`, a damaged block found where it landed, or missing tensors
                found after the others were filled), ``forward``, ``step`` and
                ``save_checkpoint`` refuse to run until a later load succeeds.
        """
        self._wait_for_save()
        meta = read_metadata(load_dir, tag)
        saved = meta.get("metadata", {}).get("engine")
        if not isinstance(saved, dict):
            raise CheckpointError(
                f"{load_dir} (tag {tag!r}) was not written by engine.save_checkpoint; read it "
                "with deepshard.checkpoint.load or load_state_dict_from_checkpoint"
            )
        zero = self.optimizer
        with_optimizer = load_optimizer_states and not load_module_only and zero is not None
        if with_optimizer and zero is not None:
            zero.materialize_state()
        tensors = ck.engine_tensors(self.module, zero)
        like: dict[str, Any] = {**tensors.module, **(tensors.optimizer if with_optimizer else {})}
        streams = {} if load_module_only else self._rng_like(meta)
        like.update(streams)
        for key in meta.get("tensors", {}):
            shape = ck.saved_shape(meta, key)
            if key.startswith(f"{_CLIENT}/") and shape is not None:
                like[key] = torch.empty(shape[0], dtype=_engine_json.torch_dtype(shape[1]))
        try:
            result = load(load_dir, like, tag=tag, group=self._ckpt_group, strict=False)
        except PartialLoadError as exc:
            self._load_failure = str(exc)
            raise
        # From here on the tensors hold the checkpoint's bytes: a failure leaves the engine
        # between two states, and training refuses to go on until a load succeeds.
        try:
            self._check_result(result.missing, result.unexpected, tensors, with_optimizer,
                               load_module_strict)  # fmt: skip
            if zero is not None:
                filled = {
                    zero_key: like[key].local
                    for key, zero_key in tensors.zero_keys.items()
                    if key in like and key not in result.missing
                }
                zero.load_state_shards(filled)
            if not load_module_only and "imported_from" in meta["metadata"]:
                _engine_json.restore_imported(self, saved)
            elif not load_module_only:
                _engine_json.restore(self, saved, optimizer=with_optimizer,
                                     scheduler=load_lr_scheduler_states)  # fmt: skip
                rows = {k.removeprefix(RNG_PREFIX): like[k].local for k in streams}
                restore_rng(rows, self.device.type)
            client = {k: like[k] for k in like if k.startswith(f"{_CLIENT}/")}
        except BaseException as exc:
            self._load_failure = f"{type(exc).__name__}: {exc}"
            raise
        self._load_failure = None
        return str(result.path), join_client_state(saved.get(_CLIENT, {}), client)

    def _rng_like(self, meta: dict[str, Any]) -> dict[str, Any]:
        """Targets for this rank's RNG rows when the checkpoint has rows of this world size."""
        rank, world = self._rank_and_size()
        targets = ck.rng_tensors(capture_rng(self.device.type), rank, world)
        fits = {
            key: value
            for key, value in targets.items()
            if ck.saved_shape(meta, key) == (value.shard_map.global_shape, value.shard_map.dtype)
        }
        if len(fits) < len(targets):
            _LOG.info("checkpoint RNG states are from another world size; not restored")
            return {}
        return fits

    def _check_result(
        self,
        missing: tuple[str, ...],
        unexpected: tuple[str, ...],
        tensors: ck.EngineTensors,
        with_optimizer: bool,
        strict: bool,
    ) -> None:
        ck.check_loaded(
            tensors.module, missing, strict=strict, what="module tensors",
            fix="load_module_strict=False loads the others",
        )  # fmt: skip
        extra = sorted(k for k in unexpected if k.startswith(ck.MODULE))
        if extra and strict:
            raise CheckpointError(
                f"the checkpoint has module tensors this model lacks: {extra[:5]}; "
                "load_module_strict=False ignores them"
            )
        if with_optimizer:
            ck.check_loaded(
                tensors.optimizer, missing, strict=True, what="optimizer state tensors",
                fix="load_optimizer_states=False keeps the fresh optimizer state",
            )  # fmt: skip
