"""`compute_elastic_config` picks DeepSpeed's batch sizes: worked by hand, and against
DeepSpeed's own ``deepspeed.elasticity.compute_elastic_config`` on 15 configs (when the
``bench`` group installed DeepSpeed)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from deepshard.interface import DeepShardConfig
from deepshard.interface.elasticity import compute_elastic_config, elastic_batch
from deepshard.interface.errors import ConfigError


def _config(**elastic: Any) -> dict[str, Any]:
    return {"elasticity": {"enabled": True, **elastic}}


def test_micro_batches_2_and_3_up_to_24_by_hand() -> None:
    # bases 2, 3 and lcm 6 scaled by the largest highly composite number within 24:
    # 2·12 = 24, 3·6 = 18, 6·4 = 24. Batch 24 works for 24/2 = 12 and 24/3 = 8 ranks and their
    # divisors up to half: {1, 2, 3, 4, 6, 8, 12} (7 counts); 18 only for {1, 2, 3, 6, 9}.
    config = _config(max_train_batch_size=24, micro_batch_sizes=[2, 3], version=0.1)
    assert compute_elastic_config(config, "0.19.7") == (24, [1, 2, 3, 4, 6, 8, 12])
    # with 8 ranks each takes 24 / 8 = 3 samples: micro-batch 3; with 6, 4 samples: 2 (x2)
    assert compute_elastic_config(config, "0.19.7", world_size=8)[2] == 3
    chosen = elastic_batch(DeepShardConfig.from_dict(config), 6)
    assert (chosen.micro_batch_size, chosen.gradient_accumulation_steps) == (2, 2)


def test_errors_name_the_problem() -> None:
    config = _config(max_train_batch_size=24, micro_batch_sizes=[2, 3], version=0.1)
    with pytest.raises(ConfigError, match="world size 5 is not one of the valid GPU counts"):
        compute_elastic_config(config, "0.19.7", world_size=5)
    with pytest.raises(ConfigError, match="predates elasticity"):
        compute_elastic_config(config, "0.3.7")
    with pytest.raises(ConfigError, match=r"elasticity\.enabled"):
        compute_elastic_config({"elasticity": {"enabled": False}}, "0.19.7")
    with pytest.raises(ConfigError, match=r"elasticity\.model_parallel_size: needs"):
        compute_elastic_config(
            {**config, "elasticity": {**config["elasticity"], "model_parallel_size": 2}}, "0.19.7"
        )
    v2 = _config(
        max_train_batch_size=64, micro_batch_sizes=[2], num_gpus_per_node=3, model_parallel_size=2
    )
    with pytest.raises(ConfigError, match="num_gpus_per_node"):
        compute_elastic_config(v2, "0.19.7", world_size=4)


CASES: list[tuple[dict[str, Any], int]] = [
    (_config(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.1), 0),
    (_config(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.1), 16),  # invalid
    (_config(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6], version=0.1), 24),
    (
        _config(
            max_train_batch_size=10000,
            micro_batch_sizes=[8, 12, 16, 17],
            min_gpus=32,
            max_gpus=1500,
            version=0.1,
        ),
        0,
    ),
    (
        _config(
            max_train_batch_size=1000,
            micro_batch_sizes=[3, 5, 7],
            min_gpus=2,
            max_gpus=64,
            prefer_larger_batch=False,
            version=0.1,
        ),
        0,
    ),
    (_config(max_train_batch_size=24, micro_batch_sizes=[2, 3], version=0.1), 8),
    (_config(max_train_batch_size=2000, micro_batch_sizes=[2, 4, 6]), 8),
    (
        _config(
            max_train_batch_size=4096,
            micro_batch_sizes=[1, 2, 4],
            num_gpus_per_node=8,
            min_gpus=8,
            max_gpus=256,
        ),
        32,
    ),
    (
        _config(
            max_train_batch_size=4096,
            micro_batch_sizes=[1, 2, 4],
            num_gpus_per_node=8,
            model_parallel_size=4,
            min_gpus=8,
            max_gpus=256,
        ),
        16,
    ),
    # 3 data-parallel ranks are not a node-level size: the fallback batch for that world
    (
        _config(
            max_train_batch_size=1500,
            micro_batch_sizes=[3, 6],
            num_gpus_per_node=4,
            model_parallel_size=2,
            prefer_larger_batch=False,
            max_gpus=64,
        ),
        6,
    ),
    (
        _config(
            max_train_batch_size=1000,
            micro_batch_sizes=[2, 4],
            num_gpus_per_node=4,
            min_gpus=4,
            max_gpus=32,
        ),
        12,
    ),
    (_config(max_train_batch_size=720, micro_batch_sizes=[5], num_gpus_per_node=2), 4),
    (_config(max_train_batch_size=100, micro_batch_sizes=[100], version=0.1), 1),
    (_config(max_train_batch_size=6, micro_batch_sizes=[1], max_gpus=100, version=0.1), 3),
    (
        _config(
            max_train_batch_size=50000,
            micro_batch_sizes=[4, 8, 16],
            num_gpus_per_node=16,
            model_parallel_size=8,
            min_gpus=16,
            max_gpus=4096,
        ),
        64,
    ),
]


def _deepspeed() -> Any:
    try:
        from deepspeed.elasticity import compute_elastic_config as theirs
    except Exception as error:  # DeepSpeed (and torch) come with the bench group only
        pytest.skip(f"DeepSpeed is not importable ({error}); uv sync --group bench")
    return theirs


@pytest.mark.parametrize(("config", "world_size"), CASES)
def test_equals_deepspeeds_choice(
    config: dict[str, Any], world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs = _deepspeed()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    version = config["elasticity"].get("version", 0.2)
    if version == 0.2 and world_size == 0:
        pytest.fail("a version-0.2 case needs a world size")
    try:
        expected = theirs(copy.deepcopy(config), "0.19.7", world_size=world_size)
    except Exception as error:  # DeepSpeed refuses this world: so must we
        with pytest.raises(ConfigError, match="not one of the valid GPU counts"):
            compute_elastic_config(config, "0.19.7", world_size=world_size)
        assert "is not valid" in str(error)
        return
    got = compute_elastic_config(config, "0.19.7", world_size=world_size)
    assert tuple(got) == tuple(expected)
    if version == 0.2:
        mine = compute_elastic_config(
            config, "0.19.7", return_microbatch=True, environ={"WORLD_SIZE": str(world_size)}
        )
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
        assert tuple(mine) == tuple(theirs(copy.deepcopy(config), "0.19.7", return_microbatch=True))
