"""How each `zero.py` competitor wraps the model: a step function and a tensor-byte reader.

Each ``build_*`` joins the gloo world the environment describes, wraps ``model`` its own way
and returns ``(step, tensor_bytes)``: ``step(ids)`` runs forward, backward, clipping at
`CLIP` and the optimizer step and returns the loss; ``tensor_bytes()`` is DeepShard's own
count (``engine.memory_bytes()``) or ``None`` for the others. The optimizer is AdamW with the
same hyper-parameters everywhere (`_zero_lineup`); engines read them from `engine_config`.

FSDP2 is ``fully_shard`` on every transformer block and then on the root (which holds the
embeddings, the tied head and the final norm), with a `MixedPrecisionPolicy` that computes in
the config's dtype and reduces gradients in it (as both engines do), keeping fp32 sharded
parameters for the optimizer; the offload row adds `CPUOffloadPolicy`. It runs on a CPU mesh
over gloo as is (torch 2.15, fp32 and bf16), except that `CPUOffloadPolicy`'s default
``pin_memory=True`` fails on a machine without CUDA ("RuntimeError: Found no NVIDIA driver on
your system"), so the offload row passes ``pin_memory=False``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _zero_lineup import CLIP, LR, WEIGHT_DECAY, Competitor, engine_config

StepFn = Callable[[torch.Tensor], torch.Tensor]
BytesFn = Callable[[], "dict[str, int] | None"]
Built = tuple[StepFn, BytesFn]


class Refused(Exception):
    """DeepShard's engine refused the row's config (a `ConfigError`); ``args[0]`` says why."""


def first_line(error: BaseException) -> str:
    """The error's first line; a multi-problem header gets its first problem appended."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    if lines[0].endswith(":") and len(lines) > 1:
        return f"{lines[0]} {lines[1]}"
    return lines[0]


def _no_bytes() -> None:
    return None


def _plain_step(
    model: torch.nn.Module, wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> StepFn:
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = wrapped(ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def build_ddp(
    model: torch.nn.Module, competitor: Competitor, micro_batch: int, dtype: str
) -> Built:
    """``DistributedDataParallel`` (bucketed all-reduce overlapping backward), fp32."""
    dist.init_process_group("gloo")
    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    return _plain_step(model, wrapped, _adamw(model)), _no_bytes


def fsdp2_policy(dtype: str) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    """FSDP2's mixed precision for the config dtype: compute and reduce in it, fp32 shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def build_fsdp2(
    model: torch.nn.Module, competitor: Competitor, micro_batch: int, dtype: str
) -> Built:
    """``fully_shard`` per block, then the root; `CPUOffloadPolicy` for ``offload-all``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Pinning needs CUDA: the default pin_memory=True raises "Found no NVIDIA driver" here.
    offload = CPUOffloadPolicy(pin_memory=False) if competitor.offload == "all" else OffloadPolicy()
    policy = fsdp2_policy(dtype)
    for block in model.blocks:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    return _plain_step(model, model, _adamw(model)), _no_bytes


def _engine_step(engine: Any) -> StepFn:
    def step(ids: torch.Tensor) -> torch.Tensor:
        loss: torch.Tensor = engine(ids)
        engine.backward(loss)
        engine.step()
        return loss

    return step


def build_deepspeed(
    model: torch.nn.Module, competitor: Competitor, micro_batch: int, dtype: str
) -> Built:
    """DeepSpeed 0.19.7's engine on its CPU accelerator, with `engine_config`."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=engine_config(competitor, micro_batch, dtype),
    )
    return _engine_step(engine), _no_bytes


def build_deepshard(
    model: torch.nn.Module, competitor: Competitor, micro_batch: int, dtype: str
) -> Built:
    """``deepshard.engine.initialize`` with `engine_config`; a `ConfigError` is `Refused`."""
    import deepshard.engine as ds
    from deepshard.interface.errors import ConfigError

    try:
        engine, _, _, _ = ds.initialize(model, engine_config(competitor, micro_batch, dtype))
    except ConfigError as error:
        raise Refused(first_line(error)) from error

    def tensor_bytes() -> dict[str, int]:
        counts = engine.memory_bytes()
        return {
            "parameters": counts.parameters,
            "gradients": counts.gradients,
            "master_weights": counts.master_weights,
            "optimizer_state": counts.optimizer_state,
        }

    return _engine_step(engine), tensor_bytes


BUILDERS = {
    "ddp": build_ddp,
    "fsdp2": build_fsdp2,
    "deepspeed": build_deepspeed,
    "deepshard": build_deepshard,
}
