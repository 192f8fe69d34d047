"""Tiny Hugging Face MoE models (hidden 64, 2 layers, top-2) and the reference training loop.

DeepSeek-V2/V3 have one dense first layer (``first_k_dense_replace=1``) and group-limited
routing over 2 groups of which a token may use 1.

Weights are drawn with a fixed seed at a scale where routing is far from uniform (the HF
default init of 0.02 makes every expert nearly equally likely, which would hide a wrong
expert choice), and DeepSeek-V3's score-correction bias is non-zero so that it changes the
choice.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3", "qwen2_moe", "deepseek_v2")
_MLA = dict(
    q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16
)
_COMMON = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    num_experts_per_tok=2,
    attn_implementation="eager",
)


def build(family: str, num_experts: int = 4, seed: int = 0) -> nn.Module:
    """A randomly initialised fp32 causal LM of ``family`` with ``num_experts`` experts."""
    torch.manual_seed(seed)
    if family == "mixtral":
        config: Any = transformers.MixtralConfig(
            **_COMMON,
            intermediate_size=32,
            num_local_experts=num_experts,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
        )
        model = transformers.MixtralForCausalLM(config)
    elif family in ("qwen3_moe", "qwen2_moe"):
        cls = transformers.Qwen3MoeConfig if family == "qwen3_moe" else transformers.Qwen2MoeConfig
        extra = {"shared_expert_intermediate_size": 48} if family == "qwen2_moe" else {}
        config = cls(
            **_COMMON,
            intermediate_size=64,
            moe_intermediate_size=32,
            num_experts=num_experts,
            norm_topk_prob=family == "qwen3_moe",
            **extra,
        )
        model = (
            transformers.Qwen3MoeForCausalLM(config)
            if family == "qwen3_moe"
            else transformers.Qwen2MoeForCausalLM(config)
        )
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4},
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            **_MLA,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
    elif family == "deepseek_v2":
        config = transformers.DeepseekV2Config(
            **{**_COMMON, "num_key_value_heads": 4},
            intermediate_size=64,
            moe_intermediate_size=32,
            n_routed_experts=num_experts,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            topk_method="group_limited_greedy",
            first_k_dense_replace=1,
            routed_scaling_factor=1.5,
            **_MLA,
        )
        model = transformers.DeepseekV2ForCausalLM(config)
    else:
        raise ValueError(family)
    _randomise(model)
    return model.float()


def _randomise(model: nn.Module) -> None:
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.3)


def batch(step: int, rank: int, vocab: int = 96, shape: tuple[int, int] = (2, 8)) -> torch.Tensor:
    """Token ids for ``rank``'s micro-batch at ``step`` (the same on every process)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, shape, generator=gen)


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss (plus the aux loss where the config asks for it)."""
    return model(input_ids=ids, labels=ids).loss


def reference_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> list[float]:
    """One single-process step on the mean of the per-rank losses; returns those losses."""
    losses = [loss_of(model, ids) for ids in batches]
    (sum(losses) / len(losses)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return [float(loss.detach()) for loss in losses]
