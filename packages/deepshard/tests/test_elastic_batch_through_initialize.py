"""With ``elasticity`` the engine trains with the elastic batch sizes for its world, and the
caller's config dict is left exactly as it was (deep-compared before and after).

Two gloo ranks (dp = 2), micro-batches [2, 3], at most 24: the global batch is 24 (worked by
hand in ``packages/interface/tests/test_elastic_config_matches_deepspeed.py``), each rank reads
24 / 2 = 12 samples per step, the largest micro-batch dividing 12 is 3, so 4 accumulation steps.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

ELASTIC = {"enabled": True, "max_train_batch_size": 24, "micro_batch_sizes": [2, 3], "version": 0.1}


def _engine(mesh: Any, config: dict[str, Any]) -> dict[str, Any]:
    import deepshard.engine as ds

    before = copy.deepcopy(config)
    torch.manual_seed(0)
    engine, _, _, _ = ds.initialize(torch.nn.Linear(4, 1), config, mesh=mesh)
    steps = []
    for _ in range(4):
        engine.backward(engine(torch.ones(3, 4)).square().mean())
        engine.step()
        steps.append(engine.global_steps)
    return {
        "sizes": (
            engine.train_batch_size(),
            engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps(),
        ),
        "steps": steps,
        "unchanged": config == before,
    }


def _both(mesh: Any) -> dict[str, Any]:
    optimizer = {"type": "SGD", "params": {"lr": 0.1}}
    return {
        "plain": _engine(mesh, {"optimizer": optimizer, "elasticity": dict(ELASTIC)}),
        # DeepSpeed overrides (and does not write back) batch keys it was told to ignore
        "ignored keys": _engine(
            mesh,
            {
                "optimizer": optimizer,
                "train_batch_size": 8,
                "train_micro_batch_size_per_gpu": 4,
                "elasticity": {**ELASTIC, "ignore_non_elastic_batch_info": True},
            },
        ),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_on_mesh(_both, 2, store_dir=tmp_path_factory.mktemp("elastic"), timeout_s=120)


@pytest.mark.parametrize("case", ["plain", "ignored keys"])
def test_batch_sizes_come_from_the_elastic_schedule(ranks: list[Any], case: str) -> None:
    for rank in ranks:
        assert rank[case]["sizes"] == (24, 3, 4)
        assert rank[case]["steps"] == [0, 0, 0, 1]  # the 4th micro-step is the boundary


@pytest.mark.parametrize("case", ["plain", "ignored keys"])
def test_the_callers_dict_is_not_written(ranks: list[Any], case: str) -> None:
    assert all(rank[case]["unchanged"] for rank in ranks)


def test_a_world_elasticity_cannot_serve_is_refused() -> None:
    from deepshard.engine._elastic import engine_batch_sizes
    from deepshard.interface import ConfigError, DeepShardConfig

    config = DeepShardConfig.from_dict({"elasticity": ELASTIC})
    with pytest.raises(ConfigError, match="world size 5 is not one of the valid GPU counts"):
        engine_batch_sizes(config, 5)
