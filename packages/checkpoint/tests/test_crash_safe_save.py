"""A save killed (SIGKILL) at any point leaves `latest` loadable; damaged files are named.

Each kill runs the save in a forked child whose save hook SIGKILLs it at one `SavePoint`; the
parent then loads what `latest` names and checks it is exactly one of the two saved states.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from deepshard.checkpoint import SAVE_POINTS, ShardedTensor, list_tags, load, save, verify
from deepshard.interface import ShardMap
from deepshard.interface.errors import CheckpointError, PartialLoadError

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


class _KillAt:
    def __init__(self, point: str) -> None:
        self.point = point

    def reached(self, point: str, rank: int) -> None:
        if point == self.point:
            os.kill(os.getpid(), signal.SIGKILL)


def _state(value: float) -> dict[str, torch.Tensor]:
    # 256 KiB of data, so that "mid_file" leaves a genuinely partial file.
    return {"w": torch.full((256, 256), value), "step": torch.tensor(int(value))}


def _save_in_child_killed_at(root: Path, point: str) -> None:
    pid = os.fork()
    if pid == 0:  # the child: save, and be killed by the hook
        try:
            # the parent's OpenMP pool does not survive fork (a parallel region would wait on
            # its threads forever): run torch's ops inline here, whatever OMP_NUM_THREADS says
            torch.set_num_threads(1)
            save(_state(2.0), root, tag="second", hooks=_KillAt(point))
        finally:
            os._exit(3)  # reached only if the hook did not kill us
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, point


@pytest.mark.parametrize("point", SAVE_POINTS)
def test_sigkill_at_any_point_leaves_latest_loadable(tmp_path: Path, point: str) -> None:
    save(_state(1.0), tmp_path, tag="first")
    _save_in_child_killed_at(tmp_path, point)
    if point == "mid_file":
        (partial,) = tmp_path.glob(".tmp-second-*/*.safetensors")
        assert 0 < partial.stat().st_size < 256 * 256 * 4
    target = {"w": torch.zeros(256, 256), "step": torch.tensor(0)}
    result = load(tmp_path, target)
    expected = 2.0 if point == "after_latest" else 1.0
    assert result.path.name == ("second" if point == "after_latest" else "first")
    assert torch.equal(target["w"], _state(expected)["w"]) and int(target["step"]) == expected
    # A tag appears only once complete: after the rename, never before.
    complete = point in ("after_rename", "after_latest")
    assert list_tags(tmp_path) == (["first", "second"] if complete else ["first"])
    # The next save of the same tag succeeds and clears the crashed one's temporary directory.
    save(_state(3.0), tmp_path, tag="second")
    assert not list(tmp_path.glob(".tmp-*"))
    assert load(tmp_path, target).path.name == "second" and int(target["step"]) == 3


def _data_file(root: Path) -> Path:
    (path,) = (root / "t").glob("*.safetensors")
    return path


def test_flipped_byte_is_named(tmp_path: Path) -> None:
    save(_state(1.0), tmp_path, tag="t")
    path = _data_file(tmp_path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    target = {"w": torch.zeros(256, 256), "step": torch.tensor(0)}
    # Checked where the bytes landed: the error says the target was written.
    message = rf"{path.name} does not match its XXH3-64.*partly overwritten"
    with pytest.raises(PartialLoadError, match=message):
        load(tmp_path, target)
    assert not torch.equal(target["w"], torch.zeros(256, 256))
    report = verify(tmp_path)
    assert not report.ok and any(path.name in p for p in report.problems)


def test_truncated_and_missing_files_are_named(tmp_path: Path) -> None:
    save(_state(1.0), tmp_path, tag="t")
    assert verify(tmp_path).ok
    path = _data_file(tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:-100])
    like = {"w": torch.zeros(256, 256), "step": torch.tensor(0)}
    with pytest.raises(CheckpointError, match=rf"{path.name} has {len(data) - 100} bytes") as info:
        load(tmp_path, like, verify_checksums=False)
    assert not isinstance(info.value, PartialLoadError)  # found before anything was written
    assert torch.equal(like["w"], torch.zeros(256, 256))
    path.unlink()
    with pytest.raises(CheckpointError, match=rf"{path.name} is missing"):
        load(tmp_path, like)
    assert any("is missing" in p for p in verify(tmp_path / "t").problems)


def test_truncated_metadata_is_an_error(tmp_path: Path) -> None:
    save(_state(1.0), tmp_path, tag="t")
    meta = tmp_path / "t" / "metadata.json"
    text = meta.read_text()
    json.loads(text)
    meta.write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match=r"metadata.json is unreadable or truncated"):
        load(tmp_path, {"w": torch.zeros(256, 256), "step": torch.tensor(0)})
    assert list_tags(tmp_path) == []
    assert "truncated" in verify(tmp_path).problems[0]


def test_load_checks_the_blocks_it_reads(tmp_path: Path) -> None:
    # Two 16 MiB tensors: `b` lies in other 16 MiB hashed blocks than the start of `a`.
    n = 4 << 20
    save({"a": torch.ones(n), "b": torch.full((n,), 2.0)}, tmp_path, tag="t")
    path = _data_file(tmp_path)
    with open(path, "r+b") as handle:  # flip one byte near the end: inside `b`
        handle.seek(-10, os.SEEK_END)
        byte = handle.read(1)
        handle.seek(-10, os.SEEK_END)
        handle.write(bytes([byte[0] ^ 0x80]))
    head = {"a": torch.zeros(1 << 20)}
    rows = ShardMap.contiguous_split((n,), "float32", dim=0, sizes=[1 << 20, n - (1 << 20)])
    load(tmp_path, {"a": ShardedTensor(head["a"], rows, 0)}, strict=False)
    assert torch.equal(head["a"], torch.ones(1 << 20))  # its blocks are intact
    with pytest.raises(CheckpointError, match=rf"{path.name} does not match its XXH3-64"):
        load(tmp_path, {"b": torch.zeros(n)}, strict=False)
    assert not verify(tmp_path).ok
