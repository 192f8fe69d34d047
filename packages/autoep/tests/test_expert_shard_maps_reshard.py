"""The experts' shard maps rebuild the full tensors at EP = 2 and cut them right for EP = 1 and 4.

Each rank of an EP size is played in this process on a fake process group (replacement moves
no data). The EP = 2 ranks' local expert tensors, put together by their report's `ShardMap`s,
must equal the unreplaced model's full tensors; from that rebuilt tensor, the EP = 4 and EP = 1
maps must extract exactly what `parallelize_experts` gives each of those ranks. That is the
resharding a checkpoint does through these maps.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepshard.autoep import ReplacementReport, parallelize_experts
from deepshard.interface import Topology
from deepshard.testing import fake_mesh, import_beside

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_tiny = import_beside(__file__, "_tiny_moe.py")

NAMES = ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")


def _ranks(ep: int) -> list[tuple[ReplacementReport, dict[str, torch.Tensor]]]:
    ref = _tiny.build("mixtral", 8)
    out = []
    for rank in range(ep):
        model = copy.deepcopy(ref)
        with fake_mesh(Topology(ep=ep), rank) as mesh:
            report = parallelize_experts(model, mesh)
        out.append((report, {n: p.detach() for n, p in model.named_parameters()}))
    return out


def test_ep2_shards_rebuild_and_reshard_to_ep1_and_ep4() -> None:
    full_model = _tiny.build("mixtral", 8)
    ep2, ep4, ep1 = _ranks(2), _ranks(4), _ranks(1)
    for name in NAMES:
        smap = ep2[0][0].shard_maps[name]
        assert smap.axes == ("ep",) and smap == ep2[1][0].shard_maps[name]
        shards = {r: params[name].reshape(-1).tolist() for r, (_, params) in enumerate(ep2)}
        full = smap.rebuild(shards)
        assert full == full_model.get_parameter(name).detach().reshape(-1).tolist()
        for target in (ep4, ep1):
            target_map = target[0][0].shard_maps[name]
            for rank, (_, params) in enumerate(target):
                assert target_map.extract(full, rank) == params[name].reshape(-1).tolist()
