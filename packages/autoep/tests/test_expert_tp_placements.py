"""Expert TP placements and shard maps, as pure arithmetic (no processes).

Under expert tensor parallelism (``ep = 2 × tp = 2``) rank ``(e, t)`` holds experts
``[2e, 2e + 2)``, of each its ``t``-th half of the gate rows and of the up rows (``gate_up``)
and its ``t``-th half of the columns (``down``). The placement's local shape and the map over
``ep × tp`` must say exactly that: the map covers every element once and each rank's extract
of a numbered whole tensor equals the slice cut here with torch indexing, then ``rebuild``
gives the whole tensor back.
"""

from __future__ import annotations

import pytest
import torch

from deepshard.autoep._expert_placements import _expert_map, _expert_placement
from deepshard.autoep._report import ParamSwap
from deepshard.interface import Topology

EXPERTS, INTER, HIDDEN = 4, 4, 3
TOPOLOGY = Topology(ep=2, tp=2)


def _swap(name: str, local: tuple[int, ...]) -> ParamSwap:
    new = torch.nn.Parameter(torch.zeros(local))
    return ParamSwap(name, new, (), lambda ts: ts[0])


def _megatron(name: str, full: torch.Tensor, e: int, t: int) -> torch.Tensor:
    mine, w = full[2 * e : 2 * e + 2], INTER // 2
    if name.endswith("gate_up_proj"):
        gate, up = mine[:, :INTER], mine[:, INTER:]
        return torch.cat([gate[:, t * w : (t + 1) * w], up[:, t * w : (t + 1) * w]], dim=1)
    return mine[..., t * w : (t + 1) * w]


@pytest.mark.parametrize(
    ("name", "local", "whole"),
    [
        ("mlp.experts.gate_up_proj", (2, INTER, HIDDEN), (EXPERTS, 2 * INTER, HIDDEN)),
        ("mlp.experts.down_proj", (2, HIDDEN, INTER // 2), (EXPERTS, HIDDEN, INTER)),
    ],
)
def test_expert_tp_map_gives_each_rank_its_megatron_slice(
    name: str, local: tuple[int, ...], whole: tuple[int, ...]
) -> None:
    placement = _expert_placement(_swap(name, local), local, TOPOLOGY, expert_tp=True)
    assert placement.global_shape == whole
    assert placement.local_shape(TOPOLOGY) == local
    assert placement.reduce_over == ("dp",)
    smap = _expert_map(placement, TOPOLOGY, ("ep", "tp"))
    smap.validate_coverage()
    full = torch.arange(float(torch.Size(whole).numel())).reshape(whole)
    shards = {}
    for rank in range(4):
        e, t = divmod(rank, 2)
        shards[rank] = smap.extract(full.reshape(-1).tolist(), rank)
        assert shards[rank] == _megatron(name, full, e, t).reshape(-1).tolist(), rank
    assert smap.rebuild(shards) == full.reshape(-1).tolist()


def test_without_expert_tp_the_map_splits_experts_only() -> None:
    local = (2, 2 * INTER, HIDDEN)
    swap = _swap("mlp.experts.gate_up_proj", local)
    placement = _expert_placement(swap, local, TOPOLOGY, expert_tp=False)
    assert placement.global_shape == (EXPERTS, 2 * INTER, HIDDEN)
    smap = _expert_map(placement, TOPOLOGY, ("ep",))
    smap.validate_coverage()
    assert [p.box_offset for p in smap.pieces] == [(0, 0, 0), (2, 0, 0)]


def test_expert_tp_sizes_the_mesh_and_the_experts_cannot_hold_are_refused() -> None:
    from types import SimpleNamespace

    from deepshard.autoep._replace import _section, _tp_slices
    from deepshard.interface.config.moe import ExpertParallelConfig
    from deepshard.interface.errors import ConfigError

    section = ExpertParallelConfig(enabled=True, autoep_size=2, expert_tensor_parallel_size=4)
    with pytest.raises(ConfigError, match="4 differs from the mesh's tp axis 2"):
        _section(section, TOPOLOGY)
    dims = SimpleNamespace(topology=TOPOLOGY, coordinate={"tp": 0})
    with pytest.raises(ConfigError, match="intermediate size of 5"):
        _tp_slices(lambda ts: ts[0], lambda ts: ts[0], 5, dims, "model.layers.1.mlp")  # type: ignore[arg-type]
