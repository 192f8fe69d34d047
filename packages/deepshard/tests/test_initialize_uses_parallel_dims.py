"""``initialize`` takes a mesh or a ParallelDims and wires ZeRO and the loader from its groups.

Rank 6 of 8 (dp=2 × ep=2 × tp=2) is played on a fake process group: building the engine needs
no collective. Expected groups are enumerated here from the row-major grid.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

import deepshard.engine as ds
from deepshard.comm import ParallelDims
from deepshard.interface import Topology
from deepshard.testing import fake_mesh

TOPOLOGY = Topology(dp=2, ep=2, tp=2)
RANK = 6


class _Ids(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> int:
        return index


def _grid_group(axes: tuple[str, ...]) -> list[int]:
    grid = list(itertools.product(*(range(s) for s in TOPOLOGY.shape)))
    fixed = [i for i, a in enumerate(TOPOLOGY.AXES) if a not in axes]
    return [r for r, c in enumerate(grid) if all(c[i] == grid[RANK][i] for i in fixed)]


@pytest.mark.parametrize("as_dims", [False, True], ids=["mesh", "parallel_dims"])
def test_zero_and_loader_follow_the_derived_groups(as_dims: bool) -> None:
    config = {
        "train_batch_size": 4,
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
    }
    with fake_mesh(TOPOLOGY, RANK) as mesh:
        given: Any = ParallelDims.from_mesh(mesh) if as_dims else mesh
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))
        engine, optimizer, loader, _ = ds.initialize(
            model, config, training_data=_Ids(), mesh=given
        )
        assert engine.mesh is mesh
        dense = _grid_group(("dp", "ep", "sp"))
        assert optimizer is not None
        assert (optimizer.partition_count, optimizer.partition_rank) == (4, dense.index(RANK))
        for shard in optimizer.shard_maps():
            smap = shard.shard_map
            assert smap.axes == Topology.dense_dp_axes and smap.mesh_shape == TOPOLOGY.shape
            assert {smap.global_rank(p) for p in smap.pieces} <= set(dense)
            name = shard.name
            assert smap.global_shape == tuple(dict(model.named_parameters())[name].shape)
        batch = _grid_group(("dp", "ep"))
        assert loader is not None
        sampler: Any = loader.sampler
        assert (sampler.rank, sampler.num_replicas) == (batch.index(RANK), len(batch))
