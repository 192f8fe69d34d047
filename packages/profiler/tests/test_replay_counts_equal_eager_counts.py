"""Counts replayed on fake tensors are the eager counts, module by module, and the replay
changes nothing real.

* A tiny Hugging Face Llama, forward with the loss and backward: every module's forward and
  backward FLOPs and MACs, and the per-operator FLOPs, are equal in both modes.
* An MLP with BatchNorm and Dropout in training mode: equal counts per module; BatchNorm's
  running statistics and ``num_batches_tracked`` are what the one real step left (the replay
  updates fake copies), and the CPU random generator is where the real step left it.
* Calls recorded alike are replayed once and counted as many times as they ran; a call under
  ``torch.no_grad`` has no backward in either mode.
* A model routing tokens with ``torch.nonzero`` (a shape that depends on values) cannot be
  replayed: under ``"auto"`` the read raises `ProfilerReplayError`, one warning names the
  cause, and the next profile counts eagerly (the eager numbers); ``get_model_profile`` does
  that second profile itself. A cache object argument cannot be replayed either.
* A model with module hooks of its own (ZeRO-3 gathers parameters in them) is counted eagerly
  under ``"auto"``: its hooks run once per real call, never for a replay.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest
import torch
from torch import nn

from deepshard.profiler import (
    CountMode,
    FlopsProfiler,
    ModuleProfile,
    ProfilerError,
    ProfilerReplayError,
    get_model_profile,
)


def _numbers(node: ModuleProfile) -> dict[str, tuple[int, int, int, int]]:
    """Per module name: (calls, flops, macs, backward flops)."""
    out = {node.name: (node.calls, node.flops, node.macs, node.backward_flops)}
    for child in node.children:
        out.update(_numbers(child))
    return out


def _profile(
    model: nn.Module, mode: CountMode, step: Any, *, backward: bool = True
) -> tuple[dict[str, tuple[int, int, int, int]], dict[str, tuple[int, int]]]:
    prof = FlopsProfiler(model, count_backward=backward, count_mode=mode)
    prof.start_profile()
    step()
    prof.stop_profile()
    profile = prof.profile()
    prof.end_profile()
    return _numbers(profile.root), dict(profile.ops)


def test_tiny_llama_counts_equal_per_module_forward_and_backward() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    replayed, eager = _profile(model, "replay", step), _profile(model, "eager", step)
    assert replayed == eager
    modules, ops = replayed
    assert modules["model.layers.0.self_attn.q_proj"][1] == 2 * 2 * 16 * 64 * 64
    assert modules[""][3] > 0 and ops["mm"][1] > 0  # backward was counted


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 4)
    )


def test_batchnorm_stats_and_dropout_rng_are_untouched_by_the_replay() -> None:
    x = torch.randn(6, 8)
    counts = {}
    for mode in ("replay", "eager"):
        model = _mlp().train()
        prof = FlopsProfiler(model, count_backward=True, count_mode=mode)
        prof.start_profile()
        torch.manual_seed(1)
        model(x).sum().backward()
        bn = model[1]
        assert isinstance(bn, nn.BatchNorm1d)
        assert bn.running_mean is not None and bn.num_batches_tracked is not None
        stats = (bn.running_mean.clone(), bn.num_batches_tracked.clone())
        rng = torch.get_rng_state()
        grad = model[0].weight.grad
        assert grad is not None
        grad = grad.clone()
        counts[mode] = _numbers(prof.profile().root)  # the replay runs here
        prof.end_profile()
        assert torch.equal(bn.running_mean, stats[0]) and int(bn.num_batches_tracked) == 1
        assert torch.equal(torch.get_rng_state(), rng)
        assert torch.equal(model[0].weight.grad, grad)  # the replay's gradients are fake
        assert all(type(t) is nn.Parameter for t in model.parameters())
    assert counts["replay"] == counts["eager"]
    assert counts["replay"]["3"][1] > 0  # dropout ran (training mode) and counted


def test_repeated_calls_are_counted_per_call_and_no_grad_has_no_backward(
    count_mode: CountMode,
) -> None:
    model, x = _mlp().eval(), torch.randn(6, 8)

    def step() -> None:
        for _ in range(3):
            model(x).sum().backward()
        with torch.no_grad():
            model(x)
        model.train()
        model(torch.randn(2, 8)).sum().backward()  # another shape, in training mode
        model.eval()

    modules, _ = _profile(model, count_mode, step)
    linear = 2 * 6 * 8 * 16  # addmm: 2·M·N·K, the bias inside the product
    train_linear = 2 * 2 * 8 * 16
    assert modules["0"][:3] == (5, 4 * linear + train_linear, 4 * 6 * 8 * 16 + 2 * 8 * 16)
    assert modules["0"][3] == 3 * 2 * 6 * 8 * 16 + 2 * 2 * 8 * 16  # weight grads only
    if count_mode == "eager":
        return
    prof = FlopsProfiler(model, count_mode="replay")
    prof.start_profile()
    step()
    assert prof._replay is not None and len(prof._replay._calls) == 3  # distinct calls
    prof.end_profile()


class _Routed(nn.Module):
    """Tokens whose first feature is positive go through an expert (a value-dependent shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.expert = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.nonzero(x[:, 0] > 0).squeeze(1)
        return x.index_add(0, chosen, self.expert(x[chosen]))


def _routed_input() -> tuple[torch.Tensor, int]:
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(0))
    return x, int((x[:, 0] > 0).sum())


