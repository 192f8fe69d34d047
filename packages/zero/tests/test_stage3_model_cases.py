"""Stage 3 on 2 ranks with the models that break naive gather/release hooks.

Each case trains a few steps under ``shard`` + ``ZeroOptimizer`` and compares with the same
model trained in one process on the whole batch (computed in the test): a unit called twice per
forward, a unit never called (zero gradients, all ranks still reduce it), a frozen parameter, a
parameter used outside its unit through `register_external_parameter`, ``torch.no_grad()``
evaluation, a tiny Hugging Face ``LlamaForCausalLM`` with tied embeddings (default units: its
``_no_split_modules``), and fp16 overflow skipping the step.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.testing import run_on_mesh

LR, STEPS, BATCH = 0.1, 3, 8


class Twice(torch.nn.Module):
    """``layers[0]`` runs twice, ``layers[2]`` never; ``layers[1].bias`` is frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(
            [torch.nn.Linear(6, 6), torch.nn.Linear(6, 3), torch.nn.Linear(6, 6)]
        )
        self.layers[1].bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](torch.tanh(self.layers[0](x))))
        return self.layers[1](h)


class Head(torch.nn.Module):
    """Multiplies by another module's weight, which it holds outside its own parameters."""

    def __init__(self, owner: torch.nn.Linear) -> None:
        super().__init__()
        self._owner = [owner]  # a list: not registered as a submodule
        self.bias = torch.nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self._owner[0].weight.t()) + self.bias


class External(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        first = torch.nn.Linear(6, 6)
        self.layers = torch.nn.ModuleList([first, Head(first)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def _make(cls: type[torch.nn.Module]) -> torch.nn.Module:
    torch.manual_seed(0)
    return cls()


def _batch(step: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 6, generator=gen), torch.randn(BATCH, width, generator=gen)


def _sgd_reference(make: Callable[[], torch.nn.Module], width: int) -> list[torch.Tensor]:
    model = make()
    for step in range(STEPS):
        x, y = _batch(step, width)
        F.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= LR * p.grad
                    p.grad = None
    return [p.detach().clone() for p in model.parameters()]


def _sgd_stage3(
    model: torch.nn.Module,
    group: Any,
    width: int,
    prepare: Callable[[torch.nn.Module], None] | None = None,
    **policy: Any,
) -> Any:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    sharded = shard(model, group=group, policy=ZeroPolicy(**policy))
    if prepare is not None:
        prepare(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = ZeroOptimizer(
        torch.optim.SGD(trainable, lr=LR), sharded, config=ZeroConfig(stage=3), gradient_clipping=0
    )
    rank, half = group.rank(), BATCH // group.size()
    for step in range(STEPS):
        x, y = _batch(step, width)
        rows = slice(rank * half, (rank + 1) * half)
        zero.backward(F.mse_loss(model(x[rows]), y[rows]))
        zero.step()
    return sharded


EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0}


def _twice_and_eval(group: Any) -> dict[str, Any]:
    model = _make(Twice)
    sharded = _sgd_stage3(model, group, 3, **EAGER)
    x, _ = _batch(99, 3)
    with torch.no_grad():
        out = model(x)
    live_after_eval = sharded.live_numel()
    with sharded.gathered():
        params = [p.detach().clone() for p in model.parameters()]
    return {"params": params, "eval": out, "live": live_after_eval, "units": len(sharded.plans)}


def _external(group: Any) -> dict[str, Any]:
    from deepshard.zero import register_external_parameter

    try:
        _sgd_stage3(_make(External), group, 6, **EAGER)
        failed = False
    except RuntimeError:  # the weight is released (0 elements) when the head runs
        failed = True
    model = _make(External)

    def register(m: torch.nn.Module) -> None:
        register_external_parameter(m.layers[1], m.layers[0].weight)  # type: ignore[index]

    sharded = _sgd_stage3(model, group, 6, register, **EAGER)
    with sharded.gathered():
        params = [p.detach().clone() for p in model.parameters()]
    return {"failed_without": failed, "params": params}


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))


def _llama_losses(group: Any | None) -> dict[str, Any]:
    """AdamW steps on the tied tiny Llama: sharded over ``group``, or in one process."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, shard

    model = _llama()
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sharded = zero = None
    rows = slice(None)
    if group is not None:
        sharded = shard(model, group=group)
        zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=1.0)
        half = 4 // group.size()
        rows = slice(group.rank() * half, (group.rank() + 1) * half)
    losses = []
    for step in range(STEPS):
        ids = _tokens(step)[rows]
        loss = model(input_ids=ids, labels=ids).loss
        if zero is not None:
            zero.backward(loss)
            zero.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            inner.step()
            inner.zero_grad()
        losses.append(loss.item())
    units = [p.name for p in sharded.plans] if sharded is not None else []
    return {"losses": losses, "tied": tied, "units": units}


def _fp16_overflow(group: Any) -> dict[str, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    model = _make(Twice).half()
    sharded = shard(model, group=group, policy=ZeroPolicy(**EAGER))
    trainable = [p for p in model.parameters() if p.requires_grad]
    zero = ZeroOptimizer(torch.optim.SGD(trainable, lr=LR), sharded, config=ZeroConfig(stage=3))
    x, y = _batch(0, 3)
    with sharded.gathered():
        before = [p.detach().clone() for p in model.parameters()]
    scale = 2.0**40  # the fp16 gradients overflow
    zero.backward(F.mse_loss(model(x.half()).float(), y) * scale)
    skipped = zero.step(loss_scale=scale)
    with sharded.gathered():
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    zero.backward(F.mse_loss(model(x.half()).float(), y) * 8.0)
    applied = zero.step(loss_scale=8.0)
    return {"skipped": skipped.overflow, "unchanged": unchanged, "applied": not applied.overflow}


def _all(mesh: Any) -> dict[str, Any]:
    group = mesh["dp"].get_group()
    return {
        "twice": _twice_and_eval(group),
        "external": _external(group),
        "llama": _llama_losses(group),
        "fp16": _fp16_overflow(group),
    }


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_stage3_model_cases_match_one_process(tmp_path: Path) -> None:
    results = run_on_mesh(_all, 2, store_dir=tmp_path)
    twice_ref = _sgd_reference(lambda: _make(Twice), 3)
    external_ref = _sgd_reference(lambda: _make(External), 6)
    llama_ref = _llama_losses(None)
    initial = [p.detach() for p in _make(Twice).parameters()]
    reference_model = _make(Twice)
    with torch.no_grad():
        for p, value in zip(reference_model.parameters(), twice_ref, strict=True):
            p.copy_(value)
        eval_ref = reference_model(_batch(99, 3)[0])
    for result in results:
        twice = result["twice"]
        assert twice["units"] == 4  # the root and the ModuleList's three children
        assert _close(twice["params"], twice_ref)
        assert torch.equal(twice["params"][3], initial[3])  # frozen bias
        assert torch.equal(twice["params"][4], initial[4])  # never-called unit: zero gradient
        assert torch.allclose(twice["eval"], eval_ref, rtol=1e-5, atol=1e-6)
        assert twice["live"] == 0  # no_grad: released after each forward
        assert result["external"]["failed_without"]
        assert _close(result["external"]["params"], external_ref)
        llama = result["llama"]
        assert llama["tied"]
        assert llama["units"] == ["", "model.layers.0", "model.layers.1"]
        assert result["fp16"] == {"skipped": True, "unchanged": True, "applied": True}
    assert llama_ref["tied"]
    merged = [sum(r["llama"]["losses"][i] for r in results) / 2 for i in range(STEPS)]
    for got, want in zip(merged, llama_ref["losses"], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want)
