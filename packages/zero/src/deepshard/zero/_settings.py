"""What of a config ZeRO can run, and the message sizes it communicates in.

Settings this package does not run are refused with the key path to change (`zero_problems`).

**Message sizes** (`message_numel`). ``reduce_bucket_size`` and ``allgather_bucket_size`` bound
the elements one collective moves; DeepSpeed's defaults (5e8) make every unit of a
model below 500M parameters one bucket, reduced and gathered in one call each. On CPU (gloo) one
call over more than ~32 MB is slow: gloo's reduce-scatter and all-gather of a 42 MB fp32 bucket
between two local ranks took 50-60 ms, the same bytes in 16 MB calls in flight together 16-30
ms (an all-reduce is fast either way, ~20 ms). So on CPU both are capped at `CPU_MESSAGE_NUMEL`
elements (16 MiB of fp32); the config's smaller values stay. The smaller buckets also let stages
0-1 start reducing during backward, as DDP's 25 MB buckets do, and keep stage 2's staging
buffers small. Accelerator backends keep the configured sizes.

**Reduce-scatter on CPU** (`uses_reduce_scatter`). At stages 1-2 each rank needs only its chunk
of a reduced bucket, which ``reduce_scatter: true`` gets with a reduce-scatter. gloo's
reduce-scatter costs about twice its all-reduce of the same bytes: the bench model's 42 MB of
fp32 gradients between two local ranks took 37-77 ms reduce-scattered against 19-27 ms
all-reduced (in 2, 3 or 9 calls alike), and in the engine stage 1 stepped in 0.78 s against
0.68 s all-reducing. So CPU buckets are all-reduced in place and each rank keeps its chunk
(the ``reduce_scatter: false`` path); accelerator backends keep the configured collective.
"""

from __future__ import annotations

import torch

from deepshard.interface.config import DeepShardConfig, ZeroConfig
from deepshard.interface.status import planned_problems
from deepshard.zero._offload_plan import offload_config_problems

__all__ = ["CPU_MESSAGE_NUMEL", "message_numel", "uses_reduce_scatter", "zero_problems"]

CPU_MESSAGE_NUMEL = 1 << 22
"""Most elements of one reduce bucket or one all-gather call for CPU parameters (16 MiB fp32)."""


def message_numel(numel: int, device: torch.device) -> int:
    """The elements one collective may move: ``numel`` (``reduce_bucket_size`` or
    ``allgather_bucket_size``), capped at `CPU_MESSAGE_NUMEL` for CPU tensors."""
    return min(numel, CPU_MESSAGE_NUMEL) if device.type == "cpu" else numel


def uses_reduce_scatter(configured: bool, device: torch.device) -> bool:
    """Whether stage 1-2 buckets are reduce-scattered: ``reduce_scatter`` (``configured``),
    except for CPU tensors, which are all-reduced and sliced (gloo's reduce-scatter is slower)."""
    return configured and device.type != "cpu"


def zero_problems(
    config: ZeroConfig, *, gradient_clipping: float, sharded: bool | None = None
) -> list[tuple[str, str]]:
    """Every setting of ``config`` this package refuses, as ``(key path, message)``.

    The features not there yet (stage 3, parameter offload) come from the feature table
    (`deepshard.interface.status`), the same rows the engine refuses, so the two agree word for
    word; the contradictions are ZeRO's own.

    Args:
        config: The ``zero_optimization`` section.
        gradient_clipping: The top-level ``gradient_clipping``.
        sharded: Whether the optimizer wraps a sharded model (stage 3 needs one, stages 0-2
            refuse one); ``None`` checks neither (the engine, which shards at stage 3 itself).

    Returns:
        One ``(key path, message)`` per problem; empty when ZeRO runs the settings.
    """
    problems = planned_problems(DeepShardConfig(zero_optimization=config))
    if sharded is not None and sharded != (config.stage == 3):
        fix = (
            "3 partitions the parameters: shard the model with deepshard.zero.shard and pass "
            "ZeroOptimizer(inner, sharded_module)"
            if config.stage == 3
            else f"{config.stage} got a sharded module; a ShardedModule needs stage 3"
        )
        problems.insert(0, ("zero_optimization.stage", fix))
    problems += offload_config_problems(config)
    if gradient_clipping < 0:
        problems.append(
            ("gradient_clipping", f"must be >= 0 (0 disables), got {gradient_clipping}")
        )
    if not config.compute_grad_norm and gradient_clipping > 0:
        problems.append(
            (
                "zero_optimization.compute_grad_norm",
                f"false needs gradient_clipping 0 (clipping needs the norm); gradient_clipping "
                f"is {gradient_clipping}",
            )
        )
    if not config.allgather_partitions:
        problems.append(
            (
                "zero_optimization.allgather_partitions",
                "false (broadcast instead of all-gather) is not supported; remove the key",
            )
        )
    return problems
