"""--include/--exclude/--num_nodes/--num_gpus resolved against the hostfile's real slots."""

from __future__ import annotations

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import parse_resource_spec, resolve_resources

POOL = {"worker-0": 4, "worker-1": 4, "worker-2": 2}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("worker-0", {"worker-0": None}),
        ("worker-0:0,2@worker-1", {"worker-0": [0, 2], "worker-1": None}),
        ("worker-0:2,0,2", {"worker-0": [0, 2]}),
        ("worker-0:1@worker-0:3", {"worker-0": [1, 3]}),
        ("worker-0:1@worker-0", {"worker-0": None}),
    ],
    ids=["whole-host", "deepspeed-example", "sorted-unique", "merged", "whole-wins"],
)
def test_spec_syntax(spec: str, expected: dict[str, list[int] | None]) -> None:
    assert parse_resource_spec(spec) == expected


@pytest.mark.parametrize("spec", ["@worker-0", "worker-0:", "worker-0:a", "worker-0:-1", ":1"])
def test_malformed_specs_are_errors(spec: str) -> None:
    with pytest.raises(LaunchError, match="--include"):
        parse_resource_spec(spec, "--include")


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}),
        ({"include": "worker-1:1,3@worker-0:0"}, {"worker-0": [0], "worker-1": [1, 3]}),
        ({"include": "worker-2"}, {"worker-2": [0, 1]}),
        (
            {"exclude": "worker-1:0,2"},
            {"worker-0": [0, 1, 2, 3], "worker-1": [1, 3], "worker-2": [0, 1]},
        ),
        ({"exclude": "worker-0@worker-2:1"}, {"worker-1": [0, 1, 2, 3], "worker-2": [0]}),
        ({"exclude": "worker-2:0,1"}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_nodes": 2}, {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}),
        ({"num_slots": 2}, {"worker-0": [0, 1], "worker-1": [0, 1], "worker-2": [0, 1]}),
        ({"num_nodes": 1, "num_slots": 3}, {"worker-0": [0, 1, 2]}),
    ],
    ids=[
        "no-filter",
        "include-keeps-hostfile-order",
        "include-whole-host",
        "exclude-slots",
        "exclude-host-and-slot",
        "exclude-empties-a-host",
        "num-nodes",
        "num-gpus",
        "both-counts",
    ],
)
def test_filters_resolve_against_the_pool(
    kwargs: dict[str, object], expected: dict[str, list[int]]
) -> None:
    resolved = resolve_resources(POOL, **kwargs)  # type: ignore[arg-type]
    assert resolved == expected
    assert list(resolved) == list(expected)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"include": "worker-0", "exclude": "worker-1"},
            "--include and --exclude cannot be used together",
        ),
        ({"include": "worker-9"}, "--include: host 'worker-9' is not in the hostfile"),
        ({"exclude": "worker-9:0"}, "--exclude: host 'worker-9' is not in the hostfile"),
        (
            {"include": "worker-2:2"},
            "--include: slot 2 of host 'worker-2' does not exist; it has 2 slots",
        ),
        ({"exclude": "worker-0:4"}, "--exclude: slot 4 of host 'worker-0' does not exist"),
        ({"exclude": "worker-0@worker-1@worker-2"}, "removes every slot"),
        ({"include": "worker-0", "num_nodes": 1}, "--include cannot be combined with --num_nodes"),
        ({"exclude": "worker-0", "num_slots": 1}, "--exclude cannot be combined"),
        ({"num_nodes": 4}, "--num_nodes 4 asks for more hosts than the 3 available"),
        ({"num_nodes": 0}, "--num_nodes must be at least 1"),
        ({"num_slots": 3}, "asks for more slots than host 'worker-2' has (2)"),
    ],
    ids=[
        "both-flags",
        "unknown-include-host",
        "unknown-exclude-host",
        "include-slot-out-of-range",
        "exclude-slot-out-of-range",
        "nothing-left",
        "include-with-count",
        "exclude-with-count",
        "too-many-nodes",
        "zero-nodes",
        "too-many-slots",
    ],
)
def test_filter_errors_say_which(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchError) as caught:
        resolve_resources(POOL, **kwargs)  # type: ignore[arg-type]
    assert message in str(caught.value)
