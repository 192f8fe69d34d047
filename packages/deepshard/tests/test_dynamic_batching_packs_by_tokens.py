"""Dynamic batching's plan, without processes: packing, steps, LR scale, the seqlen metric.

The expected groups are worked out by hand from the rule in `deepshard.engine.dynamic_batching`
(greedy in order, close at the first sample that does not fit once ``min_batch_size`` is
reached, else skip it). When DeepSpeed is installed (``bench`` group), its own
``batch_by_seqlens`` must give the same groups for the orders it handles correctly, once its
off-by-one (it never packs the ordered list's last sample) is accounted for.
"""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path

import pytest

from deepshard.engine.dynamic_batching import (
    StepPlan,
    pack_by_tokens,
    plan_steps,
    read_seqlen_metric,
    scale_lr,
)
from deepshard.interface.config import DynamicBatchingConfig
from deepshard.interface.errors import ConfigError

LENGTHS = [5, 3, 4, 6, 2, 7, 1]


def test_greedy_packing_in_dataset_order() -> None:
    # 5+3=8, +4 would be 12 > 10; 4+6=10; 2+7+1=10.
    assert pack_by_tokens(LENGTHS, 10) == [(0, 1), (2, 3), (4, 5, 6)]
    assert pack_by_tokens(LENGTHS, 10, max_batch_size=2) == [(0, 1), (2, 3), (4, 5), (6,)]
    assert pack_by_tokens(LENGTHS, 7) == [(0,), (1, 2), (3,), (4,), (5,), (6,)]


def test_packing_by_ascending_length() -> None:
    # Sorted: 6(1) 4(2) 1(3) 2(4) -> 10; 0(5), 3(6) and 5(7) each alone.
    assert pack_by_tokens(LENGTHS, 10, order="seqlen") == [(6, 4, 1, 2), (0,), (3,), (5,)]


def test_short_groups_skip_what_does_not_fit() -> None:
    # Sample 1 (6) does not fit after sample 0 (6) and the group has 1 < 2 samples: it is
    # skipped, sample 2 (3) completes the group, sample 1 starts the next one.
    assert pack_by_tokens([6, 6, 3, 3], 10, min_batch_size=2) == [(0, 2), (1, 3)]


def test_what_cannot_be_packed_is_left_out_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="deepshard.engine"):
        assert pack_by_tokens([12, 3, 4], 10) == [(1, 2)]
    assert "1 sample(s) longer than max_tokens 10 left out (first: [0])" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepshard.engine"):
        assert pack_by_tokens([8, 8, 8], 10, min_batch_size=2) == []
    assert "3 sample(s) left out that could not complete a group of min_batch_size 2" in caplog.text


def test_random_order_is_a_seeded_permutation() -> None:
    lengths = [1 + (7 * i) % 9 for i in range(40)]
    first = pack_by_tokens(lengths, 12, order="random", seed=3)
    assert first == pack_by_tokens(lengths, 12, order="random", seed=3)
    assert first != pack_by_tokens(lengths, 12, order="random", seed=4)
    assert sorted(i for group in first for i in group) == list(range(40))
    assert all(sum(lengths[i] for i in group) <= 12 for group in first)


def test_filter_ids_and_bounds() -> None:
    assert pack_by_tokens(LENGTHS, 10, filter_ids=[3, 0, 2]) == [(3,), (0, 2)]  # 6, 5+4
    with pytest.raises(ConfigError, match=r"filter_ids \[9\] are not sample indices"):
        pack_by_tokens(LENGTHS, 10, filter_ids=[1, 9])
    with pytest.raises(ConfigError, match="max_batch_size: 1 is below min_batch_size 2"):
        pack_by_tokens(LENGTHS, 10, min_batch_size=2, max_batch_size=1)


def test_steps_interleave_groups_over_ranks_and_micro_steps() -> None:
    groups = tuple((i,) * (1 + i % 3) for i in range(17))  # group i holds "i" 1-3 times
    plan = StepPlan(groups, micro_batch_size=2, accumulation_steps=2, ranks=2)
    assert plan.groups_per_step == 8 and plan.num_steps == 2  # group 16 is a partial step
    # Group k of a step -> rank k % 2, slot (k // 2) % 2, micro-step k // 4.
    assert plan.micro_batch(0, 0, 0) == [*groups[0], *groups[2]]
    assert plan.micro_batch(0, 0, 1) == [*groups[1], *groups[3]]
    assert plan.micro_batch(0, 1, 0) == [*groups[4], *groups[6]]
    assert plan.micro_batch(1, 1, 1) == [*groups[13], *groups[15]]
    assert plan.samples_in_step(1) == sum(len(g) for g in groups[8:16])
    later = StepPlan(groups, 2, 2, 2, offset=3)
    assert later.num_steps == 1 and later.micro_batch(0, 0, 0) == [*groups[3], *groups[5]]


def test_learning_rate_scales_with_the_step_samples() -> None:
    assert scale_lr(0.1, 30, 10, "linear") == pytest.approx(0.3)
    assert scale_lr(0.1, 25, 10, "sqrt") == pytest.approx(0.1 * math.sqrt(2.5))
    assert scale_lr(0.1, 25, 10, "none") == 0.1
    with pytest.raises(ConfigError, match="linear, sqrt or none"):
        scale_lr(0.1, 25, 10, "cubic")


