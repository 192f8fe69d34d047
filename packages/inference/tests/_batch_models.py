"""Tiny seeded Llama and Qwen3 (fp32) and mixed-length requests for the generation tests."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from deepshard.inference._sampling import GenerationRequest

VOCAB = 128


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    """2 layers, hidden 32, 4 heads, 2 KV heads (head_dim from hidden/heads)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def tiny_qwen3(seed: int = 0) -> Qwen3ForCausalLM:
    """2 layers, hidden 64, 4 heads of explicit head_dim 32 (not 64 // 4), 2 KV heads."""
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        head_dim=32, num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def mixed_requests(count: int, seed: int, **options: object) -> list[GenerationRequest]:
    """``count`` requests with prompts of 1-10 tokens and budgets of 1-12 tokens."""
    generator = torch.Generator().manual_seed(seed)
    requests = []
    for index in range(count):
        prompt_len = int(torch.randint(1, 11, (1,), generator=generator))
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=generator).tolist()
        budget = int(torch.randint(1, 13, (1,), generator=generator))
        requests.append(GenerationRequest(f"r{index}", tuple(prompt), budget, **options))  # type: ignore[arg-type]
    return requests


def hf_greedy(model: torch.nn.Module, request: GenerationRequest) -> tuple[int, ...]:
    """The request alone through Hugging Face ``generate`` (greedy, its own dynamic cache)."""
    input_ids = torch.tensor([list(request.prompt)])
    out = model.generate(  # type: ignore[operator]
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=request.max_new_tokens,
        do_sample=False, eos_token_id=list(request.eos_token_id) or None, pad_token_id=0,
    )  # fmt: skip
    tokens = out[0, input_ids.shape[1] :].tolist()
    for index, token in enumerate(tokens):
        if token in request.eos_token_id:
            return tuple(tokens[: index + 1])
    return tuple(tokens)
