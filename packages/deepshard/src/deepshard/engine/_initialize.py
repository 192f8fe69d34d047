"""`initialize`: build every part of a training run from a model and a config, in order.

1. Check DeepSpeed's extra arguments (`deepshard.engine._arguments`): a model is given, the one
   config comes from ``config``, ``config_params`` or ``args.deepspeed_config``, no ``mpu``.
   Parse the config (a path, a dict or a `DeepShardConfig`) and refuse what the engine cannot
   run (`check_engine_config`); a ``torch.compile(model)`` wrapper is split from the module it
   compiles (`deepshard.engine._compile`). All of this happens before joining the world.
2. Join the world (`deepshard.comm.init_distributed`, as ``dist_init_required`` says) and build
   the mesh from the config's topology, unless the caller passes a mesh.
3. Reconcile the batch sizes for the ranks that read different samples (dp × ep); under
   ``elasticity`` they come from the elastic schedule for that world (`_elastic`).
4. Apply Ulysses when ``sequence_parallel_size`` is above 1 (`deepshard.engine.
   _sequence_parallel`), then AutoEP and AutoTP (`_expert_parallel`, `_tensor_parallel`: they
   write the placements ZeRO shards with; AutoEP first, so AutoTP leaves the experts whole),
   move and cast the model (`Precision`), then build the optimizer on its parameters (the
   caller's wins over the config's), wrap it with ZeRO, and build the LR schedule on the
   wrapper.
5. Build the loss scaler, the counters, the reporter (with the profiler's wall-clock timers),
   the ``flops_profiler`` step profile and, given ``training_data``, the loader.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset

from deepshard.accelerators import get_accelerator
from deepshard.comm import CommsLogger, CommWatchdog, ParallelDims
from deepshard.engine._accumulation import GradientAccumulation
from deepshard.engine._arguments import (
    ConfigSource,
    check_model,
    config_source,
    join_world,
    refuse_model_parallel_objects,
)
from deepshard.engine._checks import check_engine_config
from deepshard.engine._compile import split_compiled
from deepshard.engine._components import (
    OptimizerArg,
    SchedulerArg,
    default_parameters,
    select_optimizer,
    select_scheduler,
)
from deepshard.engine._dataloader import build_dataloader
from deepshard.engine._elastic import engine_batch_sizes
from deepshard.engine._engine import DeepShardEngine, EngineParts
from deepshard.engine._expert_parallel import (
    apply_expert_parallel,
    check_ep_layout,
    with_expert_placements,
)
from deepshard.engine._init_built import check_init_built
from deepshard.engine._logging import announce, log_all_ranks
from deepshard.engine._precision import plan_precision
from deepshard.engine._profiling import StepProfiling
from deepshard.engine._reporting import ProgressReporter, TensorBytes, tensor_bytes
from deepshard.engine._sequence_parallel import apply_sequence_parallel, shard_loader
from deepshard.engine._tensor_parallel import apply_tensor_parallel, check_tp_layout
from deepshard.engine._token_budget_loader import dynamic_batching_loader
from deepshard.engine._zero_wiring import parallel_dims, wrap_with_zero
from deepshard.engine.loss_scaler import build_loss_scaler
from deepshard.interface import BatchSizes, DeepShardConfig, PlacementRegistry
from deepshard.interface.config import CommsLoggerConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.watchdog import resolve_watchdog_s
from deepshard.profiler import GatherWaitSource, WallClockTimers
from deepshard.sequence_parallel import UlyssesDataLoaderAdapter
from deepshard.zero import Stage3Optimizer, ZeroOptimizer

__all__ = ["InitializeResult", "initialize"]


class InitializeResult(NamedTuple):
    """What `initialize` returns; unpack it as ``engine, optimizer, dataloader, lr_scheduler``."""

    engine: DeepShardEngine
    """The training engine (call it, then ``backward`` and ``step``)."""

    optimizer: ZeroOptimizer | None
    """The ZeRO-wrapped optimizer (``param_groups`` are the inner optimizer's); None without
    one."""

    dataloader: DataLoader[Any] | UlyssesDataLoaderAdapter | None
    """This rank's loader over ``training_data`` (with ``sequence_parallel_size`` above 1,
    wrapped to yield this rank's sequence shard); None when no data was given."""

    lr_scheduler: Any
    """The LR schedule the engine steps, or None."""


def _load_config(config: ConfigSource) -> DeepShardConfig:
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


def _timed(config: DeepShardConfig) -> bool:
    # The FLOPs profile prints the step's latencies, so it turns the timers on (as DeepSpeed).
    return config.wall_clock_breakdown or config.flops_profiler.enabled


def _comms_logger(config: DeepShardConfig, rank: int) -> CommsLogger | None:
    # ZeRO threads this logger through every collective it issues, so it also carries the
    # comms watchdog (a disabled logger records nothing and costs nothing).
    seconds = resolve_watchdog_s(config.comms_watchdog_s, os.environ)
    watchdog = None if seconds is None else CommWatchdog(seconds)
    if config.comms_logger.enabled:
        return CommsLogger(config.comms_logger, rank=rank, watchdog=watchdog)
    if _timed(config):  # a logger nobody prints: the timers read the step's reductions from it
        return CommsLogger(CommsLoggerConfig(enabled=True), rank=rank, watchdog=watchdog)
    if watchdog is not None:
        return CommsLogger(CommsLoggerConfig(enabled=False), rank=rank, watchdog=watchdog)
    return None


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    accelerator = get_accelerator(device.type)
    return lambda: accelerator.synchronize(device)


def _reporter(
    config: DeepShardConfig,
    *,
    rank: int,
    train_batch_size: int,
    device: torch.device,
    comms_logger: CommsLogger | None,
    memory: Callable[[], TensorBytes],
    gathers: GatherWaitSource | None,
) -> ProgressReporter:
    timers = WallClockTimers(
        enabled=_timed(config),
        synchronize=_synchronizer(device),
        comms=comms_logger,
        gathers=gathers,
    )
    return ProgressReporter(
        steps_per_print=config.steps_per_print,
        rank=rank,
        train_batch_size=train_batch_size,
        timers=timers,
        comms_logger=comms_logger,
        print_comms=config.comms_logger.enabled,
        memory=memory if config.memory_breakdown else None,
        all_ranks=log_all_ranks(os.environ),
    )


def _loader(
    data: Dataset[Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    config: DeepShardConfig,
    batch: BatchSizes,
    dims: ParallelDims,
) -> DataLoader[Any] | None:
    if data is None:
        return None
    if config.data_efficiency.data_sampling.dynamic_batching.enabled:
        return dynamic_batching_loader(
            data, config.data_efficiency, batch, rank=dims.batch_rank,
            ranks=dims.batch_world_size, collate_fn=collate_fn,
        )  # fmt: skip
    return build_dataloader(
        data,
        micro_batch_size=batch.train_micro_batch_size_per_gpu,
        batch_rank=dims.batch_rank,
        batch_world_size=dims.batch_world_size,
        collate_fn=collate_fn,
        drop_last=config.dataloader_drop_last,
    )


def initialize(
    model: torch.nn.Module | None = None,
    config: ConfigSource | None = None,
    optimizer: OptimizerArg = None,
    model_parameters: Iterable[Any] | None = None,
    lr_scheduler: SchedulerArg = None,
    training_data: Dataset[Any] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    mesh: DeviceMesh | ParallelDims | None = None,
    *,
    args: Any = None,
    config_params: ConfigSource | None = None,
    dist_init_required: bool | None = None,
    distributed_port: int | None = None,
    mpu: Any = None,
    mesh_param: Any = None,
    placements: PlacementRegistry | None = None,
) -> InitializeResult:
    """Builds the training engine, optimizer, data loader and LR schedule for ``model``.

    Every rank calls it with the same config and an identically initialised model. Every
    argument of DeepSpeed 0.19.7's ``deepspeed.initialize`` is accepted by keyword
    (``initialize(args=args, model=net, model_parameters=params, training_data=data)``); the
    positional order is DeepShard's (``initialize(model, config)``).

    Args:
        model: The model to train. It is moved to the training device and cast to the
            training dtype in place (its parameter objects are kept). A
            ``torch.compile(model)`` wrapper trains the model it wraps (``engine.module``),
            the engine's forward calling the wrapper.
        config: A DeepSpeed-style config: a JSON/HJSON file path, a dict or a
            `DeepShardConfig`. When None, ``config_params`` or ``args`` names it.
        optimizer: An optimizer built on the model's parameters, or a callable building one
            from ``model_parameters``; wins over the config's ``optimizer`` section.
        model_parameters: What the optimizer trains (parameters or param groups); defaults to
            ``model.parameters()``.
        lr_scheduler: An LR schedule, or a callable building one from the wrapped optimizer;
            wins over the config's ``scheduler`` section.
        training_data: A map-style dataset to build a distributed data loader over.
        collate_fn: The loader's collate function.
        mesh: The device mesh (from `deepshard.comm.build_mesh`) or a
            `deepshard.comm.ParallelDims`. When None, the process joins the world with
            `deepshard.comm.init_distributed` and ``ParallelDims.build`` builds the mesh and its
            groups from the config's topology.
        args: The script's parsed arguments: ``args.deepspeed_config`` or
            ``args.deepshard_config`` (see `add_config_arguments`) names the config file when
            ``config`` is not given.
        config_params: DeepSpeed's older name for ``config`` (give one of the two).
        dist_init_required: None or True: join the world unless the default process group
            exists; False: it must exist already.
        distributed_port: Rank 0's port, used where the launcher set no ``MASTER_PORT``.
        mpu: Refused: DeepShard builds its process groups from the config's layout
            (``tensor_parallel.autotp_size``, ``sequence_parallel_size``, ``moe``).
        mesh_param: Refused likewise (set ``sequence_parallel_size``).
        placements: The model's `deepshard.interface.PlacementRegistry` (from AutoTP/AutoEP
            or by hand: expert parameters reduced over ``dp``), passed to
            ``deepshard.zero.shard`` at every stage; ``None``: every parameter whole on every
            rank. It must be keyed by the model's parameter names and built for the mesh's
            topology. Not with ``expert_parallel.enabled`` or ``autotp_size > 1``, which write
            the placements themselves.

    Returns:
        ``(engine, optimizer, dataloader, lr_scheduler)``.

    Raises:
        ConfigError: No model; no config, two of them, or a config file that does not exist;
            an ``mpu``; the config is invalid or asks for something the engine does not run; the
            batch sizes disagree with the world; the optimizer, schedule or ZeRO settings are
            refused; ``placements`` does not fit the model or mesh; ``expert_parallel.
            autoep_size`` differs from the mesh's ``ep`` or does not divide a block's experts.
            Each problem names its key.
        TopologyError: The world does not fit the config's parallel degrees or the mesh.
        CommError: ``dist_init_required=False`` without a process group, or the rendezvous
            failed.
    """
    model = check_model(model)
    refuse_model_parallel_objects(mpu, mesh_param)
    parsed = _load_config(config_source(config, config_params, args))
    check_engine_config(parsed)
    model, compiled = split_compiled(model, stage=parsed.zero_optimization.stage)
    world = join_world(dist_init_required if mesh is None else False, distributed_port)
    if mesh is None:
        check_tp_layout(parsed, world_size=world.world_size)
        dims = ParallelDims.build(parsed.topology(world.world_size))
    else:
        dims = parallel_dims(mesh)
        check_tp_layout(parsed, dims=dims)
    batch = engine_batch_sizes(parsed, dims.batch_world_size)
    announce(parsed, rank=dims.rank, environ=os.environ)
    device = _device(dims.mesh)
    precision = plan_precision(parsed, device.type)
    check_init_built(model, parsed, dims=dims, param_dtype=precision.param_dtype, device=device)
    apply_sequence_parallel(model, parsed, dims=dims)
    if placements is not None and dims.topology.tp > 1:  # before the model is split
        raise ConfigError(
            "initialize(placements=) together with tensor_parallel.autotp_size > 1: AutoTP "
            "writes the placements of the model it splits; drop the argument"
        )
    check_ep_layout(parsed, dims=dims, placements=placements)
    # AutoEP first: AutoTP then plans only the dense layers and leaves the expert stacks whole.
    ep = apply_expert_parallel(
        model, parsed, dims=dims, optimizer=optimizer, model_parameters=model_parameters
    )
    model_parameters = ep.model_parameters
    parallel = with_expert_placements(apply_tensor_parallel(model, parsed, dims=dims), ep)
    placements = parallel if parallel is not None else placements
    precision.cast_model(model, device)
    comms = _comms_logger(parsed, dims.rank)
    params = default_parameters(model, parsed) if model_parameters is None else model_parameters
    base = select_optimizer(optimizer, params, parsed, module=model)
    zero = None
    if base is not None:
        zero = wrap_with_zero(
            base, parsed, dims=dims, module=model, comms_logger=comms, placements=placements
        )
    schedule = select_scheduler(lr_scheduler, zero, parsed)
    parts = EngineParts(
        config=parsed,
        batch=batch,
        dims=dims,
        device=device,
        precision=precision,
        optimizer=zero,
        lr_scheduler=schedule,
        loss_scaler=build_loss_scaler(parsed.fp16, scaled=precision.loss_scaled),
        accumulation=GradientAccumulation(
            batch.gradient_accumulation_steps,
            batch.train_batch_size,
            managed=parsed.managed_gradient_accumulation,
        ),
        reporter=_reporter(
            parsed,
            rank=dims.rank,
            train_batch_size=batch.train_batch_size,
            device=device,
            comms_logger=comms,
            memory=lambda: tensor_bytes(model, zero),
            # stage 3: the breakdown shows how much of the parameter gathers was exposed
            gathers=zero.sharded.gather_waits if isinstance(zero, Stage3Optimizer) else None,
        ),
        comms_logger=comms,
        world=world,
        profiling=StepProfiling(
            parsed.flops_profiler,
            module=model,
            rank=dims.rank,
            world_size=dims.mesh.size(),
            dp_size=dims.batch_world_size,
            batch=batch,
            # stage-3 parameters are empty between uses: count them at their full size
            param_numel=(
                (lambda p: zero.sharded.shard_info(p).numel)
                if isinstance(zero, Stage3Optimizer)
                else None
            ),
            # stage 3 gathers parameters in module hooks: a replay must not run them again
            count_mode="eager" if isinstance(zero, Stage3Optimizer) else "auto",
        ),
    )
    built = _loader(training_data, collate_fn, parsed, batch, dims)
    engine = DeepShardEngine(model, parts, compiled_forward=compiled)
    engine._random_ltd_at_initialize()
    # the built loader's sampler position goes into checkpoints (under sp the caller iterates
    # the sequence-sharding adapter around it)
    engine.training_dataloader = built
    return InitializeResult(engine, zero, shard_loader(built, dims=dims), schedule)
