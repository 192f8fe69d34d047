"""``deepshard.engine.zero`` is ``deepspeed.zero`` for a script whose import line changed.

HF-style code writes ``deepspeed.zero.Init(config_dict_or_path=ds_config)`` and
``deepspeed.zero.GatheredParameters(params)``; after ``import deepshard.engine as deepspeed`` the
same lines build a partitioned model (parameters empty on each rank) and gather it whole. The
config can be given under one name only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deepshard.engine as deepspeed
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps lighter ones

_STAGE3 = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _build(mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    whole = torch.nn.Linear(8, 4)
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=_STAGE3, mesh=mesh):
        model = torch.nn.Linear(8, 4)
    empty = [p.numel() for p in model.parameters()]
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        gathered = [p.detach().clone() for p in model.parameters()]
    return {
        "empty": empty,
        "equal": all(torch.equal(a, b) for a, b in zip(gathered, whole.parameters(), strict=True)),
    }


def test_deepspeed_zero_lines_run_through_deepshard_engine() -> None:
    for got in run_on_mesh(_build, 2, timeout_s=120):
        assert got["empty"] == [0, 0]
        assert got["equal"]


def test_config_under_two_names_is_refused() -> None:
    with pytest.raises(deepspeed.ConfigError, match="config_dict_or_path"):
        deepspeed.zero.Init(config=_STAGE3, config_dict_or_path=_STAGE3)
