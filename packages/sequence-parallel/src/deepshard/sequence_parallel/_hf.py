"""ALST: Ulysses sequence parallelism for Hugging Face models, applied from outside the model.

`apply_ulysses(model, parallel_dims)` changes two things of *that* model, both through
transformers' own extension points, so two models in one process never see each other's
setting:

1. Its attention implementation. A `UlyssesAttention` object, registered with
   ``transformers.AttentionInterface`` under a name of its own (``deepshard_ulysses_<id>``),
   becomes the model's ``config._attn_implementation``. It wraps the core attention the model
   was configured with (sdpa, eager, flex) in `DistributedAttention` over the ``sp`` group:
   queries, keys and values arrive for ``S/P`` tokens and all heads, the all-to-all turns them
   into ``S`` tokens and ``H/P`` heads, the core attention runs, and the output goes back.
   (DeepSpeed overwrites the ``sdpa`` entry of the process-global table instead, which changes
   every model in the process.) A name transformers does not know also means the model builds
   no mask for its shard (it would be the wrong size): the wrapper derives the whole sequence's
   causal, document-aware mask from the gathered ``position_ids`` (`deepshard.sequence_parallel.
   _positions`).
2. Its ``loss_function``: the causal-LM loss reduced over the ``sp`` group for unequal numbers
   of valid tokens per shard (`deepshard.sequence_parallel._loss`).

With ``disable_in_eval`` a model in ``eval()`` mode runs its core attention and its own loss on
whatever (unsharded) batch it gets.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from deepshard.comm import ParallelDims
from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel._loss import hf_loss_function
from deepshard.sequence_parallel._positions import (
    MaskKind,
    gather_positions,
    mask_from_positions,
)
from deepshard.sequence_parallel.attention import DistributedAttention

__all__ = ["UlyssesAttention", "apply_ulysses"]

_PREFIX = "deepshard_ulysses_"
_CORES: dict[str, MaskKind | None] = {"sdpa": "bool", "eager": "additive", "flex_attention": None}


class _GroupsView:
    """The attention module as the core attention reads it, with the local query/KV ratio.

    Replicated KV heads (fewer KV heads than ``sp`` ranks) change how many query heads share
    one local KV head; the core attention reads that ratio from ``num_key_value_groups``,
    which this view overrides without touching the module.
    """

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _core_function(model: torch.nn.Module, name: str) -> Callable[..., Any]:
    from transformers import AttentionInterface

    if name != "eager":
        core: Callable[..., Any] = AttentionInterface()[name]  # type: ignore[no-untyped-call]
        return core
    # eager is each modeling file's own function, not an entry of the interface
    eager = getattr(sys.modules[type(model).__module__], "eager_attention_forward", None)
    if eager is None:
        raise ConfigError(
            f"{type(model).__name__}'s modeling module has no eager_attention_forward; load the "
            "model with attn_implementation='sdpa' for sequence parallelism"
        )
    return eager  # type: ignore[no-any-return]


def _flex_mask(positions: torch.Tensor) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    document = starts.cumsum(dim=1)

    def causal_in_document(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (k <= q) & (document[b, q] == document[b, k])

    rows, seq = positions.shape
    return create_block_mask(causal_in_document, rows, None, seq, seq, device=str(positions.device))


class UlyssesAttention:
    """The attention function `apply_ulysses` registers for one model.

    Called by the model's attention layers as transformers calls any attention function:
    ``(module, query [b, h, s/P, d], key, value, mask, **kwargs) -> (out [b, s/P, h, d],
    None)``.

    Args:
        core: The core attention function (transformers' signature).
        core_name: Its name (``"sdpa"``, ``"eager"``, ``"flex_attention"``): how masks are made.
        group: The ``sp`` group.
        disable_in_eval: Run ``core`` unchanged while the module is in eval mode.
    """

    def __init__(
        self,
        core: Callable[..., Any],
        *,
        core_name: str,
        group: DeviceMesh,
        disable_in_eval: bool,
    ) -> None:
        self.core = core
        self.core_name = core_name
        self.group = group
        self.disable_in_eval = disable_in_eval
        self.exchange = DistributedAttention(self._local, group)

    def _mask(self, positions: torch.Tensor, query: torch.Tensor) -> Any:
        kind = _CORES[self.core_name]
        if kind is None:
            return _flex_mask(positions)
        return mask_from_positions(positions, kind=kind, dtype=query.dtype)

    def _local(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        module: torch.nn.Module,
        mask: Any,
        kwargs: dict[str, Any],
    ) -> torch.Tensor:
        """Core attention on the whole sequence and local heads, ``[b, S, h/P, d]`` in/out."""
        groups = q.shape[2] // k.shape[2]
        view: Any = module
        if getattr(module, "num_key_value_groups", groups) != groups:
            view = _GroupsView(module, groups)
        out, _ = self.core(
            view, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, **kwargs
        )
        return out  # type: ignore[no-any-return]

    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        positions = kwargs.get("position_ids")
        if positions is None:
            raise ConfigError(
                "sequence-parallel attention needs position_ids in the model's forward (the "
                "global positions of this rank's tokens); wrap the loader in "
                "UlyssesDataLoaderAdapter, which adds them"
            )
        if self.disable_in_eval and not module.training:
            mask = self._mask(positions, query)
            out, _ = self.core(module, query, key, value, mask, **kwargs)
            return out, None
        whole = gather_positions(positions, group=self.group)
        kwargs["position_ids"] = whole
        mask = self._mask(whole, query)
        out = self.exchange(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            0,
            module,
            mask,
            kwargs,
        )
        return out, None


def apply_ulysses(
    model: torch.nn.Module,
    parallel_dims: ParallelDims,
    *,
    disable_in_eval: bool = False,
) -> torch.nn.Module:
    """Makes a Hugging Face model run Ulysses sequence parallelism over ``parallel_dims.sp``.

    Call it before ZeRO or the engine wraps the model (``initialize`` does, given
    ``sequence_parallel_size``), then feed each rank its sequence shard
    (`UlyssesDataLoaderAdapter`). With an ``sp`` axis of size 1 the model is returned as it is.

    Args:
        model: A transformers model whose attention uses ``AttentionInterface`` (Llama, Qwen,
            Mistral, ...) configured with ``sdpa``, ``eager`` or ``flex_attention``.
        parallel_dims: The training mesh; attention exchanges over its ``sp`` group.
        disable_in_eval: In ``model.eval()`` mode, run the plain attention and loss (for
            evaluation on whole, unsharded batches).

    Returns:
        ``model`` itself, changed in place.

    Raises:
        ConfigError: The model is not a transformers model with a selectable attention, its
            attention is not one of sdpa/eager/flex_attention, or it was applied already.
    """
    group = parallel_dims.sp
    if group.size() == 1:
        return model
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if not callable(getattr(model, "set_attn_implementation", None)) or name is None:
        raise ConfigError(
            f"apply_ulysses needs a Hugging Face transformers model, got "
            f"{type(model).__name__}; for another model wrap its core attention in "
            "deepshard.sequence_parallel.DistributedAttention"
        )
    if name.startswith(_PREFIX):
        raise ConfigError(f"apply_ulysses was applied to this {type(model).__name__} already")
    if name not in _CORES:
        raise ConfigError(
            f"the model's attention implementation {name!r} is not supported by sequence "
            f"parallelism; load it with attn_implementation= one of {sorted(_CORES)}"
        )
    from transformers import AttentionInterface

    attention = UlyssesAttention(
        _core_function(model, name), core_name=name, group=group, disable_in_eval=disable_in_eval
    )
    registered = f"{_PREFIX}{id(model):x}"
    AttentionInterface.register(registered, attention)
    model.set_attn_implementation(registered)  # type: ignore[operator]
    sharded = lambda: model.training or not disable_in_eval  # noqa: E731
    # transformers makes shard-local positions 0..s/P-1 when none are given, which gathered
    # would look like packed documents: refuse that before the forward runs
    model.register_forward_pre_hook(_positions_required(sharded), with_kwargs=True)
    if hasattr(model, "loss_function"):
        hf_model: Any = model  # transformers' PreTrainedModel, untyped
        hf_model.loss_function = hf_loss_function(
            group=group, sharded=sharded, fallback=hf_model.loss_function
        )
    return model


def _positions_required(sharded: Callable[[], bool]) -> Callable[..., None]:
    def check(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if sharded() and kwargs.get("position_ids") is None:
            raise ConfigError(
                f"{type(module).__name__} runs Ulysses sequence parallelism and needs "
                "position_ids=... (the global positions of this rank's tokens) in every "
                "forward; wrap the loader in UlyssesDataLoaderAdapter, which adds them"
            )

    return check
