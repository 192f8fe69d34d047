"""``ParamPlacement.sum_over``: partial gradients summed over a replicated axis (Qwen3 q_norm)."""

from __future__ import annotations

import dataclasses

import pytest

from deepshard.interface import ParamPlacement, Shard
from deepshard.interface.errors import TopologyError


def test_sum_over_round_trips_through_json() -> None:
    placement = dataclasses.replace(ParamPlacement.replicated((4,), "float32"), sum_over=("tp",))
    data = placement.to_json()
    assert data["sum_over"] == ["tp"]
    assert ParamPlacement.from_json(data) == placement


def test_json_without_sum_over_reads_as_none() -> None:
    placement = ParamPlacement.replicated((4,), "float32")
    assert "sum_over" not in placement.to_json()
    assert ParamPlacement.from_json(placement.to_json()).sum_over == ()


@pytest.mark.parametrize(
    ("axes", "why"),
    [(("dp",), "reduce_over"), (("xx",), "xx"), (("tp", "tp"), "repeated")],
)
def test_sum_over_outside_replicated_axes_is_refused(axes: tuple[str, ...], why: str) -> None:
    with pytest.raises(TopologyError, match="sum_over") as info:
        dataclasses.replace(ParamPlacement.replicated((4,), "float32"), sum_over=axes)
    assert why in str(info.value)


def test_sum_over_a_sharding_axis_is_refused() -> None:
    sharded = ParamPlacement.replicated((4,), "float32").with_axis("tp", Shard(0))
    with pytest.raises(TopologyError, match="replicate the parameter"):
        dataclasses.replace(sharded, sum_over=("tp",))
