"""`apply_ulysses` + `shard_batch` on a tiny LlamaForCausalLM equal one process on the whole sequence.

Two gloo ranks form the ``sp`` group. Each feeds its half of every sequence (16 tokens, 8 per
rank) to a two-layer Llama with grouped-query attention (4 query heads, 2 KV heads), computes
the SP loss and backward, and averages its gradients over ``sp`` as ZeRO does over
``dp × ep × sp``. The parent runs the same model on the whole sequence in one process. Labels
are masked so the two shards hold very different numbers of valid tokens (row 0: none in
shard 0), which a mean of per-shard means would get wrong. Packed rows (positions restarting
mid-sequence) are checked against transformers' own packed-sequence handling.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

SEQ = 16
VOCAB = 64


def _llama(attn: str, seed: int = 0) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ,
        attn_implementation=attn,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def _batch(packed: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, :11] = -100  # shard 0 of row 0 has no valid label, shard 1 five
    labels[1, 13:] = -100
    # use_cache=False: with a cache, transformers skips its packed-sequence masks
    batch: dict[str, Any] = {"input_ids": ids, "labels": labels, "use_cache": False}
    if packed:  # row 1 packs two documents: 0..9 then 0..5
        positions = torch.arange(SEQ).repeat(2, 1)
        positions[1, 10:] = torch.arange(SEQ - 10)
        batch["position_ids"] = positions
    return batch


def _sp_step(mesh: Any, attn: str, batch: dict[str, Any]) -> dict[str, Any]:
    from deepshard.comm import ParallelDims, all_reduce
    from deepshard.sequence_parallel import shard_batch
    from deepshard.sequence_parallel import apply_ulysses

    dims = ParallelDims.from_mesh(mesh)
    model = apply_ulysses(_llama(attn), dims)
    shard = shard_batch(batch, sp_rank=dims.sp.get_local_rank(), sp_size=dims.sp.size())
    loss = model(**shard).loss
    loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        all_reduce(grad, group=dims.dense_dp, op="avg")
        grads[name] = grad
    return {"loss": loss.detach(), "grads": grads}


def _reference(attn: str, batch: dict[str, Any]) -> dict[str, Any]:
    model = _llama(attn)
    loss = model(**batch).loss
    loss.backward()
    return {"loss": loss.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


@pytest.mark.parametrize(("attn", "packed"), [("sdpa", False), ("eager", False), ("sdpa", True)])
def test_two_sp_ranks_match_the_whole_sequence(attn: str, packed: bool, tmp_path: Path) -> None:
    batch = _batch(packed)
    ref = _reference(attn, batch)
    results = run_on_mesh(
        _sp_step,
        2,
        topology=Topology(sp=2),
        args=(attn, batch),
        store_dir=tmp_path,
        timeout_s=120,
    )
    for result in results:
        torch.testing.assert_close(result["loss"], ref["loss"], rtol=1e-6, atol=0.0)
        for name, expected in ref["grads"].items():
            torch.testing.assert_close(
                result["grads"][name], expected, rtol=1e-5, atol=1e-7, msg=name
            )
