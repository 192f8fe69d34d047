"""What a DeepSpeed script passes besides the model: command-line flags and ``initialize``'s extras.

A DeepSpeed script adds the config flags to its parser (`add_config_arguments`), parses them and
hands the namespace to ``initialize(args=...)``; the config file then comes from
``args.deepspeed_config`` (or ``args.deepshard_config``). ``initialize`` also takes DeepSpeed's
``config_params`` (an old spelling of ``config``), ``dist_init_required``, ``distributed_port``,
``mpu`` and ``mesh_param``. This module turns those into the one config source and the world
``initialize`` works with, and refuses what DeepShard replaces (an ``mpu``: the parallel layout is
config data, not an object with process groups). Everything here runs before the process joins
the world, so a wrong flag or a missing file fails at once on every rank, without a rendezvous.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm import DistInfo, init_distributed
from deepshard.interface import DeepShardConfig
from deepshard.interface.errors import CommError, ConfigError

__all__ = [
    "ConfigSource",
    "add_config_arguments",
    "check_model",
    "config_source",
    "join_world",
    "refuse_model_parallel_objects",
    "world_env",
]

ConfigSource = str | Path | dict[str, Any] | DeepShardConfig
"""A config as ``initialize`` takes it: a JSON/HJSON path, a dict or a `DeepShardConfig`."""

_CONFIG_FLAGS = ("deepspeed_config", "deepshard_config")


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's config flags to ``parser``, in their own argument group.

    ``--deepspeed`` (a flag the script may read; DeepShard ignores it, as DeepSpeed does),
    ``--deepspeed_config PATH`` and its DeepShard spelling ``--deepshard_config PATH``.
    ``initialize(args=parser.parse_args())`` reads the config file from either.

    Args:
        parser: The script's parser.

    Returns:
        The same parser.
    """
    group = parser.add_argument_group("DeepShard", "DeepShard (DeepSpeed-compatible) configuration")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="enable DeepSpeed-style training (read by the script; no effect on DeepShard)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed/DeepShard JSON config file"
    )
    group.add_argument(
        "--deepshard_config", default=None, type=str, help="same as --deepspeed_config"
    )
    return parser


def check_model(model: Any) -> torch.nn.Module:
    """The model ``initialize`` was given, refused before anything else happens.

    Raises:
        ConfigError: No model, or not a ``torch.nn.Module`` (such as DeepSpeed's positional
            order ``initialize(args, model)``, which DeepShard takes by keyword only).
    """
    if model is None:
        raise ConfigError(
            "initialize needs the model to train: pass model=<torch.nn.Module> (nothing was "
            "built and the process did not join the world)"
        )
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(
            f"initialize's model is a {type(model).__name__}, not a torch.nn.Module; the first "
            "positional argument is the model (DeepShard's order), so write DeepSpeed's "
            "initialize(args, model, ...) with keywords: initialize(args=args, model=model, ...)"
        )
    return model


def _args_config(args: Any) -> str | None:
    given = {flag: getattr(args, flag, None) for flag in _CONFIG_FLAGS}
    paths = {flag: value for flag, value in given.items() if value is not None}
    if len(set(paths.values())) > 1:
        raise ConfigError(
            "args names two config files (--deepspeed_config "
            f"{paths['deepspeed_config']!r} and --deepshard_config "
            f"{paths['deepshard_config']!r}); pass only one"
        )
    return next(iter(paths.values()), None)


def config_source(
    config: ConfigSource | None, config_params: ConfigSource | None, args: Any
) -> ConfigSource:
    """The one config ``initialize`` uses, from ``config``, ``config_params`` or ``args``.

    Args:
        config: ``initialize``'s ``config``.
        config_params: DeepSpeed's older name for ``config``.
        args: The script's parsed arguments (anything with ``deepspeed_config`` or
            ``deepshard_config`` attributes), or None.

    Returns:
        The config; a path is checked to exist.

    Raises:
        ConfigError: No config, or two of them (named), or a path that does not exist.
    """
    if config is not None and config_params is not None:
        raise ConfigError(
            "initialize got both config= and config_params= (the same argument under its old "
            "DeepSpeed name); pass only config="
        )
    chosen = config if config is not None else config_params
    from_args = _args_config(args) if args is not None else None
    if chosen is not None and from_args is not None:
        raise ConfigError(
            f"initialize got a config and args names another ({from_args!r}, from "
            "--deepspeed_config/--deepshard_config); drop one of them"
        )
    chosen = chosen if chosen is not None else from_args
    if chosen is None:
        raise ConfigError(
            "initialize needs a config: pass config=<path or dict>, or args= with "
            "--deepspeed_config PATH (add the flag with deepshard.engine.add_config_arguments)"
        )
    if isinstance(chosen, (str, Path)) and not Path(chosen).is_file():
        raise ConfigError(f"the config file {str(chosen)!r} does not exist (or is not a file)")
    return chosen


def refuse_model_parallel_objects(mpu: Any, mesh_param: Any) -> None:
    """Refuses DeepSpeed's model-parallel objects: in DeepShard the layout is config data.

    Raises:
        ConfigError: An ``mpu`` or a ``mesh_param`` was given; the message names the config keys
            that replace it.
    """
    if mpu is not None:
        raise ConfigError(
            "initialize does not take an mpu (a model-parallel unit with its own process "
            "groups): describe the layout in the config instead (tensor_parallel.autotp_size, "
            "sequence_parallel_size, expert parallelism in moe) and DeepShard builds the mesh "
            "from it, or pass mesh=deepshard.comm.build_mesh(topology)"
        )
    if mesh_param is not None:
        raise ConfigError(
            f"initialize does not take mesh_param={mesh_param!r}: set sequence_parallel_size "
            "in the config (the data-parallel size follows from the world), or pass "
            "mesh=deepshard.comm.build_mesh(topology)"
        )


def world_env(distributed_port: int | None, environ: Mapping[str, str]) -> Mapping[str, str]:
    """The variables ``init_distributed`` reads: ``environ``, with DeepSpeed's
    ``distributed_port`` as ``MASTER_PORT`` where no launcher set one."""
    if distributed_port is None or "MASTER_PORT" in environ:
        return environ
    return {**environ, "MASTER_PORT": str(distributed_port)}


def join_world(dist_init_required: bool | None, distributed_port: int | None) -> DistInfo:
    """Joins the world as DeepSpeed's ``dist_init_required`` asks, and says where this rank is.

    Args:
        dist_init_required: None or True: create the default process group unless it exists;
            False: it must already exist (the caller created it).
        distributed_port: Rank 0's port where the launcher set no ``MASTER_PORT``.

    Returns:
        This process's place in the world.

    Raises:
        CommError: ``dist_init_required=False`` without a default process group, or the
            rendezvous failed.
    """
    if dist_init_required is False and not dist.is_initialized():
        raise CommError(
            "initialize(dist_init_required=False) needs the default process group to exist: "
            "call torch.distributed.init_process_group first, or pass dist_init_required=None "
            "to let DeepShard join the world"
        )
    return init_distributed(env=world_env(distributed_port, os.environ))
