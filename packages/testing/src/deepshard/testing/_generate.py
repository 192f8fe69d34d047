"""Greedy decoding of one prompt with a Hugging Face model's own `generate`: the reference
that DeepShard's generation paths (rollout, sharded and expert-parallel models) are compared to."""

from __future__ import annotations

from typing import Any

__all__ = ["greedy_new_tokens"]


def greedy_new_tokens(
    model: Any,
    ids: Any,
    *,
    max_new_tokens: int,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
) -> list[int]:
    """The tokens ``model.generate`` adds greedily after the one-row prompt ``ids``.

    The model is switched to eval (no dropout), and its generation config's own EOS is cleared
    so that only ``eos_token_id`` ends decoding (a tiny config's default EOS would otherwise
    stop a random model by chance). The tokens are cut after the first EOS.

    Args:
        model: A Hugging Face causal LM (or a model wrapping one with ``generate``).
        ids: ``[1, L]`` int64 prompt.
        max_new_tokens: At most this many new tokens.
        eos_token_id: The one token that ends decoding; None: none does.
        pad_token_id: What ``generate`` pads with.
    """
    model.eval()
    model.generation_config.eos_token_id = None
    out = model.generate(
        ids,
        attention_mask=ids.new_ones(ids.shape),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
    )
    tokens = [int(t) for t in out[0, ids.shape[1] :]]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return tokens