def test_value_dependent_shapes_fall_back_to_eager_counting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, (x, routed) = _Routed(), _routed_input()
    prof = FlopsProfiler(model)
    assert prof.replaying
    prof.start_profile()
    model(x)
    with caplog.at_level(logging.WARNING, "deepshard.profiler"):
        with pytest.raises(ProfilerReplayError, match=r"DynamicOutputShape.*next start_profile"):
            prof.get_total_flops()
        with pytest.raises(ProfilerReplayError):
            prof.get_total_flops()
    assert [r.getMessage() for r in caplog.records if "replay" in r.getMessage()] == [
        caplog.records[0].getMessage()
    ]
    assert "nonzero" in caplog.records[0].getMessage() or "Dynamic" in caplog.text
    prof.start_profile()
    assert not prof.replaying
    model(x)
    assert prof.get_total_macs() == routed * 8 * 8
    prof.end_profile()
    _, macs, _ = get_model_profile(_Routed(), args=(x,), print_profile=False, warm_up=0)
    assert macs == routed * 8 * 8
    with pytest.raises(ProfilerReplayError, match="count_mode='eager'"):
        get_model_profile(_Routed(), args=(x,), print_profile=False, count_mode="replay")


class _Cache:
    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []


class _Cached(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, cache: _Cache) -> torch.Tensor:
        cache.seen.append(x)
        return self.linear(x)


def test_a_cache_object_argument_is_not_replayed_and_bad_modes_are_refused() -> None:
    model, cache = _Cached(), _Cache()
    prof = FlopsProfiler(model, count_mode="replay")
    prof.start_profile()
    model(torch.randn(2, 4), cache)
    with pytest.raises(ProfilerReplayError, match="_Cache is neither a tensor"):
        prof.get_total_flops()
    prof.end_profile()
    assert len(cache.seen) == 1 and type(cache.seen[0]) is torch.Tensor
    with pytest.raises(ProfilerError, match="count_mode must be one of"):
        FlopsProfiler(model, count_mode="lazy")  # type: ignore[arg-type]


def test_a_model_with_hooks_of_its_own_is_counted_eagerly_under_auto(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model, calls = _mlp(), []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    prof = FlopsProfiler(model)
    with caplog.at_level(logging.INFO, "deepshard.profiler"):
        prof.start_profile()
    assert not prof.replaying and "module 0 (Linear) has hooks" in caplog.text
    model.eval()(torch.randn(6, 8))
    assert prof.get_total_macs() == 6 * 8 * 16 + 6 * 16 * 4 and calls == [1]
    prof.end_profile()
