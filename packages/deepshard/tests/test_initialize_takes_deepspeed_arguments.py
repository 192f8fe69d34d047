"""``initialize`` takes DeepSpeed 0.19.7's arguments by keyword and refuses bad ones early.

* Refused in this (pytest) process before it joins any world, each naming the argument: no
  model, DeepSpeed's positional ``initialize(args, model)``, no config, ``config`` with
  ``config_params``, a config with ``args.deepspeed_config``, two different config flags, a
  config path that does not exist (from ``config``, ``config_params`` or ``args``), an ``mpu``
  or ``mesh_param``, and ``dist_init_required=False`` without a process group.
* ``distributed_port`` becomes ``MASTER_PORT`` only where the launcher set none.
* On 2 gloo ranks: the config file comes from ``args.deepspeed_config`` or
  ``args.deepshard_config``, or a dict from ``config_params``; the optimizer trains exactly
  ``model_parameters`` (the other layer keeps its weights); ``dist_init_required`` None, True or
  False joins the existing world without a mesh argument; the engine reports its ranks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import deepshard.engine as ds
from deepshard.engine._arguments import world_env
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_CONFIG = {
    "train_batch_size": 4,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
}


def _args(**flags: str | None) -> argparse.Namespace:
    parser = ds.add_config_arguments(argparse.ArgumentParser())
    argv = [item for flag, value in flags.items() if value for item in (f"--{flag}", value)]
    return parser.parse_args(argv)


def _write(tmp_path: Path) -> str:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(_CONFIG))
    return str(path)


@pytest.mark.parametrize(
    ("make_call", "message"),
    [
        (lambda p: {"config": p}, "model=<torch.nn.Module>"),
        (lambda p: {"model": torch.nn.Linear(2, 2)}, "--deepspeed_config PATH"),
        (
            lambda p: {"model": torch.nn.Linear(2, 2), "config": p, "config_params": p},
            "both config= and config_params=",
        ),
        (
            lambda p: {
                "model": torch.nn.Linear(2, 2),
                "config": _CONFIG,
                "args": _args(deepspeed_config=p),
            },
            "drop one of them",
        ),
        (
            lambda p: {
                "model": torch.nn.Linear(2, 2),
                "args": _args(deepspeed_config=p, deepshard_config=p + ".other"),
            },
            "two config files",
        ),
        (lambda p: {"model": torch.nn.Linear(2, 2), "config": p + ".missing"}, ".missing'"),
        (
            lambda p: {"model": torch.nn.Linear(2, 2), "config_params": p + ".missing"},
            ".missing'",
        ),
        (
            lambda p: {"model": torch.nn.Linear(2, 2), "args": _args(deepshard_config=p + ".x")},
            ".x' does not exist",
        ),
        (
            lambda p: {"model": torch.nn.Linear(2, 2), "config": p, "mpu": object()},
            "tensor_parallel.autotp_size",
        ),
        (
            lambda p: {"model": torch.nn.Linear(2, 2), "config": p, "mesh_param": (2, 1)},
            "sequence_parallel_size",
        ),
    ],
)
def test_bad_arguments_are_refused_before_joining_the_world(
    tmp_path: Path, make_call: Any, message: str
) -> None:
    with pytest.raises(ds.ConfigError) as caught:
        ds.initialize(**make_call(_write(tmp_path)))
    assert message in str(caught.value)
    assert not dist.is_initialized()


def test_deepspeeds_positional_order_is_refused_with_the_keyword_form() -> None:
    with pytest.raises(ds.ConfigError, match=r"initialize\(args=args, model=model"):
        ds.initialize(_args(), torch.nn.Linear(2, 2))  # type: ignore[arg-type]
    assert not dist.is_initialized()


def test_dist_init_required_false_needs_an_existing_group(tmp_path: Path) -> None:
    with pytest.raises(ds.DeepShardError, match=r"dist_init_required=False\) needs the default"):
        ds.initialize(
            model=torch.nn.Linear(2, 2), config=_write(tmp_path), dist_init_required=False
        )
    assert not dist.is_initialized()


def test_distributed_port_fills_only_a_missing_master_port() -> None:
    assert world_env(29511, {"RANK": "0"}) == {"RANK": "0", "MASTER_PORT": "29511"}
    assert world_env(29511, {"MASTER_PORT": "1234"}) == {"MASTER_PORT": "1234"}
    assert world_env(None, {}) == {}


def _trained(engine: Any, model: torch.nn.Sequential) -> dict[str, bool]:
    before = [p.detach().clone() for p in model.parameters()]
    engine.backward(engine(torch.ones(2, 3)).pow(2).sum())
    engine.step()
    after = list(model.parameters())
    return {
        "first_layer_moved": not torch.equal(before[0], after[0]),
        "second_layer_kept": torch.equal(before[2], after[2]) and torch.equal(before[3], after[3]),
    }


def _deepspeed_arguments(mesh: Any, config_path: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = ds.initialize(
        args=_args(deepspeed_config=config_path),
        model=model,
        model_parameters=model[0].parameters(),
    )
    results["args"] = _trained(engine, model)
    results["ranks"] = (engine.global_rank, engine.local_rank, engine.world_size)
    results["device"] = str(engine.device)
    for flag in (None, True, False):
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        engine, _, _, _ = ds.initialize(
            model=model,
            config_params=_CONFIG,
            model_parameters=[{"params": model[0].parameters()}],
            dist_init_required=flag,
        )
        results[f"config_params/{flag}"] = _trained(engine, model)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    engine, _, _, _ = ds.initialize(
        args=_args(deepshard_config=config_path), model=model, mesh=mesh
    )
    results["deepshard_config_lr"] = engine.get_lr()
    return results


def test_deepspeed_style_arguments_build_a_working_engine(tmp_path: Path) -> None:
    results = run_on_mesh(_deepspeed_arguments, 2, args=(_write(tmp_path),), timeout_s=120)
    trained = {"first_layer_moved": True, "second_layer_kept": True}
    for rank, got in enumerate(results):
        assert got["args"] == trained
        assert got["ranks"] == (rank, rank, 2)
        assert got["device"] == "cpu"
        for flag in (None, True, False):
            assert got[f"config_params/{flag}"] == trained
        assert got["deepshard_config_lr"] == [_CONFIG["optimizer"]["params"]["lr"]]
