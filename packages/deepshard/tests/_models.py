"""The models, data and reference training loop the engine tests share.

* An MLP 13→37→29→7 with biases: parameters of 481, 37, 1073, 29, 203 and 7 elements, none a
  multiple of the 16-byte alignment, so parameters straddle partition boundaries at 2 and 4
  ranks.
* A tiny Hugging Face ``LlamaForCausalLM`` built from a config (hidden 32, 2 layers, 4 heads,
  vocabulary 64): nothing is downloaded (``HF_HUB_OFFLINE=1``).

Every optimizer step uses a global batch of `GLOBAL_BATCH` samples. With ``W`` ranks and ``ga``
accumulation steps, rank ``r`` at micro-step ``m`` takes rows ``(m·W + r)·mb ...`` with
``mb = GLOBAL_BATCH / (W·ga)``, so the ranks together see exactly the reference's batch.

Test modules load this file by path (pytest's importlib mode keeps ``tests/`` off ``sys.path``).
``_models = load_models(__file__)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

SIZES = (13, 37, 29, 7)
GLOBAL_BATCH = 16
SEQ_LEN = 8
VOCAB = 64
LR = 1e-2
WEIGHT_DECAY = 0.1
CLIP = 0.5
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_mlp(seed: int = 0) -> torch.nn.Module:
    """The MLP 13→37→29→7 with tanh; the same weights for the same seed."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(len(SIZES) - 1):
        layers.append(torch.nn.Linear(SIZES[i], SIZES[i + 1]))
        if i < len(SIZES) - 2:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def make_llama(seed: int = 0) -> torch.nn.Module:
    """A two-layer LlamaForCausalLM with hidden size 32, built locally (no download)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=2 * SEQ_LEN,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def mlp_batch(step: int) -> tuple[torch.Tensor, ...]:
    """Inputs and (large, so clipping triggers) targets of step ``step``."""
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(GLOBAL_BATCH, SIZES[0], generator=gen)
    return x, 3 * torch.randn(GLOBAL_BATCH, SIZES[-1], generator=gen)


def llama_batch(step: int) -> tuple[torch.Tensor, ...]:
    """Token ids of step ``step`` (they are their own labels)."""
    gen = torch.Generator().manual_seed(200 + step)
    return (torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=gen),)


def mlp_loss(forward: Callable[..., Any], batch: tuple[torch.Tensor, ...], dtype: torch.dtype):
    """MSE in fp32 of the model run in ``dtype``."""
    x, y = batch
    return F.mse_loss(forward(x.to(dtype)).float(), y)


def llama_loss(forward: Callable[..., Any], batch: tuple[torch.Tensor, ...], dtype: torch.dtype):
    """The causal-LM loss Hugging Face computes from the labels."""
    (ids,) = batch
    return forward(input_ids=ids, labels=ids).loss.float()


MODELS = {
    "mlp": (make_mlp, mlp_batch, mlp_loss),
    "llama": (make_llama, llama_batch, llama_loss),
}


def micro_batch(
    batch: tuple[torch.Tensor, ...], *, micro: int, rank: int, world: int, ga: int
) -> tuple[torch.Tensor, ...]:
    """Rank ``rank``'s rows of the global batch at accumulation micro-step ``micro``."""
    mb = GLOBAL_BATCH // (world * ga)
    start = (micro * world + rank) * mb
    return tuple(t[start : start + mb] for t in batch)


def engine_config(*, stage: int, precision: str, ga: int, **extra: Any) -> dict[str, Any]:
    """The config every equivalence run uses: AdamW (torch's), clipping at `CLIP`."""
    config: dict[str, Any] = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": CLIP,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": precision == "bf16"},
    }
    config.update(extra)
    return config


def reference(model_name: str, precision: str, steps: int) -> dict[str, Any]:
    """One process on the whole batch: the model in ``precision``, fp32 master weights,
    ``torch.optim.AdamW`` and ``clip_grad_norm_``.

    Returns:
        ``{"losses": [...], "norms": [...], "params": {name: fp32 tensor}, "initial": {...}}``.
    """
    make, batch_of, loss_of = MODELS[model_name]
    dtype = DTYPES[precision]
    model = make().to(dtype)
    params = list(model.parameters())
    masters = [p.detach().float().clone().requires_grad_(True) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    losses, norms = [], []
    for step in range(steps):
        loss = loss_of(model, batch_of(step), dtype)
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.float()
            param.grad = None
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for master, param in zip(masters, params, strict=True):
                param.copy_(master)
        losses.append(loss.item())
    final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": final, "initial": initial}
