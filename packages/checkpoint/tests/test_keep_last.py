"""`keep_last=N` deletes older complete tags after a successful save, never the one `latest`
names and never the only complete checkpoint; a failed save deletes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import list_tags, load, save
from deepshard.interface.errors import CheckpointError


class _Fail:
    def reached(self, point: str, rank: int) -> None:
        if point == "after_files":
            raise OSError("injected")


def test_keep_last_retention(tmp_path: Path) -> None:
    state = {"x": torch.ones(2)}
    for step in range(3):
        save(state, tmp_path, tag=f"s{step}", keep_last=2)
    assert list_tags(tmp_path) == ["s1", "s2"]
    # A tag saved without moving `latest` survives retention while `latest` names it.
    save(state, tmp_path, tag="s3", save_latest=False, keep_last=1)
    assert list_tags(tmp_path) == ["s2", "s3"]
    assert load(tmp_path, {"x": torch.zeros(2)}).path.name == "s2"
    with pytest.raises(CheckpointError, match="injected"):
        save(state, tmp_path, tag="s4", keep_last=1, hooks=_Fail())
    assert list_tags(tmp_path) == ["s2", "s3"]
    save(state, tmp_path, tag="s5", keep_last=1)
    assert list_tags(tmp_path) == ["s5"] and not list(tmp_path.glob(".tmp-*"))


def test_keep_last_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="keep_last=0 must be an int >= 1"):
        save({"x": torch.ones(2)}, tmp_path, tag="t", keep_last=0)
