"""build_mesh: axis sizes, coordinates and group members match the topology's row-major grid."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from deepshard.comm import build_mesh
from deepshard.interface import Topology
from deepshard.interface.errors import CommError, TopologyError
from deepshard.testing import run_on_mesh

TOPOLOGIES = [
    Topology(dp=2),
    Topology(dp=1, tp=2),
    Topology(dp=4),
    Topology(dp=2, tp=2),
    Topology(dp=1, ep=2, sp=2),
    Topology(dp=1, pp=2, tp=2),
]


def _describe_mesh(mesh: object) -> dict[str, object]:
    return {
        "names": mesh.mesh_dim_names,  # type: ignore[attr-defined]
        "coordinate": mesh.get_coordinate(),  # type: ignore[attr-defined]
        "sizes": {a: mesh[a].size() for a in Topology.AXES},  # type: ignore[index]
        "groups": {
            a: dist.get_process_group_ranks(mesh.get_group(a))  # type: ignore[attr-defined]
            for a in Topology.AXES
        },
        "timeouts": {
            a: mesh.get_group(a)._get_backend(torch.device("cpu")).options._timeout  # type: ignore[attr-defined]
            for a in Topology.AXES
        },
    }


def _build_mismatched(mesh: object, topology: Topology) -> str:
    try:
        build_mesh(topology)
    except TopologyError as error:
        return str(error)
    return "no error"


def _reference_grid(topology: Topology) -> dict[int, tuple[int, ...]]:
    """Row-major coordinates of every rank, enumerated independently of the code under test."""
    ranges = [range(size) for size in topology.shape]
    return dict(enumerate(itertools.product(*ranges)))


def _reference_group(topology: Topology, rank: int, axis: int) -> list[int]:
    grid = _reference_grid(topology)
    mine = grid[rank]
    return sorted(
        r for r, c in grid.items() if all(c[i] == mine[i] for i in range(len(c)) if i != axis)
    )


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=lambda t: "x".join(map(str, t.shape)))
def test_mesh_matches_topology(topology: Topology, tmp_path: object) -> None:
    world_size = topology.world_size
    results = run_on_mesh(
        _describe_mesh, world_size, topology=topology, timeout_s=77.0, store_dir=tmp_path
    )
    grid = _reference_grid(topology)
    for rank, result in enumerate(results):
        assert result["names"] == ("pp", "dp", "ep", "sp", "tp")
        assert tuple(result["coordinate"]) == grid[rank]
        assert result["sizes"] == dict(zip(Topology.AXES, topology.shape, strict=True))
        for axis_index, axis in enumerate(Topology.AXES):
            expected = _reference_group(topology, rank, axis_index)
            assert result["groups"][axis] == expected
            assert sorted(topology.ranks_along(axis, rank)) == expected
            assert result["timeouts"][axis] == timedelta(seconds=77)


def _describe_mesh_with_timeout(mesh: object, topology: Topology) -> dict[str, object]:
    # run_on_mesh built the default group (and a first mesh) with its own timeout; this mesh
    # asks for another one explicitly.
    return _describe_mesh(build_mesh(topology, timeout=timedelta(seconds=123)))


def test_explicit_timeout_reaches_every_axis_group(tmp_path: object) -> None:
    topology = Topology(dp=2, tp=2)
    results = run_on_mesh(
        _describe_mesh_with_timeout, 4, args=(topology,), topology=topology, timeout_s=77.0
    )
    for result in results:
        # Every axis, the full-world dp x tp ones included, has the requested timeout.
        assert result["timeouts"] == dict.fromkeys(Topology.AXES, timedelta(seconds=123))


def _build_without_timeout_options(mesh: object) -> str:
    import deepshard.comm.mesh as mesh_module

    def unreadable(device_type: str) -> None:
        return None

    mesh_module._default_group_timeout = unreadable  # type: ignore[assignment]
    try:
        build_mesh(Topology(dp=2))
    except CommError as error:
        return str(error)
    return "no error"


def test_unreadable_default_timeout_is_refused_not_replaced(tmp_path: object) -> None:
    for message in run_on_mesh(_build_without_timeout_options, 2, store_dir=tmp_path):
        assert "'gloo'" in message and "cannot be read" in message
        assert "init_device_mesh" in message


def test_backend_without_timeout_options_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepshard.comm.mesh as mesh_module

    monkeypatch.setattr(mesh_module, "_backend_for", lambda device_type: "mpi")
    monkeypatch.setattr(
        mesh_module, "_default_group_timeout", lambda device_type: timedelta(minutes=5)
    )
    for timeout in (None, timedelta(seconds=9)):
        with pytest.raises(CommError, match=r"'mpi'.*take no timeout options"):
            mesh_module._timeout_overrides(Topology(dp=2), "cpu", timeout)


def test_mismatched_topology_names_both_sizes(tmp_path: object) -> None:
    results = run_on_mesh(_build_mismatched, 2, args=(Topology(dp=2, tp=2),), store_dir=tmp_path)
    for message in results:
        assert "4 ranks" in message
        assert "has 2" in message


def test_build_mesh_needs_a_process_group() -> None:
    assert not dist.is_initialized()
    with pytest.raises(CommError, match="init_distributed"):
        build_mesh(Topology(dp=1))
