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
from deepshard.checkpoint._handle import SaveHandle
from deepshard.checkpoint._hash_threads import HashThreads
from deepshard.checkpoint._host_buffers import snapshot
from deepshard.checkpoint._layout import (
    FORMAT_NAME,
    FORMAT_VERSION,
    METADATA,
    TMP_PREFIX,
    check_tag,
    data_file_name,
)
from deepshard.checkpoint._plan import RankPlan, merge_reports, plan_rank
from deepshard.checkpoint._safetensors_io import BLOCK_BYTES, write_safetensors
from deepshard.checkpoint._types import JSONValue, SaveHooks, StateValue, state_items
from deepshard.comm import Group
from deepshard.interface.errors import CheckpointError

__all__ = ["save"]

_POLL_S = 0.005


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
    hashers: HashThreads | None = None
    max_file_bytes: int | None = None

    def reached(self, point: Any) -> None:
        if self.hooks is not None:
            self.hooks.reached(point, self.members.rank)


def _report_path(tmp_dir: Path, rank: int) -> Path:
    return tmp_dir / f".report-{rank:05d}.json"


def _split(
    entries: list[tuple[str, torch.Tensor]], max_bytes: int | None
) -> list[list[tuple[str, torch.Tensor]]]:
    """Entries grouped into files of at most ``max_bytes`` (a larger entry gets its own)."""
    parts: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in entries:
        nbytes = tensor.numel() * tensor.element_size()
        if max_bytes is not None and parts[-1] and size + nbytes > max_bytes:
            parts.append([])
            size = 0
        parts[-1].append((name, tensor))
        size += nbytes
    return parts


def _write_part(job: _Job) -> None:
    rank, world = job.members.rank, job.members.world_size
    report: dict[str, Any] = {"rank": rank, "error": None, "files": [], "entry_file": {}}
    try:
        job.reached("before_files")
        parts = _split(job.plan.entries, job.max_file_bytes)
        for index, entries in enumerate(parts):
            file = data_file_name(rank, world, index if len(parts) > 1 else None)
            digest = write_safetensors(
                job.tmp_dir / file,
                entries,
                halfway=(lambda: job.reached("mid_file")) if index == 0 else None,
                hashers=job.hashers,
            )
            report["files"].append(
                {
                    "file": file,
                    "sha256": digest.sha256,
                    "size": digest.size,
                    "blocks": digest.blocks,
                    "fast_blocks": digest.fast_blocks,
                }
            )
            report["entry_file"].update({name: file for name, _ in entries})
        report["pieces"] = job.plan.pieces
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
        f["file"]: {
            "rank": r["rank"],
            "sha256": f["sha256"],
            "size": f["size"],
            "block_bytes": BLOCK_BYTES,
            "block_sha256": list(f["blocks"]),
            "block_xxh3": list(f["fast_blocks"]),
        }
        for r in reports
        for f in r["files"]
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
    try:
        _write_part(job)
    finally:
        if job.hashers is not None:
            job.hashers.close()
    if job.members.rank == 0:
        return _publish_tag(job)
    return job.save_dir / job.tag


def _start(save_dir: Path, tag: str, members: Members, timeout_s: float) -> Path:
    """Step 1: rank 0 makes the temporary directory; every rank learns its name."""
    status: dict[str, Any] = {"token": uuid.uuid4().hex[:12], "error": None, "tag": tag}
    if members.rank == 0:
        try:
            save_dir.mkdir(parents=True, exist_ok=True)
            for stale in save_dir.glob(f"{TMP_PREFIX}{tag}-*"):
                _publish.remove_tree(stale)
            (save_dir / f"{TMP_PREFIX}{tag}-{status['token']}").mkdir()
        except OSError as exc:
            status["error"] = f"cannot create a directory in {save_dir}: {exc}"
    statuses = all_gather_json(
        status, members, timeout_s=timeout_s, what=f"the start of saving {tag!r}"
    )
    first = statuses[0]
    if first["error"] is not None:
        raise CheckpointError(f"rank 0: {first['error']}; pass a writable save_dir")
    tmp_dir = save_dir / f"{TMP_PREFIX}{tag}-{first['token']}"
    tags = [s["tag"] for s in statuses]
    if len(set(tags)) > 1:
        if members.rank == 0:
            _publish.remove_tree(tmp_dir)
        raise CheckpointError(
            f"the ranks save under different tags {tags} (by rank); every rank must pass the "
            "same tag (derive it from the global step, not from a rank-local counter)"
        )
    return tmp_dir


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
    max_file_bytes: int | None = None,
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
        after: A previous background save to wait for first; its error is raised here. A
            background save reuses its host buffers (or `prepare_async_save`'s).
        timeout_s: Longest wait for the other ranks at any step.
        max_file_bytes: Split each rank's data into files of at most this many bytes (an
            entry larger than that gets a file of its own); one file per rank when ``None``.

    Returns:
        A `SaveHandle`, already done unless ``async_save``.

    Raises:
        CheckpointError: Bad state, tag or metadata, or a failure on any rank.
    """
    reuse: dict[str, torch.Tensor] = {}
    if after is not None:
        after.wait()
        reuse = after._take_buffers()
    tag = check_tag(tag)
    items = state_items(state)
    document = _check_metadata(metadata)
    if keep_last is not None and (isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last={keep_last!r} must be an int >= 1, or None to keep all")
    if max_file_bytes is not None and (isinstance(max_file_bytes, bool) or max_file_bytes < 1):
        raise CheckpointError(f"max_file_bytes={max_file_bytes!r} must be >= 1, or None")
    members = members_of(group)
    root = Path(save_dir)
    tmp_dir = _start(root, tag, members, timeout_s)
    plan = snapshot(plan_rank(items, members.rank), copy=async_save, reuse=reuse)
    job = _Job(
        members,
        root,
        tmp_dir,
        tag,
        plan,
        document,
        save_latest,
        keep_last,
        hooks,
        timeout_s,
        HashThreads(2),  # hash and write; started here: a writer may outlive interpreter exit
        max_file_bytes,
    )
    handle = SaveHandle(root / tag)
    if async_save:
        handle._host_buffers = dict(plan.entries)
        atexit.register(handle._wait_at_exit)
        threading.Thread(
            target=_in_background, args=(job, handle), name="deepshard-checkpoint-save", daemon=True
        ).start()
        return handle
    _run_and_agree(job, handle)
    return handle


def _run_and_agree(job: _Job, handle: SaveHandle) -> None:
    """A synchronous save: run it, then make any rank's failure every rank's error."""
    error: str | None = None
    try:
        _run(job)
    except Exception as exc:
        error = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    try:
        outcomes = all_gather_json(
            error, job.members, timeout_s=job.timeout_s, what=f"the end of saving {job.tag!r}"
        )
    except CheckpointError as exc:  # a rank is gone: say what this rank saw first
        if job.members.rank == 0:
            _publish.remove_tree(job.tmp_dir)
        if error is None:
            raise
        raise CheckpointError(f"rank {job.members.rank}: {error}; then {exc}") from exc
    failures = [f"rank {r}: {e}" for r, e in enumerate(outcomes) if e is not None]
    if failures and job.members.rank == 0:  # every rank is past its writes: nobody needs it
        _publish.remove_tree(job.tmp_dir)
    handle._finish(CheckpointError("; ".join(failures)) if failures else None)
    handle.wait()


def _in_background(job: _Job, handle: SaveHandle) -> None:
    try:
        _run(job)
    except BaseException as exc:
        handle._finish(exc)
    else:
        handle._finish(None)
