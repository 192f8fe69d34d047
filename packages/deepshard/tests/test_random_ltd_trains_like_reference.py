"""Random-LTD through ``initialize``: 2 gloo ranks at ZeRO-2 and 3 train like one process, resume.

A tiny Hugging Face Llama (3 layers) with ``random_ltd_layer_id: [1]``: ``initialize`` finds the
model's layer list and hooks layer 1, the engine moves the schedule each training forward
(kept tokens 4, 6, 8, 10, then the whole 12), and every micro-step draws per-rank tokens. The
reference runs one process with the same hooks given the same seeds (`draw_seed` of the micro-step
and rank) and kept counts (`kept_tokens` of the step), averaging the four micro-batches of each
step as two ranks with two accumulation steps do, then ``torch.optim.SGD``. Losses and weights
must agree; the engine reports the consumed layer-tokens; a checkpoint after step 2 loaded into
a fresh engine continues with bit-identical losses (the schedule and micro-step count restored).
A model with two equally long layer lists trains only once ``convert_to_random_ltd(engine,
LayerClass)`` has named its layers (the forward before it says so).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.engine.random_ltd import attach_random_ltd, draw_seed, find_layers, kept_tokens
from deepshard.interface.config import RandomLtdConfig
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # two gloo ranks, two engines; the main run has it

STEPS, MICRO, SEQ, VOCAB, LR, SEED = 5, 2, 12, 40, 0.2, 1234
LTD = {
    "enabled": True,
    "random_ltd_layer_id": [1],
    "random_ltd_layer_num": 1,
    "total_layer_num": 3,
    "random_ltd_schedule": {
        "min_value": 4,
        "max_value": SEQ,
        "schedule_config": {"seq_per_step": 2, "require_steps": 4},
    },
}


def _llama() -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=2 * SEQ,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)


def _config(stage: int = 2) -> dict[str, Any]:
    return {
        "train_batch_size": 2 * MICRO * 2,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "gradient_clipping": 0.0,  # (DeepSpeed's default is 1.0; the reference does not clip)
        "zero_optimization": {"stage": stage},
        "data_efficiency": {"seed": SEED, "data_routing": {"random_ltd": LTD}},
    }


def _train(engine: Any, steps: range, rank: int) -> list[float]:
    losses = []
    for step in steps:
        for micro in range(2):
            ids = _batch(step, micro, rank)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    return losses


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.proj(hidden))


class _TwoStacks(torch.nn.Module):
    """Two layer lists of equal length: which one drops tokens must be said."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = torch.nn.ModuleList(_Block() for _ in range(3))
        self.decoder = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.encoder:
            hidden = block(hidden)
        return hidden.pow(2).mean()


def _named_by_class(mesh: Any) -> dict[str, Any]:
    """initialize cannot pick the layers; training asks for them; convert_to_random_ltd names
    them by class (DeepSpeed's call)."""
    import deepshard.engine as ds
    from deepshard.engine.random_ltd import convert_to_random_ltd

    config = {**_config(), "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = ds.initialize(_TwoStacks(), config, mesh=mesh)
    hidden = torch.randn(MICRO, SEQ, 8)
    try:
        engine(hidden)
        refused = ""
    except ds.ConfigError as error:
        refused = str(error)
    assert convert_to_random_ltd(engine, _Block) is engine
    kept = []
    engine.module.encoder[1].register_forward_pre_hook(lambda _m, args: kept.append(args[0].shape))
    engine.backward(engine(hidden))
    engine.step()
    try:
        convert_to_random_ltd(_TwoStacks(), _Block)
        plain = ""
    except ds.ConfigError as error:
        plain = str(error)
    return {"refused": refused, "kept": kept, "plain": plain}


def _gathered(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter whole (at stage 3 gathered from the ranks' partitions)."""
    from deepshard.zero import GatheredParameters

    named = dict(engine.module.named_parameters())
    if engine.zero_optimization_stage() < 3:
        return {n: p.detach().clone() for n, p in named.items()}
    with GatheredParameters(list(named.values())):
        return {n: p.detach().clone() for n, p in named.items()}


def _rank_body(mesh: Any, folder: str, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds

    engine, *_ = ds.initialize(_llama(), _config(stage), mesh=mesh)
    rank = mesh.get_rank()
    first = _train(engine, range(3), rank)
    engine.save_checkpoint(folder, tag="step3")
    rest = _train(engine, range(3, STEPS), rank)
    params = _gathered(engine)
    consumed = engine.random_ltd_scheduler.consumed_layer_tokens
    again, *_ = ds.initialize(_llama(), _config(stage), mesh=mesh)
    again.load_checkpoint(folder, tag="step3")
    resumed = _train(again, range(3, STEPS), rank)
    return {
        "named": _named_by_class(mesh) if stage == 2 else None,
        "losses": first + rest,
        "params": params,
        "consumed": consumed,
        "rest": rest,
        "resumed": resumed,
    }


def _reference() -> dict[str, Any]:
    model = _llama()
    model.train()
    position = {"micro_step": 0, "rank": 0, "step": 0}
    attach_random_ltd(
        find_layers(model),
        RandomLtdConfig(**LTD),
        draw_seed=lambda: draw_seed(SEED, position["micro_step"], position["rank"]),
        kept=lambda: kept_tokens(RandomLtdConfig(**LTD), position["step"]),
    )
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses: dict[int, list[float]] = {0: [], 1: []}
    for step in range(STEPS):
        position["step"] = step
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for micro in range(2):
            position["micro_step"] = 2 * step + micro
            for rank in range(2):
                position["rank"] = rank
                ids = _batch(step, micro, rank)
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses[rank].append(float(loss.detach()))
                for grad, p in zip(grads, model.parameters(), strict=True):
                    grad += p.grad / 4  # / accumulation steps, / ranks
                    p.grad = None
        for grad, p in zip(grads, model.parameters(), strict=True):
            p.grad = grad
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "params": {n: p.detach() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_drop_tokens_like_one_process_and_resume(tmp_path: Path, stage: int) -> None:
    ranks = run_on_mesh(_rank_body, 2, args=(str(tmp_path / "ckpt"), stage), timeout_s=240)
    ref = _reference()
    section = RandomLtdConfig(**LTD)
    assert [kept_tokens(section, s) for s in range(STEPS)] == [4, 6, 8, 10, 12]
    # 8 samples per step x (r x 1 dropping layer + 12 x 2 full layers), r as above.
    consumed = sum(8 * (kept_tokens(section, s) + 2 * SEQ) for s in range(STEPS))
    for rank, out in enumerate(ranks):
        torch.testing.assert_close(out["losses"], ref["losses"][rank], rtol=1e-5, atol=1e-5)
        for name, value in ref["params"].items():
            torch.testing.assert_close(out["params"][name], value, rtol=1e-4, atol=1e-5)
        assert out["consumed"] == consumed
        assert out["resumed"] == out["rest"]
        named = out["named"]
        if named is None:  # checked once, at stage 2
            continue
        assert "convert_to_random_ltd(engine, LayerClass)" in named["refused"]
        # Our hook runs after random-LTD's pre-hook: layer 1 received 4 of the 12 tokens.
        assert named["kept"] == [torch.Size([MICRO, 4, 8])]
        assert "takes the engine" in named["plain"]
