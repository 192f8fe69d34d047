"""`initialize`: build every part of a training run from a model and a config, in order.

1. Parse the config (a path, a dict or a `DeepShardConfig`) and refuse what the engine cannot
   run (`check_engine_config`).
2. Join the world (`deepshard.comm.init_distributed`) and build the mesh from the config's
   topology, unless the caller passes a mesh.
3. Reconcile the batch sizes for the ranks that read different samples (dp × ep).
4. Move and cast the model (`Precision`), then build the optimizer on its parameters (the
   caller's wins over the config's), wrap it with ZeRO, and build the LR schedule on the wrapper.
5. Build the loss scaler, the counters, the reporter and, given ``training_data``, the loader.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from deepshard.accelerators import get_accelerator
from deepshard.comm import CommsLogger, CommWatchdog, build_mesh, init_distributed
from deepshard.engine._accumulation import GradientAccumulation
from deepshard.engine._checks import check_engine_config, ignored_settings
from deepshard.engine._components import (
    OptimizerArg,
    SchedulerArg,
    default_parameters,
    select_optimizer,
    select_scheduler,
)
from deepshard.engine._dataloader import build_dataloader
from deepshard.engine._engine import DeepShardEngine, EngineParts
from deepshard.engine._precision import plan_precision
from deepshard.engine._reporting import (
    REDUCE_LOG_NAMES,
    PhaseTimers,
    ProgressReporter,
    TensorBytes,
    tensor_bytes,
)
from deepshard.engine._zero_wiring import MeshRanks, wrap_with_zero
from deepshard.engine.loss_scaler import build_loss_scaler
from deepshard.interface import BatchSizes, DeepShardConfig
from deepshard.interface.config import CommsLoggerConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.watchdog import resolve_watchdog_s
from deepshard.zero import ZeroOptimizer

__all__ = ["InitializeResult", "initialize"]

_log = logging.getLogger("deepshard.engine")


class InitializeResult(NamedTuple):
    """What `initialize` returns; unpack it as ``engine, optimizer, dataloader, lr_scheduler``."""

    engine: DeepShardEngine
    """The training engine (call it, then ``backward`` and ``step``)."""

    optimizer: ZeroOptimizer | None
    """The ZeRO-wrapped optimizer (``param_groups`` are the inner optimizer's); None without
    one."""

    dataloader: DataLoader[Any] | None
    """This rank's loader over ``training_data``; None when no data was given."""

    lr_scheduler: Any
    """The LR schedule the engine steps, or None."""


def _load_config(config: str | Path | dict[str, Any] | DeepShardConfig) -> DeepShardConfig:
    if isinstance(config, DeepShardConfig):
        return config
    if isinstance(config, dict):
        return DeepShardConfig.from_dict(config)
    if isinstance(config, (str, Path)):
        return DeepShardConfig.from_file(config)
    raise ConfigError(
        f"config must be a path, a dict or a DeepShardConfig, got {type(config).__name__}"
    )


def _device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return get_accelerator(mesh.device_type).current_device()


def _comms_logger(config: DeepShardConfig, rank: int) -> CommsLogger | None:
    # ZeRO threads this logger through every collective it issues, so it also carries the
    # comms watchdog (a disabled logger records nothing and costs nothing).
    seconds = resolve_watchdog_s(config.comms_watchdog_s, os.environ)
    watchdog = None if seconds is None else CommWatchdog(seconds)
    if config.comms_logger.enabled:
        return CommsLogger(config.comms_logger, rank=rank, watchdog=watchdog)
    if config.wall_clock_breakdown:  # only ZeRO's reductions, for the "reduce" timer
        quiet = CommsLoggerConfig(enabled=True, prof_all=False, prof_ops=list(REDUCE_LOG_NAMES))
        return CommsLogger(quiet, rank=rank, watchdog=watchdog)
    if watchdog is not None:
        return CommsLogger(CommsLoggerConfig(enabled=False), rank=rank, watchdog=watchdog)
    return None


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    accelerator = get_accelerator(device.type)
    return lambda: accelerator.synchronize(device)


def _announce(config: DeepShardConfig, rank: int) -> None:
    if config.log_level is not None:
        logging.getLogger("deepshard").setLevel(config.log_level.upper())
    if rank != 0:
        return
    for line in ignored_settings(config):
        _log.warning("%s", line)
    if config.dump_state:
        _log.info("config: %s", config.to_dict(exclude_defaults=True))


def _reporter(
    config: DeepShardConfig,
    *,
    rank: int,
    train_batch_size: int,
    device: torch.device,
    comms_logger: CommsLogger | None,
    memory: Callable[[], TensorBytes],
) -> ProgressReporter:
    timers = PhaseTimers(
        enabled=config.wall_clock_breakdown,
        synchronize=_synchronizer(device),
        comms_logger=comms_logger,
    )
    return ProgressReporter(
        steps_per_print=config.steps_per_print,
        rank=rank,
        train_batch_size=train_batch_size,
        timers=timers,
        comms_logger=comms_logger,
        print_comms=config.comms_logger.enabled,
        memory=memory if config.memory_breakdown else None,
    )


def _loader(
    data: Dataset[Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    config: DeepShardConfig,
    batch: BatchSizes,
    ranks: MeshRanks,
) -> DataLoader[Any] | None:
    if data is None:
        return None
    return build_dataloader(
        data,
        micro_batch_size=batch.train_micro_batch_size_per_gpu,
        batch_rank=ranks.batch_rank,
        batch_world_size=ranks.batch_world_size,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
    )


def initialize(
    model: torch.nn.Module,
    config: str | Path | dict[str, Any] | DeepShardConfig,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: SchedulerArg = None,
    training_data: Dataset[Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    mesh: DeviceMesh | None = None,
) -> InitializeResult:
    """Builds the training engine, optimizer, data loader and LR schedule for ``model``.

    Every rank calls it with the same config and an identically initialised model.

    Args:
        model: The model to train. It is moved to the training device and cast to the
            training dtype in place (its parameter objects are kept).
        config: A DeepSpeed-style config: a JSON/HJSON file path, a dict or a
            `DeepShardConfig`.
        optimizer: An optimizer built on the model's parameters, or a callable building one
            from ``model_parameters``; wins over the config's ``optimizer`` section.
        model_parameters: What the optimizer trains (parameters or param groups); defaults to
            ``model.parameters()``.
        lr_scheduler: An LR schedule, or a callable building one from the wrapped optimizer;
            wins over the config's ``scheduler`` section.
        training_data: A map-style dataset to build a distributed data loader over.
        collate_fn: The loader's collate function.
        mesh: The device mesh (axes named as `deepshard.interface.Topology.AXES`). When None,
            the process joins the world with `deepshard.comm.init_distributed` and the mesh is
            built from the config's topology.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``.

    Raises:
        ConfigError: The config is invalid or asks for something the engine does not run; the
            batch sizes disagree with the world; the optimizer, schedule or ZeRO settings are
            refused. Each problem names its key.
        TopologyError: The world does not fit the config's parallel degrees or the mesh.
    """
    parsed = _load_config(config)
    check_engine_config(parsed)
    if mesh is None:
        mesh = build_mesh(parsed.topology(init_distributed().world_size))
    ranks = MeshRanks(mesh)
    batch = parsed.resolve_batch(ranks.batch_world_size)
    _announce(parsed, ranks.global_rank)
    device = _device(mesh)
    precision = plan_precision(parsed, device.type)
    precision.cast_model(model, device)
    comms = _comms_logger(parsed, ranks.global_rank)
    params = default_parameters(model, parsed) if model_parameters is None else model_parameters
    base = select_optimizer(optimizer, params, parsed)
    zero = None
    if base is not None:
        zero = wrap_with_zero(base, parsed, mesh=mesh, module=model, comms_logger=comms)
    schedule = select_scheduler(lr_scheduler, zero, parsed)
    parts = EngineParts(
        config=parsed,
        batch=batch,
        mesh=mesh,
        device=device,
        precision=precision,
        optimizer=zero,
        lr_scheduler=schedule,
        loss_scaler=build_loss_scaler(parsed.fp16, scaled=precision.loss_scaled),
        accumulation=GradientAccumulation(
            batch.gradient_accumulation_steps, batch.train_batch_size
        ),
        reporter=_reporter(
            parsed,
            rank=ranks.global_rank,
            train_batch_size=batch.train_batch_size,
            device=device,
            comms_logger=comms,
            memory=lambda: tensor_bytes(model, zero),
        ),
        comms_logger=comms,
    )
    loader = _loader(training_data, collate_fn, parsed, batch, ranks)
    return InitializeResult(DeepShardEngine(model, parts), zero, loader, schedule)
