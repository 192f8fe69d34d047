"""GEMM and attention FLOPs agree with ``torch.utils.flop_counter.FlopCounterMode``, and a
GPT-style model's forward FLOPs agree with the analytic count.

* A tiny Hugging Face Llama (built from a config, nothing downloaded), forward with the loss
  and backward: per aten operator that ``FlopCounterMode`` counts, our forward + backward FLOPs
  are the same number.
* A GPT-style model written here with ``F.scaled_dot_product_attention``, ``torch.einsum`` for
  the output projection and ``x @ w`` for the MLP: the forward FLOPs are within 2% of
  ``2 · N · tokens + 4 · layers · batch · T² · d`` (N: parameters of the matrices the tokens
  are multiplied by; the attention term: ``QKᵀ`` and ``PV``), the rest being norms, activations
  and elementwise work.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from deepshard.profiler import CountMode, FlopsProfiler


def _llama() -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=128,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def test_llama_gemm_flops_equal_flop_counter_mode_forward_and_backward(
    count_mode: CountMode,
) -> None:
    model = _llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    theirs = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
    model.zero_grad()
    prof = FlopsProfiler(model, count_backward=True, count_mode=count_mode)
    prof.start_profile()
    model(input_ids=ids, labels=ids).loss.backward()
    ours = prof.get_flops_by_op()
    prof.end_profile()
    assert theirs and {"mm", "bmm"} & set(theirs)
    assert {name: sum(ours.get(name, (0, 0))) for name in theirs} == theirs


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.up = nn.Parameter(torch.randn(d, 4 * d) / d**0.5)
        self.down = nn.Parameter(torch.randn(4 * d, d) / d**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + torch.einsum("btd,de->bte", att.transpose(1, 2).reshape(b, t, d), self.proj)
        return x + F.gelu(self.norm2(x) @ self.up) @ self.down


class _Gpt(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, t: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(t, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_gpt_forward_flops_match_the_analytic_count(count_mode: CountMode) -> None:
    vocab, d, layers, heads, t, batch = 512, 128, 2, 4, 64, 2
    model = _Gpt(vocab, d, layers, heads, t)
    prof = FlopsProfiler(model, count_mode=count_mode)
    prof.start_profile()
    with torch.no_grad():
        model(torch.randint(0, vocab, (batch, t)))
    counted = prof.get_total_flops()
    prof.end_profile()
    matrices = layers * (3 * d * d + d * d + 8 * d * d) + d * vocab
    analytic = 2 * matrices * batch * t + 4 * layers * batch * t * t * d
    assert isinstance(counted, int)
    assert analytic <= counted <= 1.02 * analytic
