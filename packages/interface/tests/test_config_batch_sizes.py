"""Batch-size reconciliation: every way of giving the three numbers, as DeepSpeed derives them."""

from __future__ import annotations

import itertools

import pytest

from deepshard.interface import BatchSizes, ConfigError, DeepShardConfig, resolve_batch_sizes

MICROS = (1, 3, 4)
ACCUMS = (1, 2, 5)
WORLDS = (1, 2, 6)
GIVEN_SUBSETS = [
    ("train", "micro", "accum"),
    ("train", "micro"),
    ("train", "accum"),
    ("micro", "accum"),
]


def _truth() -> list[tuple[int, int, int, int]]:
    """(global, micro, accum, dp) quadruples built by multiplying, the identity's own direction."""
    return [(m * a * w, m, a, w) for m, a, w in itertools.product(MICROS, ACCUMS, WORLDS)]


@pytest.mark.parametrize("given", GIVEN_SUBSETS, ids="+".join)
@pytest.mark.parametrize(("train", "micro", "accum", "dp"), _truth())
def test_two_or_three_given_recover_the_rest(
    given: tuple[str, ...], train: int, micro: int, accum: int, dp: int
) -> None:
    values = {"train": train, "micro": micro, "accum": accum}
    args = [values[k] if k in given else None for k in ("train", "micro", "accum")]
    assert resolve_batch_sizes(*args, dp) == BatchSizes(train, micro, accum, dp)


@pytest.mark.parametrize(("micro", "dp"), list(itertools.product(MICROS, WORLDS)))
def test_only_the_micro_batch_means_one_accumulation_step(micro: int, dp: int) -> None:
    assert resolve_batch_sizes(None, micro, None, dp) == BatchSizes(micro * dp, micro, 1, dp)


@pytest.mark.parametrize(("micro", "dp"), list(itertools.product(MICROS, WORLDS)))
def test_only_the_global_batch_means_one_accumulation_step(micro: int, dp: int) -> None:
    assert resolve_batch_sizes(micro * dp, None, None, dp) == BatchSizes(micro * dp, micro, 1, dp)


@pytest.mark.parametrize("accum", [None, 4])
def test_neither_batch_size_is_an_error(accum: int | None) -> None:
    with pytest.raises(
        ConfigError, match="give train_batch_size or train_micro_batch_size_per_gpu"
    ):
        resolve_batch_sizes(None, None, accum, 2)


def test_inconsistent_triple_names_every_number() -> None:
    with pytest.raises(ConfigError) as info:
        resolve_batch_sizes(32, 4, 2, 2)
    message = str(info.value)
    assert message == (
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 × "
        "gradient_accumulation_steps 2 × data-parallel world 2 = 16"
    )
    assert info.value.problems == [("train_batch_size", message)]


@pytest.mark.parametrize(
    ("train", "micro", "accum", "dp", "missing"),
    [
        (30, 4, None, 2, "gradient_accumulation_steps"),  # 30 / (4 × 2) is fractional
        (30, None, 4, 2, "train_micro_batch_size_per_gpu"),
        (7, None, None, 2, "train_micro_batch_size_per_gpu"),
        (4, 4, None, 2, "gradient_accumulation_steps"),  # would be 1/2: DeepSpeed floors to 0
    ],
)
def test_indivisible_global_batch_is_an_error(
    train: int, micro: int | None, accum: int | None, dp: int, missing: str
) -> None:
    with pytest.raises(ConfigError, match=f"not divisible.*so {missing} would not be a whole"):
        resolve_batch_sizes(train, micro, accum, dp)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, None, None, 1), "train_batch_size"),
        ((None, -2, None, 1), "train_micro_batch_size_per_gpu"),
        ((None, 2, 0, 1), "gradient_accumulation_steps"),
        ((None, 2.5, None, 1), "train_micro_batch_size_per_gpu"),
        ((None, True, None, 1), "train_micro_batch_size_per_gpu"),
    ],
)
def test_non_positive_or_non_integer_numbers_are_errors(args: tuple, name: str) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: "):
        resolve_batch_sizes(*args)


@pytest.mark.parametrize("dp", [0, -1, 1.5, True])
def test_bad_world_size_is_an_error(dp: object) -> None:
    with pytest.raises(ConfigError, match="dp_world_size"):
        resolve_batch_sizes(8, None, None, dp)  # type: ignore[arg-type]


def test_from_dict_stores_resolved_sizes_when_the_world_is_known() -> None:
    raw = {"train_batch_size": 48, "gradient_accumulation_steps": 3}
    cfg = DeepShardConfig.from_dict(raw, dp_world_size=4)
    assert cfg.train_micro_batch_size_per_gpu == 48 // (3 * 4)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (48, 3)
    unresolved = DeepShardConfig.from_dict(raw)
    assert unresolved.train_micro_batch_size_per_gpu is None
    assert unresolved.resolve_batch(4) == BatchSizes(48, 4, 3, 4)


def test_from_dict_reports_inconsistency_at_parse_time() -> None:
    raw = {
        "train_batch_size": 32,
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
    }
    with pytest.raises(ConfigError, match=r"32 != .* = 16"):
        DeepShardConfig.from_dict(raw, dp_world_size=2)


def test_elastic_configs_are_not_resolved_at_parse_time() -> None:
    raw = {"elasticity": {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2]}}
    cfg = DeepShardConfig.from_dict(raw, dp_world_size=4)
    assert cfg.train_batch_size is None and cfg.elasticity.enabled


def test_batch_keys_beside_elasticity_are_refused_unless_ignored() -> None:
    elastic = {"enabled": True, "max_train_batch_size": 64, "micro_batch_sizes": [2]}
    with pytest.raises(ConfigError, match="train_batch_size: elasticity decides"):
        DeepShardConfig.from_dict({"train_batch_size": 8, "elasticity": elastic})
    allowed = {**elastic, "ignore_non_elastic_batch_info": True}
    assert (
        DeepShardConfig.from_dict({"train_batch_size": 8, "elasticity": allowed}).train_batch_size
        == 8
    )
