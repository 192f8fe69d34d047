"""`initialize` gives ZeRO a comms watchdog set from `comms_watchdog_s` / `DEEPSHARD_WATCHDOG_S`.

The watchdog rides in the comms logger the engine threads into ZeRO (a disabled logger when
`comms_logger` is off). The hang itself, caught in ZeRO's collectives, is shown end to end by
`integration_tests/test_watchdog_hang_under_ds_launch.py`.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import deepshard.engine as ds
from deepshard.interface.errors import ConfigError


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_batch_size": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 1},
        **extra,
    }


def _settings(mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, extra, env in (
        ("configured", {"comms_watchdog_s": 7.5}, None),
        ("config_wins", {"comms_watchdog_s": 9}, "4"),
        ("env", {}, "4"),
        ("default", {}, None),
        ("off", {"comms_watchdog_s": 0}, None),
        ("off_by_env", {}, "0"),
        ("with_logger", {"comms_logger": {"enabled": True}, "comms_watchdog_s": 5}, None),
    ):
        os.environ.pop("DEEPSHARD_WATCHDOG_S", None)
        if env is not None:
            os.environ["DEEPSHARD_WATCHDOG_S"] = env
        engine, *_ = ds.initialize(torch.nn.Linear(2, 2), _config(**extra), mesh=mesh)
        logger = engine.comms_logger
        dog = None if logger is None else logger.watchdog
        out[name] = (
            None if dog is None else dog.timeout_s,
            None if logger is None else logger.enabled,
        )
        if dog is not None:
            dog.close()
    os.environ["DEEPSHARD_WATCHDOG_S"] = "soon"
    with pytest.raises(ConfigError, match="DEEPSHARD_WATCHDOG_S='soon'"):
        ds.initialize(torch.nn.Linear(2, 2), _config(), mesh=mesh)
    return out


def test_the_watchdog_follows_the_config_then_the_environment(run_on_mesh: Any) -> None:
    (got,) = run_on_mesh(_settings, 1)
    assert got == {
        "configured": (7.5, False),
        "config_wins": (9.0, False),
        "env": (4.0, False),
        "default": (120.0, False),
        "off": (None, None),
        "off_by_env": (None, None),
        "with_logger": (5.0, True),
    }


def test_a_negative_watchdog_time_names_the_key() -> None:
    with pytest.raises(ConfigError, match="comms_watchdog_s"):
        ds.DeepShardConfig.from_dict(_config(comms_watchdog_s=-1))
