"""The JSON part of an engine checkpoint: counters, schedule, loss scale, data position, config.

Saved under the metadata's ``"engine"`` key by `engine_metadata` and put back by `restore`:

* ``counters``: micro steps, global steps, samples and skipped steps (`_accumulation`);
* ``lr_scheduler`` and ``loss_scaler``: their ``state_dict()`` (JSON by construction; a
  client's schedule whose state is not JSON is refused by name);
* ``param_groups``: each inner param group's hyper-parameters (``lr``, ``betas``...), which a
  schedule or the caller may have changed since the optimizer was built;
* ``dataloader``: the engine's data loader's epoch and samples consumed in it, per rank (a
  load at another world size keeps the same share of the epoch's permutation), or the groups
  consumed by a dynamic-batching loader;
* ``random_ltd``: the random-LTD schedule's kept-token count and consumed layer-tokens;
* ``config``, ``topology``, ``zero_stage`` and ``world_size``: for reading, not for loading;
* ``client_state``: the JSON part of the caller's ``client_state``.

A checkpoint ``ds-checkpoint import-deepspeed`` wrote has only DeepSpeed's counters there
(``global_steps``, ``global_samples``, ``skipped_steps``) and each param group's names;
`restore_imported` puts back the counters and leaves the rest as the config built it.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import torch

from deepshard.interface.errors import CheckpointError

if TYPE_CHECKING:
    from deepshard.engine._checkpointing import EngineCheckpointing

__all__ = ["engine_metadata", "restore", "restore_imported", "torch_dtype"]

FORMAT = 1
"""Version of the ``engine`` metadata."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (``"float32"``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"the checkpoint names an unknown dtype {name!r}")
    return dtype


def _json_ready(value: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON data ({exc}); checkpoints never pickle, so it cannot be saved"
        ) from exc


def _readable(value: Any) -> Any:
    """``value`` with non-finite floats as strings (``"inf"``): the config is stored for
    reading, and JSON has no infinities."""
    if isinstance(value, dict):
        return {k: _readable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_readable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _hyper(value: Any) -> bool:
    """Whether a param-group value is a JSON hyper-parameter (not tensors, not callables)."""
    if isinstance(value, (list, tuple)):
        return all(_hyper(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def _param_groups(engine: EngineCheckpointing) -> list[dict[str, Any]]:
    zero = engine.optimizer
    if zero is None:
        return []
    return [
        {k: v for k, v in group.items() if k != "params" and _hyper(v)}
        for group in zero.param_groups
    ]


def _sampler(engine: EngineCheckpointing) -> Any:
    """The loader's resumable sampler: its batch sampler (dynamic batching) or its sampler."""
    loader = engine.training_dataloader
    for sampler in (getattr(loader, "batch_sampler", None), getattr(loader, "sampler", None)):
        if hasattr(sampler, "load_state_dict"):
            return sampler
    return None


def engine_metadata(
    engine: EngineCheckpointing, tag: str, client_json: Any, *, exclude_frozen: bool
) -> dict[str, Any]:
    """Everything of the engine that is not a tensor, as JSON.

    Raises:
        CheckpointError: The LR schedule's state is not JSON data.
    """
    parts = engine.parts
    topology = parts.dims.topology
    scheduler = parts.lr_scheduler
    sampler = _sampler(engine)
    ltd = engine.random_ltd_scheduler
    return {
        "format": FORMAT,
        "tag": tag,
        "config": _json_ready(_readable(parts.config.to_dict()), "the config"),
        "topology": dict(zip(topology.axis_names, topology.shape, strict=True)),
        "world_size": parts.world.world_size,
        "batch_world_size": parts.dims.batch_world_size,
        "zero_stage": None if engine.optimizer is None else engine.optimizer.stage,
        "counters": parts.accumulation.state_dict(),
        "lr_scheduler": None
        if scheduler is None
        else _json_ready(scheduler.state_dict(), f"the LR schedule's state ({type(scheduler)})"),
        "loss_scaler": parts.loss_scaler.state_dict(),
        "param_groups": _json_ready(_param_groups(engine), "the param groups' hyper-parameters"),
        "dataloader": None if sampler is None else sampler.state_dict(),
        "random_ltd": None if ltd is None else ltd.state_dict(),
        "exclude_frozen_parameters": exclude_frozen,
        "client_state": client_json,
    }


def _restore_param_groups(
    engine: EngineCheckpointing, saved: list[dict[str, Any]], *, lr_only: bool
) -> None:
    zero = engine.optimizer
    if zero is None:
        return
    groups = zero.param_groups
    if len(saved) != len(groups):
        raise CheckpointError(
            f"the checkpoint has {len(saved)} param groups, this optimizer {len(groups)}; build "
            "the optimizer with the same groups, or pass load_optimizer_states=False"
        )
    for group, values in zip(groups, saved, strict=True):
        for key, value in values.items():
            if lr_only and key != "lr":
                continue
            group[key] = tuple(value) if isinstance(group.get(key), tuple) else value


def restore(
    engine: EngineCheckpointing, saved: dict[str, Any], *, optimizer: bool, scheduler: bool
) -> None:
    """Put the counters, loss scale, schedule, hyper-parameters and data position back.

    Args:
        engine: The engine.
        saved: The metadata's ``engine`` entry.
        optimizer: Restore the param groups' hyper-parameters.
        scheduler: Restore the LR schedule (and the groups' ``lr``).

    Raises:
        CheckpointError: An entry is missing or does not fit this engine.
    """
    parts = engine.parts
    try:
        parts.accumulation.load_state_dict(saved["counters"])
        parts.loss_scaler.load_state_dict(saved["loss_scaler"])
        if scheduler and parts.lr_scheduler is not None and saved["lr_scheduler"] is not None:
            parts.lr_scheduler.load_state_dict(saved["lr_scheduler"])
        if optimizer or scheduler:
            _restore_param_groups(engine, saved["param_groups"], lr_only=not optimizer)
        ltd, ltd_state = engine.random_ltd_scheduler, saved.get("random_ltd")
        if ltd is not None and ltd_state is not None:
            ltd.load_state_dict(ltd_state)
        sampler, position = _sampler(engine), saved.get("dataloader")
        if sampler is not None and position is not None:
            scale = (saved["batch_world_size"], parts.dims.batch_world_size)
            sampler.load_state_dict(position, world_sizes=scale)
    except KeyError as exc:
        raise CheckpointError(
            f"the checkpoint's engine metadata lacks {exc}; it was written by another version"
        ) from exc


def restore_imported(engine: EngineCheckpointing, saved: dict[str, Any]) -> None:
    """Put back the counters of a checkpoint imported from DeepSpeed.

    DeepSpeed saves no micro-step count: it is ``global_steps`` times the accumulation steps,
    as for any run that resumes at a boundary. The schedule, loss scale, param-group
    hyper-parameters and data position stay as this engine's config built them (DeepSpeed
    pickles them, and the import reads no pickles).

    Raises:
        CheckpointError: A counter is missing or not a number.
    """
    accumulation = engine.parts.accumulation
    try:
        steps = int(saved["global_steps"])
        accumulation.load_state_dict(
            {
                "micro_steps": steps * accumulation.steps,
                "global_steps": steps,
                "global_samples": int(saved["global_samples"]),
                "skipped_steps": int(saved["skipped_steps"]),
            }
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(
            f"the imported checkpoint's engine metadata has no usable counter ({exc!r}); "
            "import it again with this version's ds-checkpoint import-deepspeed"
        ) from exc
