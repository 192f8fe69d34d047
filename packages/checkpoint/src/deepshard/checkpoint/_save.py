"""``save``: every rank writes its shards, rank 0 writes the metadata and publishes the tag.

The steps, on a shared filesystem:

1. (collective) Rank 0 creates ``save_dir/.tmp-<tag>-<token>/`` and tells the others the token.
2. Each rank writes ``rank-<r>-of-<W>.safetensors`` (fsynced, hashed while written) and a small
   report (its file's digest and the pieces it wrote) next to it, atomically.
3. Rank 0 waits, bounded, for every report, merges them into ``metadata.json``, renames the
   directory to ``<tag>``, replaces ``latest`` and applies ``keep_last`` (`_publish`).
4. (collective, synchronous saves only) The ranks exchange their outcome, so a failure on any
   rank raises on all of them instead of leaving them waiting.

With ``async_save=True`` step 1 and a host copy of every shard happen before ``save``
returns; steps 2-3 run on a background thread (they need no collective, which would race the
training loop's), and the returned `SaveHandle` reports the outcome.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import Any

import torch

from deepshard.checkpoint import _publish
from deepshard.checkpoint._exchange import Members, all_gather_json, members_of
from deepshard.checkpoint._layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA,
    TMP_PREFIX,
    check_tag,
    data_file_name,
)
from deepshard.checkpoint._plan import RankPlan, merge_reports, plan_rank
from deepshard.checkpoint._safetensors_io import write_safetensors
from deepshard.checkpoint._types import JSONValue, SaveHooks, StateValue, state_items
from deepshard.comm import Group
from deepshard.interface.errors import CheckpointError

__all__ = ["SaveHandle", "save"]

_POLL_S = 0.005


class SaveHandle:
    """The outcome of a `save`; for a background save, a way to wait for it.

    A background save is also waited for at process exit. Pass the handle as ``after=`` to
    the next `save` or `load` so they wait for it first and raise its error.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        """The tag directory the save publishes."""
        self._done = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save has finished (successfully or not)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> Path:
        """Wait for the save and return its directory.

        Raises:
            CheckpointError: The save failed (the error it failed with), or it is still
                running after ``timeout_s``.
        """
        if not self._done.wait(timeout_s):
            raise CheckpointError(
                f"the save of {self.path} is still running after {timeout_s} s; wait longer"
            )
        if self._error is not None:
            if isinstance(self._error, CheckpointError):
                raise self._error
            raise CheckpointError(f"saving {self.path} failed: {self._error!r}") from self._error
        return self.path

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()
        atexit.unregister(self._wait_at_exit)

    def _wait_at_exit(self) -> None:
        self._done.wait()


@dataclass(frozen=True)
class _Job:
    members: Members
    save_dir: Path
    tmp_dir: Path
    tag: str
    plan: RankPlan
    metadata: dict[str, JSONValue]
    save_latest: bool
    keep_last: int | None
    hooks: SaveHooks | None
    timeout_s: float

    def reached(self, point: Any) -> None:
        if self.hooks is not None:
            self.hooks.reached(point, self.members.rank)


def _report_path(tmp_dir: Path, rank: int) -> Path:
    return tmp_dir / f".report-{rank:05d}.json"


def _write_part(job: _Job) -> None:
    rank, world = job.members.rank, job.members.world_size
    report: dict[str, Any] = {"rank": rank, "file": data_file_name(rank, world), "error": None}
    try:
        job.reached("before_files")
        digest = write_safetensors(
            job.tmp_dir / report["file"], job.plan.entries, halfway=lambda: job.reached("mid_file")
        )
        report.update(sha256=digest.sha256, size=digest.size, pieces=job.plan.pieces)
        report["shapes"] = {k: [list(s), d] for k, (s, d) in job.plan.shapes.items()}
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"
        _publish.write_json_atomic(_report_path(job.tmp_dir, rank), report)
        raise
    _publish.write_json_atomic(_report_path(job.tmp_dir, rank), report)
    job.reached("after_files")


def _await_reports(job: _Job) -> list[dict[str, Any]]:
    deadline = time.monotonic() + job.timeout_s
    reports: dict[int, dict[str, Any]] = {}
    while len(reports) < job.members.world_size:
        for rank in range(job.members.world_size):
            path = _report_path(job.tmp_dir, rank)
            if rank not in reports and path.exists():
                reports[rank] = json.loads(path.read_text(encoding="utf-8"))
                if reports[rank]["error"] is not None:
                    raise CheckpointError(
                        f"rank {rank} failed writing its shard of {job.tag!r}: "
                        f"{reports[rank]['error']}; the previous checkpoint stays in place"
                    )
        if len(reports) < job.members.world_size:
            if time.monotonic() > deadline:
                late = sorted(set(range(job.members.world_size)) - set(reports))
                raise CheckpointError(
                    f"ranks {late} did not finish writing {job.tag!r} within {job.timeout_s} "
                    "s (crashed or stuck; see their logs); the previous checkpoint stays in place"
                )
            time.sleep(_POLL_S)
    return [reports[r] for r in range(job.members.world_size)]


def _version(dist_name: str) -> str:
    try:
        return importlib_metadata.version(dist_name)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


