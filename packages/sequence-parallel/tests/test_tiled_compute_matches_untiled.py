"""Tiled MLP, tiled logits-loss and the generic tiled compute equal their untiled versions.

In one process, fp64: loss/output, input gradient and parameter gradients of the tiled op
against the same function run on the whole input, for shards 1, 2, 3 (3 does not divide the
7 tokens), batch 1 and 2, a transposed (non-contiguous) input, both loss reductions, and masked
labels that give the slices unequal (and once zero) valid-token counts. Each parameter's
post-accumulate-grad hook fires once per backward (one final gradient, as ZeRO needs).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel import (
    SequenceTiledCompute,
    TiledFusedLogitsLoss,
    TiledMLP,
    sequence_tiled_compute,
)

SEQ, HIDDEN, INTER, VOCAB = 7, 6, 10, 11
GRID = list(itertools.product((1, 2, 3), (1, 2)))


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gate = torch.nn.Linear(HIDDEN, INTER, bias=False, dtype=torch.float64)
        self.up = torch.nn.Linear(HIDDEN, INTER, bias=False, dtype=torch.float64)
        self.down = torch.nn.Linear(INTER, HIDDEN, bias=True, dtype=torch.float64)


def mlp_fn(m: MLP, x: torch.Tensor) -> torch.Tensor:
    return m.down(F.silu(m.gate(x)) * m.up(x))


def _transposed_input(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, HIDDEN, SEQ, generator=gen, dtype=torch.float64)
    x = base.transpose(1, 2).requires_grad_()  # [batch, SEQ, HIDDEN], hidden dim strided
    assert not x.is_contiguous()
    return x


def _grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    assert x.grad is not None
    out = {"x": x.grad.clone()}
    for name, p in module.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.clone()
    return out


def _count_hooks(module: torch.nn.Module) -> dict[str, int]:
    calls = dict.fromkeys((n for n, _ in module.named_parameters()), 0)
    for name, p in module.named_parameters():

        def hook(_: torch.Tensor, name: str = name) -> None:
            calls[name] += 1

        p.register_post_accumulate_grad_hook(hook)
    return calls


@pytest.mark.parametrize(("shards", "batch"), GRID)
def test_tiled_mlp_matches_untiled(shards: int, batch: int) -> None:
    module = MLP()
    x = _transposed_input(batch, seed=shards * 10 + batch)
    go = torch.randn(batch, SEQ, HIDDEN, dtype=torch.float64)
    want_out = mlp_fn(module, x)
    want_out.backward(go)
    want = _grads(module, x)
    module.zero_grad()
    x.grad = None
    calls = _count_hooks(module)
    out = TiledMLP.apply(mlp_fn, module, x, shards)
    out.backward(go)
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for name, grad in _grads(module, x).items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=1e-12, msg=name)
    assert set(calls.values()) == {1}, calls


def _loss_fn(reduction: str) -> Any:
    def fn(head: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> Any:
        per_token = F.cross_entropy(head(x), y, reduction="none")[m]
        return per_token.mean() if reduction == "mean" else per_token.sum()

    return fn


def _labels_and_mask(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    mask = torch.ones(batch, SEQ, dtype=torch.bool)
    mask[0, :3] = False  # with 3 slices of batch 1 the first slice has no valid token
    mask[-1, -1] = False
    return y, mask


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("shards", "batch"), GRID)
def test_tiled_loss_matches_untiled(shards: int, batch: int, reduction: str) -> None:
    torch.manual_seed(1)
    head = torch.nn.Linear(HIDDEN, VOCAB, dtype=torch.float64)
    x = _transposed_input(batch, seed=100 + shards)
    y, mask = _labels_and_mask(batch, seed=shards)
    fn = _loss_fn(reduction)
    want_loss = fn(head, x.reshape(-1, HIDDEN), y.reshape(-1), mask.reshape(-1))
    (want_loss * 1.5).backward()
    want = _grads(head, x)
    head.zero_grad()
    x.grad = None
    calls = _count_hooks(head)
    loss = TiledFusedLogitsLoss.apply(fn, head, x, y, mask, shards, reduction)
    (loss * 1.5).backward()
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=1e-12)
    for name, grad in _grads(head, x).items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=1e-12, msg=name)
    assert set(calls.values()) == {1}, calls


@pytest.mark.parametrize("reduction", [None, "mean", "sum"])
@pytest.mark.parametrize("shards", [1, 3])
def test_sequence_tiled_compute_matches_untiled(shards: int, reduction: Any) -> None:
    module = MLP()
    x = _transposed_input(2, seed=7)
    gate = torch.rand(2, SEQ, 1, dtype=torch.float64)

    def fn(hidden_states: torch.Tensor, gate: torch.Tensor, scale: float) -> torch.Tensor:
        return mlp_fn(module, hidden_states) * gate * scale

    go = torch.randn(2, SEQ, HIDDEN, dtype=torch.float64)

    def finish(out: torch.Tensor) -> torch.Tensor:
        if reduction is None:
            return (out * go).sum()
        return out * 2.0

    full = fn(x, gate, 3.0)
    want_out = full if reduction is None else getattr(full, reduction)()
    finish(want_out).backward()
    want = _grads(module, x)
    module.zero_grad()
    x.grad = None
    out = SequenceTiledCompute.apply(
        fn,
        shards,
        {"hidden_states": x, "gate": gate},
        "hidden_states",
        passed={"scale": 3.0},
        module=module,
        output_reduction=reduction,
    )
    finish(out).backward()
    torch.testing.assert_close(out, want_out, rtol=0, atol=1e-12)
    for name, grad in _grads(module, x).items():
        torch.testing.assert_close(grad, want[name], rtol=0, atol=1e-12, msg=name)


def test_bad_input_is_a_config_error() -> None:
    module, x = MLP(), _transposed_input(1, seed=3)
    y, mask = _labels_and_mask(1, seed=3)
    with pytest.raises(ConfigError, match="shards must be a positive integer"):
        TiledMLP.apply(mlp_fn, module, x, 0)
    with pytest.raises(ConfigError, match="one output row"):
        TiledMLP.apply(lambda m, t: t.sum(0, keepdim=True), module, x, 2)
    with pytest.raises(ConfigError, match="output_reduction"):
        TiledFusedLogitsLoss.apply(_loss_fn("sum"), module, x, y, mask, 2, "max")
    with pytest.raises(ConfigError, match=r"\[batch, seq\]"):
        TiledFusedLogitsLoss.apply(_loss_fn("sum"), module, x, y[:, :3], None, 2, "sum")
    with pytest.raises(ConfigError, match="mask must be"):
        TiledFusedLogitsLoss.apply(_loss_fn("sum"), module, x, y, mask[:, :3], 2, "sum")
    with pytest.raises(ConfigError, match="grad_key"):
        sequence_tiled_compute(mlp_fn, 2, {"x": x}, "hidden_states")
    other = torch.nn.Linear(HIDDEN, HIDDEN, dtype=torch.float64)
    out = TiledMLP.apply(lambda m, t: other(mlp_fn(m, t)), module, x, 2)
    with pytest.raises(ConfigError, match="compute_params"):
        out.sum().backward()
