"""Pure checks of `deepshard.zero._tp`: which partition ranges are replicated over tp or
partial sums, and how a partition splits for the norm (no processes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepshard.interface import ParamPlacement, PlacementRegistry, Shard, Topology
from deepshard.interface.errors import ConfigError
from deepshard.zero._tp import needs_tp, tp_grads, tp_group_for

REPLICATED = ParamPlacement.replicated((4,), "float32")
SLICED = ParamPlacement.replicated((8,), "float32").with_axis("tp", Shard(0))
PARTIAL = dataclasses.replace(REPLICATED, sum_over=("tp",))


def test_ranges_merge_per_partition_and_split_complements() -> None:
    group: object = object()  # only carried, never called here
    entries = [
        (0, 0, 4, SLICED),
        (0, 4, 8, REPLICATED),
        (0, 8, 12, PARTIAL),  # adjacent to the replicated range: merged with it
        (1, 2, 6, PARTIAL),
        (1, 6, 6, REPLICATED),  # an empty range (this rank holds none of it) is dropped
    ]
    tp = tp_grads(group, entries, 2)  # type: ignore[arg-type]
    assert tp is not None
    assert tp.replicated == (((4, 12),), ((2, 6),))
    assert tp.partial == (((8, 12),), ((2, 6),))
    grads = [torch.arange(14.0), torch.arange(8.0)]
    sliced, replicated = tp.split(grads)
    assert [s.tolist() for s in sliced] == [
        [0, 1, 2, 3],
        [12, 13],
        [0, 1],
        [6, 7],
    ]
    assert [r.tolist() for r in replicated] == [list(range(4, 12)), [2, 3, 4, 5]]
    # views, not copies: the partial sum writes through them
    replicated[1].zero_()
    assert grads[1][2:6].tolist() == [0, 0, 0, 0]


def test_no_tp_group_means_no_split() -> None:
    assert tp_grads(None, [(0, 0, 4, SLICED)], 1) is None


def test_needs_tp_only_when_tp_is_used() -> None:
    topology = Topology(dp=2, tp=2)
    plain = PlacementRegistry(topology, {"a": REPLICATED})
    assert not needs_tp(plain) and not needs_tp(None)
    assert needs_tp(PlacementRegistry(topology, {"a": SLICED}))
    assert needs_tp(PlacementRegistry(topology, {"a": PARTIAL}))
    assert not needs_tp(PlacementRegistry(Topology(dp=4), {"a": PARTIAL}))


def test_tp_placements_without_parallel_dims_are_refused() -> None:
    registry = PlacementRegistry(Topology(dp=2, tp=2), {"a": SLICED})
    with pytest.raises(ConfigError, match="parallel_dims="):
        tp_group_for(registry, None)


def test_muon_over_tp_parameters_is_refused_with_the_key() -> None:
    from types import SimpleNamespace

    from deepshard.zero._tp import tp_problems

    with_tp, without = SimpleNamespace(tp_group=object()), SimpleNamespace(tp_group=None)
    ((key, message),) = tp_problems(with_tp, transformed=True)  # type: ignore[arg-type]
    assert key == "optimizer.type" and "Muon under tensor parallelism" in message
    assert tp_problems(with_tp, transformed=False) == []  # type: ignore[arg-type]
    assert tp_problems(without, transformed=True) == []  # type: ignore[arg-type]
    assert tp_problems(None, transformed=True) == []
