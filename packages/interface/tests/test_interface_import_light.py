"""Importing deepshard.interface is cheap: no torch, and every exported name resolves."""

from __future__ import annotations

import subprocess
import sys

import deepshard.interface as interface
import deepshard.interface.config as config


def test_import_does_not_pull_in_torch() -> None:
    code = (
        "import sys, deepshard.interface, deepshard.interface.config;"
        "deepshard.interface.DeepShardConfig.from_dict({'train_batch_size': 4}, dp_world_size=2);"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_public_names_resolve() -> None:
    expected = {
        "DeepShardConfig", "Topology", "BatchSizes", "resolve_batch_sizes", "DeepShardError",
        "ConfigError", "TopologyError", "CheckpointError", "LaunchError", "CommError",
    }  # fmt: skip
    assert expected <= set(interface.__all__)
    for module in (interface, config):
        for name in module.__all__:
            assert getattr(module, name) is not None
    assert {"ZeroConfig", "Fp16Config", "Bf16Config", "OptimizerConfig", "SchedulerConfig",
            "CommsLoggerConfig", "FlopsProfilerConfig"} <= set(config.__all__)  # fmt: skip
