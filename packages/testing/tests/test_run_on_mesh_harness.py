"""run_on_mesh: results, arguments, topology and environment reach the ranks and come back."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deepshard.interface import Topology
from deepshard.interface.errors import ConfigError, TopologyError
from deepshard.testing import run_on_mesh


@dataclasses.dataclass(frozen=True)
class Scale:
    """A test-module type: it must unpickle in the ranks and back in the parent."""

    factor: float


def _identify(mesh: object) -> dict[str, int]:
    return {
        "mesh_rank": mesh.get_rank(),  # type: ignore[attr-defined]
        "dist_rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "threads": torch.get_num_threads(),
    }


def _scaled_sum(mesh: object, base: torch.Tensor, scale: Scale, *, offset: float) -> object:
    contribution = base * (mesh.get_rank() + 1) * scale.factor  # type: ignore[attr-defined]
    total = contribution.clone()
    dist.all_reduce(total)
    return {"contribution": contribution, "total": total, "scale": scale, "offset": offset}


def _axis_sizes(mesh: object) -> dict[str, int]:
    return {name: mesh[name].size() for name in Topology.AXES}  # type: ignore[index]


def _read_env(mesh: object, name: str) -> str | None:
    return os.environ.get(name)


def _print_and_return(mesh: object) -> int:
    print(f"hello from rank {mesh.get_rank()}")  # type: ignore[attr-defined]
    return 0


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_come_back_in_rank_order(world_size: int, tmp_path: Path) -> None:
    results = run_on_mesh(_identify, world_size, store_dir=tmp_path)
    assert [r["mesh_rank"] for r in results] == list(range(world_size))
    assert [r["dist_rank"] for r in results] == list(range(world_size))
    assert [r["env_rank"] for r in results] == list(range(world_size))
    assert {r["world"] for r in results} == {world_size}


def test_ranks_use_one_thread_unless_the_caller_chose(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert {r["threads"] for r in run_on_mesh(_identify, 2, store_dir=tmp_path)} == {1}
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert {r["threads"] for r in run_on_mesh(_identify, 2, store_dir=tmp_path)} == {2}


def test_args_kwargs_and_tensors_round_trip(tmp_path: Path) -> None:
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    scale = Scale(0.5)
    results = run_on_mesh(
        _scaled_sum, 4, args=(base, scale), kwargs={"offset": 1.25}, store_dir=tmp_path
    )
    expected_total = sum(base * (rank + 1) * scale.factor for rank in range(4))
    for rank, result in enumerate(results):
        assert result["scale"] == scale
        assert result["offset"] == 1.25
        torch.testing.assert_close(result["contribution"], base * (rank + 1) * scale.factor)
        torch.testing.assert_close(result["total"], expected_total)


def test_topology_reaches_the_mesh(tmp_path: Path) -> None:
    topology = Topology(dp=1, tp=2, sp=2)
    results = run_on_mesh(_axis_sizes, 4, topology=topology, store_dir=tmp_path)
    expected = dict(zip(Topology.AXES, topology.shape, strict=True))
    assert results == [expected] * 4


def test_default_topology_is_pure_data_parallel(tmp_path: Path) -> None:
    results = run_on_mesh(_axis_sizes, 2, store_dir=tmp_path)
    assert results == [{"pp": 1, "dp": 2, "ep": 1, "sp": 1, "tp": 1}] * 2


def test_ranks_see_the_callers_current_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DEEPSHARD_HARNESS_MARKER", "set-by-this-test")
    results = run_on_mesh(_read_env, 2, args=("DEEPSHARD_HARNESS_MARKER",), store_dir=tmp_path)
    assert results == ["set-by-this-test"] * 2


def test_rank_output_is_echoed_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_on_mesh(_print_and_return, 2, store_dir=tmp_path)
    err = capsys.readouterr().err
    for rank in range(2):
        assert f"----- rank {rank} output -----\nhello from rank {rank}" in err


def test_fixture_binds_the_store_to_tmp_path(run_on_mesh: object, tmp_path: Path) -> None:
    assert run_on_mesh(_identify, 2)[1]["mesh_rank"] == 1  # type: ignore[operator]
    logs = sorted(p.name for p in tmp_path.glob("run_on_mesh-*/rank*.log"))
    assert logs == ["rank0.log", "rank1.log"]


def test_lambda_is_rejected_before_starting_ranks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="module-level function"):
        run_on_mesh(lambda mesh: 0, 2, store_dir=tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_bad_world_size_is_rejected(world_size: object, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="world_size"):
        run_on_mesh(_identify, world_size, store_dir=tmp_path)  # type: ignore[arg-type]


def test_topology_that_does_not_fit_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(TopologyError):
        run_on_mesh(_identify, 2, topology=Topology(dp=2, tp=2), store_dir=tmp_path)
