"""Tiled MLP and tiled logits-loss for Hugging Face causal LMs (Llama, Qwen2/3, Mistral).

At long sequence lengths the two largest activations left after Ulysses are the MLP's
intermediate (``[tokens, intermediate]``, three of them) and the logits (``[tokens, vocab]``,
in fp32 for the loss). `tile_hf_model` switches either to the tiled ops of
`deepshard.sequence_parallel.tiled` for one model instance:

* **MLP**: each decoder layer's ``mlp`` gets an instance ``forward`` that runs the class's own
  forward through `tiled_mlp` (slices of rows, recomputed in backward). Parameter names and
  the module tree are unchanged, so checkpoints and ZeRO see the same model.
* **Logits + loss**: the model gets an instance ``forward`` that, when labels are given, runs
  the base model for the hidden states and computes the loss with `tiled_fused_logits_loss`
  (``lm_head`` and cross-entropy one slice at a time, gradients inside the forward), so the
  whole ``[tokens, vocab]`` logits never exist; the output has ``logits=None``. The per-shard
  token-loss *sum* is then reduced over the ``sp`` group by `sp_mean_loss`, exactly as the
  untiled SP loss. Without labels the class's forward runs (logits returned).

Both are instance attributes (DeepSpeed replaces ``LlamaMLP.forward`` on the class, for every
model in the process); other models of the same class are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel._loss import sp_mean_loss
from deepshard.sequence_parallel.tiled import tiled_fused_logits_loss, tiled_mlp

__all__ = ["SUPPORTED_MODEL_TYPES", "tile_hf_model"]

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` values whose MLP and LM head the tiled forwards are known to fit."""

_IGNORE = -100


def _class_forward(module: torch.nn.Module, rows: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = type(module).forward(module, rows)
    return out


def _tile_mlp(mlp: torch.nn.Module, shards: int | None) -> None:
    def forward(x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1]
        # DeepSpeed's "auto": about one hidden size of tokens per slice
        n = shards if shards is not None else max(1, math.ceil(tokens / x.shape[-1]))
        return tiled_mlp(_class_forward, mlp, x, min(n, tokens))

    mlp.forward = forward


def _token_loss_sum(head: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = head(x).float()
    return F.cross_entropy(logits, y.reshape(-1), ignore_index=_IGNORE, reduction="sum")


def _shift(labels: torch.Tensor) -> torch.Tensor:
    return F.pad(labels, (0, 1), value=_IGNORE)[..., 1:].contiguous()


def _tile_loss(
    model: torch.nn.Module,
    shards: int | None,
    *,
    group: DeviceMesh | None,
    sharded: Callable[[], bool],
) -> None:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    base: Any = model.model
    head: Any = model.lm_head
    class_forward = type(model).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        labels = kwargs.pop("labels", None)
        shift_labels = kwargs.pop("shift_labels", None)
        if args or (labels is None and shift_labels is None):
            return class_forward(model, *args, labels=labels, shift_labels=shift_labels, **kwargs)
        kwargs.pop("logits_to_keep", None)
        kwargs.pop("num_items_in_batch", None)
        out = base(**kwargs)
        hidden = out.last_hidden_state
        on_shards = sharded()
        if shift_labels is None:
            if on_shards:
                raise ConfigError(
                    "sequence parallelism needs shift_labels in the batch; wrap the loader in "
                    "UlyssesDataLoaderAdapter"
                )
            shift_labels = _shift(labels)
        shift_labels = shift_labels.to(hidden.device)
        tokens = shift_labels.numel()
        n = shards if shards is not None else max(1, math.ceil(tokens * head.out_features / 2**24))
        token_sum = tiled_fused_logits_loss(
            _token_loss_sum, head, hidden, shift_labels, None, min(n, tokens), "sum"
        )
        valid = (shift_labels != _IGNORE).sum()
        if on_shards and group is not None:
            loss = sp_mean_loss(token_sum, valid, group=group)
        else:
            loss = token_sum / valid.clamp(min=1).to(token_sum.dtype)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            past_key_values=out.past_key_values,
            hidden_states=out.hidden_states,
            attentions=out.attentions,
        )

    model.forward = forward


def tile_hf_model(
    model: torch.nn.Module,
    *,
    mlp: bool = False,
    mlp_shards: int | None = None,
    logits_loss: bool = False,
    logits_shards: int | None = None,
    sp_group: DeviceMesh | None = None,
    disable_in_eval: bool = False,
) -> torch.nn.Module:
    """Switches a Hugging Face causal LM to tiled MLP and/or tiled logits-loss compute.

    Args:
        model: A ``*ForCausalLM`` of a `SUPPORTED_MODEL_TYPES` type.
        mlp: Tile every decoder layer's MLP.
        mlp_shards: Slices per MLP call; None: ``ceil(tokens / hidden_size)`` (DeepSpeed's auto).
        logits_loss: Compute ``lm_head`` + cross-entropy slice by slice when labels are given.
        logits_shards: Slices of the loss; None: enough that one slice's fp32 logits hold at
            most 2^24 values (64 MiB).
        sp_group: The ``sp`` group the loss is reduced over (``apply_ulysses``'s); None for a
            model without sequence parallelism.
        disable_in_eval: With ``sp_group``, reduce the loss locally in eval mode (as
            ``apply_ulysses(disable_in_eval=True)``).

    Returns:
        ``model`` itself, changed in place.

    Raises:
        ConfigError: An unsupported model, or shard counts below 1.
    """
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"tiled MLP / logits loss support model types {sorted(SUPPORTED_MODEL_TYPES)}; "
            f"{type(model).__name__} has model_type {kind!r}: turn sequence_parallel.tiled_mlp "
            "and tiled_logits_loss off, or tile the model's own modules with tiled_mlp / "
            "tiled_fused_logits_loss"
        )
    for name, count in (("tiled_mlp_shards", mlp_shards), ("tiled_logits_shards", logits_shards)):
        if count is not None and count < 1:
            raise ConfigError(f"sequence_parallel.{name} must be at least 1, got {count}")
    if mlp:
        base: Any = model.model
        for layer in base.layers:
            _tile_mlp(layer.mlp, mlp_shards)
    if logits_loss:
        sizes = 1 if sp_group is None else sp_group.size()
        _tile_loss(
            model,
            logits_shards,
            group=sp_group if sizes > 1 else None,
            sharded=lambda: sizes > 1 and (model.training or not disable_in_eval),
        )
    return model
