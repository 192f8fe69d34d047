"""Hostfiles: the accepted lines, and every malformed file named by path and line."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import parse_hostfile, parse_hostfile_text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("worker-0 slots=4\nworker-1 slots=2\n", {"worker-0": 4, "worker-1": 2}),
        (
            "# cluster\n\nworker-1 slots=1\n  \nworker-0 slots=8 # gpu box\n",
            {"worker-1": 1, "worker-0": 8},
        ),
        ("node1\tslots = 3", {"node1": 3}),
        ("10.0.0.7 slots=16\n", {"10.0.0.7": 16}),
        ("worker-0 slots=8 max_slots=8\nworker-1 slots=4\n", {"worker-0": 8, "worker-1": 4}),
    ],
    ids=["two-hosts", "comments-blank-lines-order", "tab-and-spaces", "ip-address", "max-slots"],
)
def test_valid_hostfiles_keep_file_order(text: str, expected: dict[str, int]) -> None:
    parsed = parse_hostfile_text(text, "hf")
    assert parsed == expected
    assert list(parsed) == list(expected)


@pytest.mark.parametrize(
    ("text", "where", "words"),
    [
        ("worker-0 slots=4\nworker-1 slot=4\n", "hf:2", "not a hostfile entry"),
        ("worker-0\n", "hf:1", "not a hostfile entry"),
        ("worker-0 slots=4 extra\n", "hf:1", "not a hostfile entry"),
        ("worker-0 slots=4 max_slot=4\n", "hf:1", "not a hostfile entry"),
        ("worker-0 slots=-1\n", "hf:1", "not a hostfile entry"),
        ("worker-0 slots=0\n", "hf:1", "at least 1"),
        ("a slots=1\n\nb slots=1\na slots=2\n", "hf:4", "first on line 1"),
        ("user@host slots=1\n", "hf:1", "'@'"),
        ("host:1 slots=1\n", "hf:1", "':'"),
    ],
    ids=[
        "misspelled",
        "no-slots",
        "trailing-junk",
        "max-slot-typo",
        "negative",
        "zero",
        "duplicate",
        "at",
        "colon",
    ],
)
def test_malformed_lines_name_file_and_line(text: str, where: str, words: str) -> None:
    with pytest.raises(LaunchError) as caught:
        parse_hostfile_text(text, "hf")
    assert str(caught.value).startswith(f"{where}:"), caught.value
    assert words in str(caught.value)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n   # another\n"])
def test_a_file_without_hosts_is_an_error(text: str) -> None:
    with pytest.raises(LaunchError, match=r"^hf: the hostfile names no host"):
        parse_hostfile_text(text, "hf")


def test_parse_hostfile_reads_the_file_and_names_it(tmp_path: Path) -> None:
    good = tmp_path / "hostfile"
    good.write_text("worker-0 slots=2\n")
    assert parse_hostfile(good) == {"worker-0": 2}
    bad = tmp_path / "bad"
    bad.write_text("worker-0 slots=2\nworker-0 slots=2\n")
    with pytest.raises(LaunchError, match=rf"^{bad}:2: host 'worker-0' is listed again"):
        parse_hostfile(bad)
    with pytest.raises(LaunchError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "missing")