def _publish_tag(job: _Job) -> Path:
    reports = _await_reports(job)
    files = {
        r["file"]: {"rank": r["rank"], "sha256": r["sha256"], "size": r["size"]} for r in reports
    }
    document = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "tag": job.tag,
        "world_size": job.members.world_size,
        "saved_at": time.time(),
        "versions": {
            "deepshard-checkpoint": _version("deepshard-checkpoint"),
            "torch": torch.__version__,
        },
        "metadata": job.metadata,
        "files": files,
        "tensors": merge_reports(reports),
    }
    for rank in range(job.members.world_size):
        _report_path(job.tmp_dir, rank).unlink()
    _publish.write_json_atomic(job.tmp_dir / METADATA, document)
    job.reached("after_metadata")
    final = _publish.publish(job.tmp_dir, job.save_dir, job.tag)
    job.reached("after_rename")
    if job.save_latest:
        _publish.write_latest(job.save_dir, job.tag)
        job.reached("after_latest")
    if job.keep_last is not None:
        _publish.prune(job.save_dir, job.keep_last)
    return final


def _run(job: _Job) -> Path:
    _write_part(job)
    if job.members.rank == 0:
        return _publish_tag(job)
    return job.save_dir / job.tag


def _start(save_dir: Path, tag: str, members: Members, timeout_s: float) -> Path:
    """Step 1: rank 0 makes the temporary directory; every rank learns its name."""
    status: dict[str, Any] = {"token": uuid.uuid4().hex[:12], "error": None}
    if members.rank == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            for stale in save_dir.glob(f"{TMP_PREFIX}{tag}-*"):
                _publish.remove_tree(stale)
            (save_dir / f"{TMP_PREFIX}{tag}-{status['token']}").mkdir()
        except OSError as exc:
            status["error"] = f"cannot create a directory in {save_dir}: {exc}"
    first = all_gather_json(
        status, members, timeout_s=timeout_s, what=f"the start of saving {tag!r}"
    )[0]
    if first["error"] is not None:
        raise CheckpointError(f"rank 0: {first['error']}; pass a writable save_dir")
    return save_dir / f"{TMP_PREFIX}{tag}-{first['token']}"


def _check_metadata(metadata: Mapping[str, JSONValue] | None) -> dict[str, JSONValue]:
    try:
        return dict(json.loads(json.dumps(dict(metadata or {}), allow_nan=False)))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"save metadata must be JSON-serialisable ({exc}); put tensors in the state and "
            "split other values with split_client_state"
        ) from exc


def save(
    state: Mapping[str, StateValue],
    save_dir: str | os.PathLike[str],
    *,
    tag: str,
    metadata: Mapping[str, JSONValue] | None = None,
    group: Group | None = None,
    save_latest: bool = True,
    keep_last: int | None = None,
    async_save: bool = False,
    hooks: SaveHooks | None = None,
    after: SaveHandle | None = None,
    timeout_s: float = 600.0,
) -> SaveHandle:
    """Save ``state`` to ``save_dir/<tag>/``; collective over ``group``.

    Args:
        state: Tensors (replicated: identical on every rank, rank 0 writes them) and
            `ShardedTensor` values (each rank writes the pieces it is the first holder of).
        save_dir: The checkpoint directory (shared by every rank).
        tag: The checkpoint's name, e.g. ``"global_step100"``; an existing tag is replaced.
        metadata: JSON-serialisable values stored in ``metadata.json``.
        group: The ranks saving (a process group or 1-D mesh); the world by default; none at
            all without ``torch.distributed``.
        save_latest: Point ``latest`` at this tag once it is complete.
        keep_last: Delete older complete tags beyond this many after the save succeeds (never
            the one ``latest`` names).
        async_save: Copy the shards to host memory and write them on a background thread.
        hooks: Told of each `SavePoint` (crash-injection tests).
        after: A previous background save to wait for first; its error is raised here.
        timeout_s: Longest wait for the other ranks at any step.

    Returns:
        A `SaveHandle`, already done unless ``async_save``.

    Raises:
        CheckpointError: Bad state, tag or metadata, or a failure on any rank.
    """
    if after is not None:
        after.wait()
    tag = check_tag(tag)
    items = state_items(state)
    document = _check_metadata(metadata)
    if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep all")
    members = members_of(group)
    root = Path(save_dir)
    tmp_dir = _start(root, tag, members, timeout_s)
    plan = plan_rank(items, members.rank)
    copy = async_save or any(
        t.device.type != "cpu" or not t.is_contiguous() for _, t in plan.entries
    )
    if copy:
        plan = RankPlan(
            [(k, t.to("cpu", copy=True).contiguous()) for k, t in plan.entries],
            plan.pieces,
            plan.shapes,
        )
    job = _Job(
        members, root, tmp_dir, tag, plan, document, save_latest, keep_last, hooks, timeout_s
    )
    handle = SaveHandle(root / tag)
    if async_save:
        atexit.register(handle._wait_at_exit)
        threading.Thread(
            target=_in_background, args=(job, handle), name="deepshard-checkpoint-save", daemon=True
        ).start()
        return handle
    error: str | None = None
    try:
        _run(job)
    except Exception as exc:
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    outcomes = all_gather_json(
        error, members, timeout_s=timeout_s, what=f"the end of saving {tag!r}"
    )
    failures = [f"rank {r}: {e}" for r, e in enumerate(outcomes) if e is not None]
    handle._finish(CheckpointError("; ".join(failures)) if failures else None)
    handle.wait()
    return handle


def _in_background(job: _Job, handle: SaveHandle) -> None:
    try:
        _run(job)
    except BaseException as exc:
        handle._finish(exc)
    else:
        handle._finish(None)