def test_a_plan_without_one_step_is_refused() -> None:
    section = DynamicBatchingConfig(enabled=True, max_tokens=10)
    plan = plan_steps(LENGTHS, section, micro_batch_size=1, accumulation_steps=1, ranks=3, seed=0)
    assert plan.num_steps == 1
    with pytest.raises(ConfigError, match="fewer than one step's train_batch_size of 4 groups"):
        plan_steps(LENGTHS, section, micro_batch_size=2, accumulation_steps=1, ranks=2, seed=0)


def _write_metric(root: Path, values: list[int], code: int, kind: str) -> None:
    """The data analyzer's index layout: magic, version, dtype code, counts, sizes (int32),
    byte offsets (int64), document boundaries (int64); the values in the data file."""
    folder = root / "seqlen"
    folder.mkdir(parents=True)
    width = struct.calcsize(kind)
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(values), len(values) + 1)
    header += struct.pack(f"<{len(values)}i", *[1] * len(values))
    header += struct.pack(f"<{len(values)}q", *[i * width for i in range(len(values))])
    header += struct.pack(f"<{len(values) + 1}q", *range(len(values) + 1))
    (folder / "seqlen_sample_to_metric.idx").write_bytes(header)
    data = struct.pack(f"<{len(values)}{kind}", *values)
    (folder / "seqlen_sample_to_metric.bin").write_bytes(data)


def test_seqlen_metric_files_are_read(tmp_path: Path) -> None:
    _write_metric(tmp_path / "int64", LENGTHS, 5, "q")
    assert read_seqlen_metric(tmp_path / "int64") == LENGTHS
    _write_metric(tmp_path / "uint16", [70000 % 65536, 9], 6, "H")
    assert read_seqlen_metric(tmp_path / "uint16") == [70000 % 65536, 9]
    with pytest.raises(ConfigError, match="cannot read"):
        read_seqlen_metric(tmp_path / "absent")
    index = tmp_path / "int64" / "seqlen" / "seqlen_sample_to_metric.idx"
    index.write_bytes(b"NOTANIDX!" + index.read_bytes()[9:])
    with pytest.raises(ConfigError, match="is not a seqlen metric"):
        read_seqlen_metric(tmp_path / "int64")


@pytest.mark.parametrize("order", ["dataloader", "seqlen"])
@pytest.mark.parametrize("max_batch_size", [None, 3])
def test_same_groups_as_deepspeed(order: str, max_batch_size: int | None) -> None:
    sampling = pytest.importorskip(
        "deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr",
        reason="DeepSpeed is in the bench group",
    )
    lengths = [1 + (37 * i) % 23 for i in range(60)]
    theirs, _, _ = sampling.batch_by_seqlens(
        lengths, 40, max_batch_size=max_batch_size, sequence_picking_order=order
    )
    # DeepSpeed never packs the ordered list's last sample (its range stops one short).
    ordered = sorted(range(60), key=lambda i: (lengths[i], i)) if order == "seqlen" else range(60)
    kept = [i for i in ordered][:-1]
    ours = pack_by_tokens(lengths, 40, max_batch_size=max_batch_size, order=order, filter_ids=kept)
    assert [tuple(ids) for _, ids in theirs] == ours


def test_loader_positions_are_not_mixed_up() -> None:
    from deepshard.engine._dataloader import ResumableSampler
    from deepshard.engine._token_budget_loader import TokenBudgetSampler

    section = DynamicBatchingConfig(enabled=True, max_tokens=10)
    budget = TokenBudgetSampler(
        LENGTHS, section, micro_batch_size=1, accumulation_steps=1, rank=0, ranks=1, seed=0
    )
    fixed = ResumableSampler(list(range(7)), num_replicas=1, rank=0)
    with pytest.raises(ConfigError, match="fixed-size loader's"):
        budget.load_state_dict(fixed.state_dict())
    with pytest.raises(ConfigError, match="dynamic-batching loader's"):
        fixed.load_state_dict(budget.state_dict())


def test_a_position_at_the_end_of_an_epoch_resumes_with_the_next() -> None:
    from deepshard.engine._token_budget_loader import TokenBudgetSampler

    lengths = [1 + (7 * i) % 9 for i in range(40)]
    section = DynamicBatchingConfig(enabled=True, max_tokens=12, sequence_picking_order="random")
    sampler = TokenBudgetSampler(
        lengths, section, micro_batch_size=1, accumulation_steps=2, rank=0, ranks=1, seed=5
    )
    first = list(sampler)
    sampler.served = len(first)  # the loader delivered the whole epoch
    state = sampler.state_dict()
    assert state == {"epoch": 0, "groups": sampler.plan.num_steps * 2}
    resumed = TokenBudgetSampler(
        lengths, section, micro_batch_size=1, accumulation_steps=2, rank=0, ranks=1, seed=5
    )
    resumed.load_state_dict(state)
    assert resumed.epoch == 1 and list(resumed) != first  # epoch 1: another random order
    sampler.set_epoch(1)
    assert list(resumed) == list(sampler)
