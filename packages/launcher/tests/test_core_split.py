"""Sharing a node's cores between its ranks: whole physical cores, a user list, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import parse_core_list, split_cores


def _sysfs(tmp_path: Path, siblings: dict[int, str]) -> str:
    for cpu, listed in siblings.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(listed + "\n")
    return str(tmp_path)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("1,3-5,7", [1, 3, 4, 5, 7]), ("0", [0]), ("0-1,8-11", [0, 1, 8, 9, 10, 11])],
)
def test_core_list_syntax(spec: str, expected: list[int]) -> None:
    assert parse_core_list(spec) == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("1,,2", "is not a CPU id"),
        ("a-3", "is not a CPU id"),
        ("5-3", "runs backwards"),
        # As DeepSpeed's parse_range_list: items ascend and never overlap.
        ("8,2-6", "'2-6' does not come after CPU 8; list the CPUs in ascending order"),
        ("8-11,0-1", "'0-1' does not come after CPU 11"),
        ("1,0-2", "'0-2' does not come after CPU 1"),
        ("0-3,3", "'3' does not come after CPU 3"),
    ],
)
def test_bad_core_lists(spec: str, message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        parse_core_list(spec)


def test_hyperthread_siblings_stay_with_one_rank(tmp_path: Path) -> None:
    # 4 physical cores, 2 threads each, numbered the Linux way: cpu i and i+4 are siblings.
    sysfs = _sysfs(tmp_path, {i: f"{i % 4},{i % 4 + 4}" for i in range(8)})
    shares = split_cores(2, cpus=list(range(8)), sysfs=sysfs)
    assert shares == [((0, 1, 4, 5), 2), ((2, 3, 6, 7), 2)]


def test_remainder_cores_stay_unused_and_fewer_cores_than_ranks_split_threads(
    tmp_path: Path,
) -> None:
    sysfs = _sysfs(tmp_path, {0: "0", 1: "1", 2: "2"})
    assert split_cores(2, cpus=[0, 1, 2], sysfs=sysfs) == [((0,), 1), ((1,), 1)]
    paired = _sysfs(tmp_path / "paired", {0: "0-1", 1: "0-1"})
    assert split_cores(2, cpus=[0, 1], sysfs=paired) == [((0,), 1), ((1,), 1)]


def test_user_core_list_is_split_in_order(tmp_path: Path) -> None:
    shares = split_cores(2, core_list=[5, 1, 2, 7, 3], cpus=list(range(8)), sysfs=str(tmp_path))
    assert shares == [((1, 5), 2), ((2, 7), 2)]


def test_core_errors(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="names CPU 9, which this process may not use"):
        split_cores(1, core_list=[0, 9], cpus=[0, 1], sysfs=str(tmp_path))
    with pytest.raises(LaunchError, match="has 1 CPUs for 2 ranks"):
        split_cores(2, core_list=[0], cpus=[0, 1], sysfs=str(tmp_path))
    with pytest.raises(LaunchError, match="has 2 CPUs for 3 ranks"):
        split_cores(3, cpus=[0, 1], sysfs=str(tmp_path))
