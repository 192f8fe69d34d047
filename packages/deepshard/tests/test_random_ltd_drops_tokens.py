"""Random-LTD without processes: the schedule, the drawn tokens, and layers that drop them.

* `kept_tokens` / `RandomLtdScheduler`: hand-computed values of DeepSpeed's formula, and (with
  the ``bench`` group) the same values and consumed layer-tokens as DeepSpeed's own scheduler.
* `kept_indices`: sorted, distinct, in range, reproducible from the seed.
* A hooked toy layer equals ``out = h; out[b, kept_b] = layer(h[b, kept_b])`` computed row by
  row with plain indexing, outputs and gradients, in both hidden-state orders; a padding mask
  ``[B, 1, S, S]`` reaches the layer as its kept rows and columns.
* A tiny Hugging Face Llama with layer 1 of 3 dropping: logits equal a hand-run forward that
  feeds that layer each row's kept tokens with their rotary embeddings and positions; in eval
  mode it is the plain model; torch's global generator is not drawn from; with activation
  checkpointing the recompute drops the same tokens (loss and gradients equal the run without).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.engine.random_ltd import (
    RandomLtdScheduler,
    attach_random_ltd,
    find_layers,
    kept_indices,
    kept_tokens,
)
from deepshard.interface.config import RandomLtdConfig
from deepshard.interface.errors import ConfigError


def _section(**extra: Any) -> RandomLtdConfig:
    values: dict[str, Any] = {
        "enabled": True,
        "random_ltd_layer_id": [1],
        "random_ltd_layer_num": 1,
        "total_layer_num": 3,
        "random_ltd_schedule": {
            "min_value": 16,
            "max_value": 64,
            "schedule_config": {"seq_per_step": 8, "require_steps": 10},
        },
    }
    values.update(extra)
    return RandomLtdConfig(**values)


def test_schedule_follows_the_fixed_linear_formula() -> None:
    section = _section()
    # floor(16 + 48 * t / 10), down to a multiple of 8, at most 64.
    expected = {0: 16, 3: 24, 5: 40, 9: 56, 10: 64, 20: 64}
    assert {t: kept_tokens(section, t) for t in expected} == expected
    scheduler = RandomLtdScheduler(section, global_batch_size=4)
    assert [scheduler.update_seq(t) for t in (0, 0, 1)] == [16, 16, 16]
    # Steps 0 and 1 counted once each: 4 samples x (r x 1 layer + 64 x 2 layers).
    assert scheduler.consumed_layer_tokens == 2 * 4 * (16 + 128)
    state = scheduler.state_dict()
    again = RandomLtdScheduler(section, global_batch_size=4)
    again.load_state_dict(state)
    assert again.state_dict() == state and again.update_seq(5) == 40


def test_schedule_matches_deepspeed() -> None:
    routing = pytest.importorskip(
        "deepspeed.runtime.data_pipeline.data_routing.scheduler",
        reason="DeepSpeed is in the bench group",
    )
    section = _section()
    theirs = routing.RandomLTDScheduler(
        {
            "total_layer_num": 3,
            "random_ltd_layer_num": 1,
            "random_ltd_schedule": {
                "min_value": 16, "max_value": 64, "schedule_type": "fixed_linear",
                "schedule_config": {"seq_per_step": 8, "require_steps": 10},
            },
            "global_batch_size": 4,
            "layer_token_lr_schedule": {"enabled": False},
        }
    )  # fmt: skip
    ours = RandomLtdScheduler(section, global_batch_size=4)
    for step in [0, 0, 1, 2, 3, 5, 8, 9, 10, 11, 15]:
        theirs.update_seq(step)
        assert ours.update_seq(step) == theirs.get_current_seq(), step
        assert ours.consumed_layer_tokens == theirs.state["consumed_layer_tokens"], step


def test_kept_indices_are_sorted_distinct_and_seeded() -> None:
    index = kept_indices(3, 20, 7, seed=11)
    assert index.shape == (3, 7)
    for row in index.tolist():
        assert row == sorted(set(row)) and all(0 <= i < 20 for i in row)
    assert torch.equal(index, kept_indices(3, 20, 7, seed=11))
    assert not torch.equal(index, kept_indices(3, 20, 7, seed=12))


class _Layer(torch.nn.Module):
    """Mixes tokens (so which ones are kept matters) and reports the mask it was given."""

    def __init__(self, seq_dim: int = 1) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)
        self.seq_dim = seq_dim
        self.masks: list[torch.Tensor] = []

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        if attention_mask is not None:
            self.masks.append(attention_mask)
        mixed = hidden + hidden.mean(dim=self.seq_dim, keepdim=True)
        return torch.tanh(self.proj(mixed)), "extra"


class _Stack(torch.nn.Module):
    def __init__(self, seq_dim: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(_Layer(seq_dim) for _ in range(3))


def _hooked(section: RandomLtdConfig, keep: int, seed: int) -> _Stack:
    stack = _Stack(1 if section.hidden_state_order == "batch_seq_dim" else 0)
    attach_random_ltd(find_layers(stack), section, draw_seed=lambda: seed, kept=lambda: keep)
    return stack


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
def test_a_hooked_layer_runs_on_the_kept_tokens_only(order: str) -> None:
    section, keep, seed = _section(hidden_state_order=order), 5, 7
    batch_first = order == "batch_seq_dim"
    stack = _hooked(section, keep, seed)
    plain = _Stack(1 if batch_first else 0)  # same weights, no hooks

    def layout(tensor: torch.Tensor) -> torch.Tensor:  # [B, S, H] <-> the layer's order
        return tensor if batch_first else tensor.transpose(0, 1)

    hidden = torch.randn(2, 9, 6, requires_grad=True)
    out, extra = stack.layers[1](layout(hidden))
    out = layout(out)
    assert extra == "extra"
    index = kept_indices(2, 9, keep, seed=seed + 1)  # layer 1 adds its id to the seed
    rows = []
    for b in range(2):
        row = hidden[b].clone()
        kept_out, _ = plain.layers[1](layout(hidden[b : b + 1, index[b]]))
        row[index[b]] = layout(kept_out)[0]
        rows.append(row)
    expected = torch.stack(rows)
    torch.testing.assert_close(out, expected)
    weights = torch.randn_like(out)
    (grad,) = torch.autograd.grad((out * weights).sum(), hidden)
    (want,) = torch.autograd.grad((expected * weights).sum(), hidden)
    torch.testing.assert_close(grad, want)
    stack.eval()
    given = layout(hidden)
    torch.testing.assert_close(stack.layers[1](given)[0], plain.layers[1](given)[0])
    whole = _hooked(section, keep=9, seed=seed)  # r >= S: the layer sees every token
    torch.testing.assert_close(whole.layers[1](given)[0], plain.layers[1](given)[0])


def test_padding_masks_are_gathered_on_both_axes() -> None:
    stack = _hooked(_section(), keep=4, seed=3)
    mask = torch.rand(2, 1, 9, 9) > 0.3
    stack.layers[1](torch.randn(2, 9, 6), attention_mask=mask)
    (given,) = stack.layers[1].masks
    index = kept_indices(2, 9, 4, seed=3 + 1)
    for b in range(2):
        assert torch.equal(given[b, 0], mask[b, 0][index[b]][:, index[b]])


def test_bad_layer_choices_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"random_ltd_layer_id: \[5\] must be distinct"):
        _hooked(_section(random_ltd_layer_id=[5]), keep=4, seed=0)
    with pytest.raises(ConfigError, match="random_ltd_layer_num: 2 but random_ltd_layer_id"):
        _hooked(_section(random_ltd_layer_num=2), keep=4, seed=0)
    with pytest.raises(ConfigError, match="total_layer_num: 4 but the model has 3"):
        _hooked(_section(total_layer_num=4), keep=4, seed=0)
    two = torch.nn.Module()
    two.a, two.b = torch.nn.ModuleList([_Layer()]), torch.nn.ModuleList([_Layer()])
    with pytest.raises(ConfigError, match="cannot tell which modules are the transformer layers"):
        find_layers(two)
    assert find_layers(two, _Layer) == [two.a[0], two.b[0]]


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=50, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _by_hand(model: torch.nn.Module, ids: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    inner = model.model
    hidden = inner.embed_tokens(ids)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    cos, sin = inner.rotary_emb(hidden, position_ids=positions)
    for number, layer in enumerate(inner.layers):
        if number != 1:
            hidden = layer(hidden, position_embeddings=(cos, sin), position_ids=positions)
            continue
        rows = []
        for b in range(ids.shape[0]):
            kept = index[b]
            part = layer(
                hidden[b : b + 1, kept],
                position_embeddings=(cos[:, kept], sin[:, kept]),
                position_ids=positions[:, kept],
            )
            row = hidden[b].clone()
            row[kept] = part[0]
            rows.append(row)
        hidden = torch.stack(rows)
    return model.lm_head(inner.norm(hidden))


def test_hugging_face_llama_layer_drops_tokens_with_their_positions() -> None:
    model, plain = _llama(), _llama()
    attach_random_ltd(find_layers(model), _section(), draw_seed=lambda: 5, kept=lambda: 6)
    ids = torch.randint(0, 50, (2, 11), generator=torch.Generator().manual_seed(1))
    before = torch.get_rng_state()
    logits = model(input_ids=ids).logits
    assert torch.equal(torch.get_rng_state(), before), "the draw moved torch's global generator"
    index = kept_indices(2, 11, 6, seed=5 + 1)
    torch.testing.assert_close(logits, _by_hand(plain, ids, index), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(logits, plain(input_ids=ids).logits)
    model.eval()
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_a_recompute_drops_the_same_tokens() -> None:
    runs = []
    for checkpointing in (False, True):
        model = _llama()
        attach_random_ltd(find_layers(model), _section(), draw_seed=lambda: 9, kept=lambda: 5)
        if checkpointing:
            model.activation_checkpointing_enable()
        model.train()
        ids = torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(2))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = runs
    torch.testing.assert_close(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b)
