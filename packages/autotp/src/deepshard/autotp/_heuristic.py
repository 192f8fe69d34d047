"""The third plan source: the model's structure, for models with neither specs nor a tp_plan.

A transformer block is a pair of Linears around a per-feature computation: the projections
into the block (q/k/v, gate/up) are column-parallel, and the one that feeds the residual add
(``o_proj``, ``down_proj``, ``out_proj``, ``dense_4h_to_h``, ``w2``, ``fc2``, an attention's
``dense`` ...) is row-parallel, so the block costs one all-reduce. A Linear is made column-
parallel only when its block (its parent or grandparent, never the model root) has such a row-
parallel Linear to consume its sharded output: a classifier or a multimodal projector with no
row partner stays whole. MoE routers (``gate``, ``router``) and the low-rank down-projections
of multi-head latent attention (``q_a_proj``, ``kv_a_proj_with_mqa``) stay whole; the LM head
is column-parallel with a gathered output, and the input embedding is split by vocabulary
(what Hugging Face's own plans do, ``embedding_rowwise``); other embeddings stay whole.
Qwen3-style ``q_norm``/``k_norm``, which normalise each head of a sharded projection, stay
whole with their gradients all-reduced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepshard.autotp._decision import Decision
from deepshard.autotp._layout import in_attention, leaf, parent
from deepshard.autotp._meta import AutoTPMeta
from deepshard.autotp._plan_types import Style
from deepshard.interface.errors import ConfigError

__all__ = ["ROW_LEAVES", "HeuristicSource"]

ROW_LEAVES = frozenset(
    {"o_proj", "down_proj", "out_proj", "dense_4h_to_h", "w2", "fc2", "fc_out", "wo", "c_proj",
     "output_proj"}
)  # fmt: skip
"""Leaf names of the Linears that feed a residual add."""

_ROUTERS = frozenset({"gate", "router", "shared_expert_gate", "w_gate"})
_HEAD_NORMS = frozenset({"q_norm", "k_norm", "q_layernorm", "k_layernorm"})
_SOURCE = "heuristic"
_KEY = "tensor_parallel.partition_config"


def _is_row(name: str) -> bool:
    short = leaf(name)
    if short in ROW_LEAVES:
        return True
    # BERT/Bloom/GLM: the attention's output `dense`, and `output.dense` after an MLP.
    return short == "dense" and (in_attention(name) or leaf(parent(name)) == "output")


def _blocks(name: str) -> tuple[str, ...]:
    """The parent and grandparent of ``name``, never the model root."""
    first = parent(name)
    second = parent(first) if first else ""
    return tuple(block for block in (first, second) if block)


class HeuristicSource:
    """Decides modules from their names and the block they sit in."""

    def __init__(
        self,
        linears: Sequence[str],
        lm_heads: frozenset[str],
        embeddings: frozenset[str],
        meta: AutoTPMeta,
    ) -> None:
        self._lm_heads = lm_heads
        self._embeddings = embeddings
        self._meta = meta
        rows = [name for name in linears if _is_row(name) and name not in lm_heads]
        self._row_blocks = {block for name in rows for block in _blocks(name)}
        self._rows = frozenset(rows)

    def decide(self, name: str, module: torch.nn.Module) -> Decision | None:
        """The structural decision for ``module``, or None to leave it alone."""
        short = leaf(name)
        if isinstance(module, torch.nn.Linear):
            if name in self._lm_heads:
                return Decision(Style.COLUMN, _SOURCE, _KEY, gather_output=True)
            if short in _ROUTERS or short.endswith(("_a_proj", "_a_proj_with_mqa")):
                return Decision(Style.REPLICATE, _SOURCE, _KEY)
            if name in self._rows:
                return Decision(Style.ROW, _SOURCE, _KEY)
            if any(block in self._row_blocks for block in _blocks(name)):
                return Decision(Style.COLUMN, _SOURCE, _KEY)
            return None
        if isinstance(module, torch.nn.Embedding) and name in self._embeddings:
            return Decision(Style.VOCAB, _SOURCE, _KEY)
        if short in _HEAD_NORMS and in_attention(name):
            return self._head_norm(name, module)
        return None

    def _head_norm(self, name: str, module: torch.nn.Module) -> Decision | None:
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):
            return None
        if weight.numel() != self._meta.head_dim:
            raise ConfigError(
                f"{_KEY}: {name} normalises {weight.numel()} features, not one head "
                f"({self._meta.head_dim}): a norm over a whole projection cannot follow its "
                "column split; give layer specs for this model",
                [(_KEY, f"{name} is not a per-head norm")],
            )
        return Decision(Style.REPLICATE_GRAD_ALLREDUCE, _SOURCE, _KEY)
