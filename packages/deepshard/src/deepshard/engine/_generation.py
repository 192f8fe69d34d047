"""Generating from the training engine's own weights: `generation_context`.

A rollout (`deepshard.inference`'s co-located `RolloutEngine`) runs no-grad forwards with a KV
cache on the model being trained, between training steps. The block does what that needs and
leaves the training state as it was:

* **Mode.** Every submodule is put in eval mode (no dropout) and gets its own ``training``
  flag back on exit, so a model that kept some parts in eval stays that way.
* **Random streams.** torch's CPU generator and the accelerator's default generator are saved
  and restored, so dropout in the next step draws what it would have drawn without the
  rollout (sampling uses its own per-request generators anyway).
* **ZeRO stage 3.** The forward hooks gather each unit when its forward starts and release it
  after (a no-grad forward keeps nothing for backward), prefetching along the recorded order;
  inside the block at most ``gather_units`` non-resident units are live at once (the live
  window is lowered to the elements of the ``gather_units`` largest units, DeepSpeed's
  ``tp_gather_partition_size``), the recorded execution order the training prefetch follows is
  kept as it was, and every non-resident unit is released on exit.
* **Stages 0-2 and AutoTP.** The parameters are whole (or this rank's TP shard) already; under
  TP every rank of the ``tp`` group must generate the same requests in lockstep (the layers'
  collectives run in every forward), and the block names the local KV-head count a KV cache
  must be sized with.

Nothing else is touched: gradients (none exist between steps at stage 3; at stages 0-2 a
generation forward makes none), optimizer state, loss scale and step counters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepshard.engine._inference import split_kv_heads
from deepshard.interface.errors import ConfigError

if TYPE_CHECKING:
    from deepshard.engine._engine import DeepShardEngine
    from deepshard.zero import ShardedModule

__all__ = ["GenerationView", "generation_context"]


@dataclass(frozen=True)
class GenerationView:
    """What a generation loop runs inside `generation_context`.

    Attributes:
        module: The model to call (the engine's module, in eval mode).
        kv_heads: This rank's KV-head count under tensor parallelism (size a KV cache with
            it); ``None`` without TP (the model's config says).
    """

    module: torch.nn.Module
    kv_heads: int | None


def _local_kv_heads(module: torch.nn.Module, tp_size: int) -> int | None:
    """This rank's KV heads under TP: the split ``k_proj``'s rows when there is one (as
    `deepshard.engine.init_inference` reads them), else the model's KV heads divided over
    ``tp_size`` ranks; ``None`` at TP 1."""
    if tp_size == 1:
        return None
    local = split_kv_heads(module)
    if local is not None:
        return local
    config = getattr(module, "config", None)
    heads = getattr(config, "num_key_value_heads", None) or getattr(
        config, "num_attention_heads", None
    )
    if not isinstance(heads, int):
        raise ConfigError(
            f"generation under tensor_parallel.autotp_size={tp_size} needs the model's config "
            "to name num_key_value_heads (or num_attention_heads) to size the KV cache; "
            f"{type(module).__name__} has none"
        )
    if heads % tp_size:
        raise ConfigError(
            f"generation under tensor_parallel.autotp_size={tp_size}: the model has {heads} KV "
            "heads, not divisible over the TP ranks; choose an autotp_size dividing it"
        )
    return heads // tp_size


def _window(sharded: ShardedModule, gather_units: int) -> int:
    """Elements of the ``gather_units`` largest non-resident units."""
    resident = sharded.fetcher.resident
    sizes = sorted((u.numel for u in sharded.units if u.plan.index not in resident), reverse=True)
    return sum(sizes[:gather_units])


def _rng_states(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    accelerator = None
    if device.type == "cuda":
        accelerator = torch.cuda.get_rng_state(device)
    return torch.get_rng_state(), accelerator


def _set_rng_states(device: torch.device, states: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state(states[1], device)


def _check_ready(engine: DeepShardEngine, gather_units: int) -> None:
    if isinstance(gather_units, bool) or not isinstance(gather_units, int) or gather_units < 1:
        raise ConfigError(
            f"generation_context(gather_units={gather_units!r}): expected an int >= 1, the "
            "number of ZeRO-3 units gathered at once while generating"
        )
    if engine._destroyed:
        raise ConfigError(
            "engine.generation_context() after engine.destroy(); generate before destroying "
            "the engine, or build a new one"
        )
    sharded = engine._sharded
    if sharded is not None and sharded.in_pass:
        raise ConfigError(
            "engine.generation_context() was entered during a backward pass; generate between "
            "training steps"
        )
    if engine.optimizer is not None:
        engine.optimizer.check_resident("engine.generation_context()")


@contextlib.contextmanager
def generation_context(
    engine: DeepShardEngine, *, gather_units: int = 1
) -> Iterator[GenerationView]:
    """Eval mode and no-grad-ready weights for generating from ``engine``; see the module.

    Args:
        engine: The training engine.
        gather_units: At ZeRO stage 3, most non-resident units gathered at once (bounds the
            gathered elements to the ``gather_units`` largest units); ignored below stage 3.

    Raises:
        ConfigError: ``gather_units`` < 1, the engine was destroyed, a backward pass is
            running, states are offloaded, or the KV heads do not divide over TP.
    """
    _check_ready(engine, gather_units)
    module = engine.module
    view = GenerationView(module, _local_kv_heads(module, engine.parallel_dims.tp.size()))
    modes = [(m, m.training) for m in module.modules()]
    rng = _rng_states(engine.device)
    sharded = engine._sharded
    bounded = (
        sharded.fetcher.untraced(max_live=_window(sharded, gather_units))
        if sharded is not None
        else contextlib.nullcontext()
    )
    module.eval()
    try:
        with bounded, engine.parts.precision.forward_context(engine.device.type):
            yield view
    finally:
        for submodule, training in modes:
            submodule.training = training
        _set_rng_states(engine.device, rng)
