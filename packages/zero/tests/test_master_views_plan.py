"""`plan_master_views` (a function of layouts and param groups, no processes): which ranges of
each unit's master partition each inner param group steps.

Expected ranges are derived from the layout's own `pieces` (where each parameter's elements
sit in each rank's partition), never typed in: a unit wholly in one group is its whole
partition; a unit shared by two groups gives each group its parameters' pieces, merged only
across alignment padding; a transformed parameter keeps one view per piece with its shape; a
parameter no group holds is never stepped; a parameter no unit owns is refused.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.zero._master_views import ViewPlan, plan_master_views
from deepshard.zero.layout import plan_flat_layout


def _unit(*shapes: tuple[int, ...]) -> tuple[list[torch.nn.Parameter], object]:
    params = [torch.nn.Parameter(torch.zeros(shape)) for shape in shapes]
    layout = plan_flat_layout(list(shapes), element_size=4, world_size=2, bucket_numel=40)
    return params, layout


def _pieces(layout: object, index: int, rank: int) -> list[tuple[int, int]]:
    slot = layout.slots[index]  # type: ignore[attr-defined]
    return [
        (p.local_offset, p.local_offset + p.flat_stop - p.flat_start)
        for p in layout.pieces(slot)  # type: ignore[attr-defined]
        if p.rank == rank
    ]


def test_whole_units_shared_units_transformed_and_unheld_parameters() -> None:
    (a, layout_a), (b, layout_b) = _unit((5, 3), (7,)), _unit((6, 4), (3,), (9,))
    groups = [{"params": [*a, b[0]]}, {"params": [b[1]]}]  # b[2]: in no group
    for rank in (0, 1):
        plans = plan_master_views([a, b], [layout_a, layout_b], rank, groups, (), None)
        whole = [ViewPlan(0, 0, layout_a.partition_numel, 0)]  # type: ignore[attr-defined]
        assert [p for p in plans if p.unit == 0] == whole
        mine = {g: [(p.lo, p.hi) for p in plans if p.unit == 1 and p.group == g] for g in (0, 1)}
        # each group covers exactly its parameters' pieces, nothing of b[2]
        for g, index in ((0, 0), (1, 1)):
            covered = {i for lo, hi in mine[g] for i in range(lo, hi)}
            wanted = {i for lo, hi in _pieces(layout_b, index, rank) for i in range(lo, hi)}
            assert covered == wanted, (rank, g)
    transformed = plan_master_views([a, b], [layout_a, layout_b], 1, groups, {id(a[0])}, 4)
    views = [p for p in transformed if p.unit == 0]
    assert [(p.lo, p.hi) for p in views if p.shape] == _pieces(layout_a, 0, 1)
    assert all(p.shape == (5, 3) for p in views if p.shape)
    assert all(p.hi - p.lo <= 4 for p in transformed if p.shape is None)


def test_a_parameter_no_unit_owns_is_refused() -> None:
    params, layout = _unit((4,))
    stranger = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(ConfigError, match="not one of the sharded model's trainable"):
        plan_master_views([params], [layout], 0, [{"params": [stranger]}], (), None)
