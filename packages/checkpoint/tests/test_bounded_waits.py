"""A rank that never reports (crashed mid-save) turns into a prompt `CheckpointError` naming
it on rank 0, instead of a hang; a bad group is refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import save
from deepshard.checkpoint._exchange import Members
from deepshard.checkpoint._plan import plan_rank
from deepshard.checkpoint._save import _Job, _run
from deepshard.interface.errors import CheckpointError


def test_rank_zero_gives_up_on_a_silent_rank(tmp_path: Path) -> None:
    tmp_dir = tmp_path / ".tmp-t-x"
    tmp_dir.mkdir()
    plan = plan_rank([("x", torch.ones(4))], 0)
    # Rank 0 of a world of 2 whose rank 1 died before writing anything.
    job = _Job(Members(None, 0, 2), tmp_path, tmp_dir, "t", plan, {}, True, None, None, 0.3)
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not finish writing 't' within"):
        _run(job)
    assert time.monotonic() - start < 5
    assert not (tmp_path / "t").exists() and not (tmp_path / "latest").exists()


def test_a_bad_group_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="group: "):
        save({"x": torch.ones(1)}, tmp_path, tag="t", group="world")  # type: ignore[arg-type]
