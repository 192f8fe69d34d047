"""Argument checks shared by the collectives: the group, the reduction op, output tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, TypeAlias

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from deepshard.interface.errors import CommError

__all__ = [
    "Group",
    "ReduceOpLike",
    "barrier_device_ids",
    "check_avg_dtype",
    "check_output",
    "has_native_avg",
    "resolve_group",
    "resolve_reduce_op",
]

Group: TypeAlias = dist.ProcessGroup | DeviceMesh
"""A process group, or a 1-D device mesh (e.g. `mesh["tp"]`) standing for its group."""

ReduceOpName = Literal["sum", "avg", "max", "min", "product"]
ReduceOpLike: TypeAlias = ReduceOpName | dist.ReduceOp | dist.ReduceOp.RedOpType

_OPS: dict[str, dist.ReduceOp.RedOpType] = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}

# Backends whose reductions take ReduceOp.AVG directly. Elsewhere (gloo before recent PyTorch
# releases, mpi, custom backends) `avg` is a `sum` followed by a division by the group size, which
# gives the same result on every backend and PyTorch version.
_NATIVE_AVG_BACKENDS = frozenset({"nccl", "xccl"})


def resolve_group(group: Group | None) -> dist.ProcessGroup:
    """The process group behind `group`; the default (world) group for `None`.

    Raises:
        CommError: If `group` is a mesh with more than one axis or not a group at all, or is
            `None` before the default group exists.
    """
    if group is None:
        world = dist.group.WORLD if dist.is_initialized() else None
        if not isinstance(world, dist.ProcessGroup):
            raise CommError(
                "group=None means the default process group, which does not exist yet; call "
                "deepshard.comm.init_distributed() first, or pass group= explicitly."
            )
        return world
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            names = group.mesh_dim_names or ()
            raise CommError(
                f"A collective needs a 1-D mesh, got one with axes {names} (shape "
                f"{tuple(group.shape)}); pass the axis it runs along, e.g. mesh['tp']."
            )
        return group.get_group()
    if isinstance(group, dist.ProcessGroup):
        return group
    raise CommError(
        f"group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, got "
        f"{type(group).__name__}."
    )


def resolve_reduce_op(op: ReduceOpLike) -> dist.ReduceOp.RedOpType:
    """The `RedOpType` for a name ("sum", "avg", "max", "min", "product") or a ReduceOp.

    Raises:
        CommError: If `op` is an unknown name or type.
    """
    if isinstance(op, str):
        found = _OPS.get(op.lower())
        if found is None:
            raise CommError(f"Unknown reduction op {op!r}; use one of {sorted(_OPS)}.")
        return found
    if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
        # ReduceOp instances and RedOpType members compare equal to the matching member.
        for red_type in _OPS.values():
            if op == red_type:
                return red_type
        raise CommError(f"Reduction op {op} is not supported; use one of {sorted(_OPS)}.")
    raise CommError(f"op must be a name in {sorted(_OPS)} or a ReduceOp, got {type(op).__name__}.")


def has_native_avg(pg: dist.ProcessGroup) -> bool:
    """Whether `pg`'s backend reduces with ReduceOp.AVG itself."""
    return dist.get_backend(pg) in _NATIVE_AVG_BACKENDS


def check_avg_dtype(tensor: torch.Tensor) -> None:
    """Refuse an average of integers, which the division cannot represent.

    Raises:
        CommError: If `tensor` is not floating point or complex.
    """
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise CommError(
            f"op='avg' needs a floating-point tensor, got {tensor.dtype}; reduce with op='sum' "
            "and divide yourself, or cast to a float dtype first."
        )


def check_output(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    accepted_shapes: Sequence[tuple[int, ...]],
    what: str,
) -> None:
    """Refuse a caller-given output of the wrong shape, dtype or device.

    Args:
        output: The caller's output tensor.
        input: The collective's input (gives the dtype and device).
        accepted_shapes: The exact shapes the collective can write; the first is the one it
            allocates itself.
        what: What the output holds, for the message.

    Raises:
        CommError: Naming the accepted shapes and dtype, or the two devices.
    """
    shapes = [tuple(shape) for shape in accepted_shapes]
    if tuple(output.shape) not in shapes or output.dtype != input.dtype:
        wanted = " or ".join(str(shape) for shape in shapes)
        raise CommError(
            f"output for the {what} must have shape {wanted} and dtype {input.dtype}, got "
            f"shape {tuple(output.shape)} of {output.dtype}; pass output=None to allocate it."
        )
    if output.device != input.device:
        raise CommError(
            f"output is on {output.device} but input on {input.device}; put both on one device."
        )


def barrier_device_ids(backend: str, device_ids: Sequence[int] | None) -> list[int] | None:
    """The `device_ids` to hand `dist.barrier` on `backend`: forwarded to nccl only."""
    if device_ids is not None and backend == "nccl":
        return list(device_ids)
    return None
