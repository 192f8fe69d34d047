"""The group a checkpoint is saved over, and JSON exchanged between its ranks without pickles.

``torch.distributed.all_gather_object`` pickles, and unpickling is what this package refuses
to do anywhere. Ranks exchange JSON instead: its byte length first, then the bytes padded to
the longest, both as uint8/int64 tensors. Every wait is bounded, so a rank that crashed turns
into a `CheckpointError` on the others instead of a hang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deepshard.comm import Group, resolve_group
from deepshard.interface.errors import CheckpointError, CommError

__all__ = ["Members", "all_gather_json", "members_of"]


@dataclass(frozen=True)
class Members:
    """The ranks taking part in a save or load.

    Attributes:
        group: The process group, or ``None`` for a single process without one.
        rank: This process's rank in ``group``.
        world_size: The size of ``group``.
    """

    group: dist.ProcessGroup | None
    rank: int
    world_size: int


def members_of(group: Group | None) -> Members:
    """The members of ``group``: the world by default, or this process alone without one."""
    if group is None and not dist.is_initialized():
        return Members(None, 0, 1)
    try:
        pg = resolve_group(group)
    except CommError as exc:
        raise CheckpointError(f"group: {exc}") from exc
    return Members(pg, dist.get_rank(pg), dist.get_world_size(pg))


def _device(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group))
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(
    tensor: torch.Tensor, members: Members, timeout_s: float, what: str
) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(members.world_size)]
    try:
        work = dist.all_gather(out, tensor, group=members.group, async_op=True)
        assert work is not None  # async_op=True always returns the work
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise CheckpointError(
            f"rank {members.rank}: the other ranks did not reach {what} within {timeout_s:.0f} "
            f"s (a rank crashed or is stuck; see its log), or the exchange failed: {exc}"
        ) from exc
    return out


def all_gather_json(value: Any, members: Members, *, timeout_s: float, what: str) -> list[Any]:
    """Every rank's ``value`` (JSON-serialisable), in rank order.

    Args:
        value: What this rank contributes.
        members: The group (``members.group is None`` returns ``[value]``).
        timeout_s: Longest wait for the other ranks.
        what: The step, named in the error when the wait runs out.
    """
    if members.group is None:
        return [json.loads(json.dumps(value))]
    payload = json.dumps(value, separators=(",", ":")).encode()
    device = _device(members.group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = [int(t.item()) for t in _gather(length, members, timeout_s, what)]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = _gather(buffer.to(device), members, timeout_s, what)
    return [
        json.loads(bytes(t[:n].cpu().tolist()).decode())
        for t, n in zip(gathered, lengths, strict=True)
    ]
