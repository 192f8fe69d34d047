"""``ds-launch``: start DeepShard jobs on one machine or many (ssh, pdsh, SLURM, mpirun, torchrun).

The command line is `deepshard.launcher.cli`; the node entry every remote node runs is
`deepshard.launcher.node`. The names below are the pure building blocks the command uses,
public so that scripts and tests can resolve a hostfile or plan a launch without starting it.

Importing this package is free: the names are loaded on first use (``ds-launch --help`` must
answer at once, and nothing here ever imports torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepshard.launcher._cores import parse_core_list, split_cores
    from deepshard.launcher._devices import Accelerators, detect_accelerators
    from deepshard.launcher._env import EXPORT_PREFIXES, exported_variables, parse_env_file
    from deepshard.launcher._hostfile import (
        DEFAULT_HOSTFILE,
        parse_hostfile,
        parse_hostfile_text,
    )
    from deepshard.launcher._launch import describe_plan, launch
    from deepshard.launcher._plan import LaunchOptions, LaunchPlan, plan_launch
    from deepshard.launcher._ranks import RunOptions
    from deepshard.launcher._resources import parse_resource_spec, resolve_resources
    from deepshard.launcher._specs import Outcome, ProcessSpec, SupervisionPolicy
    from deepshard.launcher._supervisor import supervise
    from deepshard.launcher._world import NodeSlots, WorldLayout, rank_environment
    from deepshard.launcher.cli import main

__all__ = [
    "DEFAULT_HOSTFILE",
    "EXPORT_PREFIXES",
    "Accelerators",
    "LaunchOptions",
    "LaunchPlan",
    "NodeSlots",
    "Outcome",
    "ProcessSpec",
    "RunOptions",
    "SupervisionPolicy",
    "WorldLayout",
    "describe_plan",
    "detect_accelerators",
    "exported_variables",
    "launch",
    "main",
    "parse_core_list",
    "parse_env_file",
    "parse_hostfile",
    "parse_hostfile_text",
    "parse_resource_spec",
    "plan_launch",
    "rank_environment",
    "resolve_resources",
    "split_cores",
    "supervise",
]

_HOME = {
    "parse_core_list": "_cores",
    "split_cores": "_cores",
    "Accelerators": "_devices",
    "detect_accelerators": "_devices",
    "EXPORT_PREFIXES": "_env",
    "exported_variables": "_env",
    "parse_env_file": "_env",
    "DEFAULT_HOSTFILE": "_hostfile",
    "parse_hostfile": "_hostfile",
    "parse_hostfile_text": "_hostfile",
    "describe_plan": "_launch",
    "launch": "_launch",
    "LaunchOptions": "_plan",
    "LaunchPlan": "_plan",
    "plan_launch": "_plan",
    "RunOptions": "_ranks",
    "parse_resource_spec": "_resources",
    "resolve_resources": "_resources",
    "Outcome": "_specs",
    "ProcessSpec": "_specs",
    "SupervisionPolicy": "_specs",
    "supervise": "_supervisor",
    "NodeSlots": "_world",
    "WorldLayout": "_world",
    "rank_environment": "_world",
    "main": "cli",
}


def __getattr__(name: str) -> Any:
    """Load a public name from its module on first use (PEP 562)."""
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
