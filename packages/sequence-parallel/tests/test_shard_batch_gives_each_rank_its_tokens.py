"""`shard_batch` / `UlyssesDataLoaderAdapter` cut each batch so that rank r gets shard r, and
`mask_from_positions` builds the masks transformers itself builds for whole sequences.

Everything here is a function of tensors: no process group.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.sequence_parallel import UlyssesDataLoaderAdapter, shard_batch, tile_hf_model
from deepshard.sequence_parallel._positions import mask_from_positions

SEQ = 12


def _batch() -> dict[str, Any]:
    ids = torch.arange(2 * SEQ).reshape(2, SEQ) + 100
    labels = ids.clone()
    labels[0, :5] = -100
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 9:] = 0  # right padding
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "tag": "x"}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_shards_put_back_in_rank_order_are_the_batch(size: int) -> None:
    batch = _batch()
    shards = [shard_batch(batch, sp_rank=r, sp_size=size) for r in range(size)]
    for key in ("input_ids", "labels", "attention_mask"):
        assert torch.equal(torch.cat([s[key] for s in shards], dim=1), batch[key])
    positions = torch.cat([s["position_ids"] for s in shards], dim=1)
    assert torch.equal(positions, torch.arange(SEQ).expand(2, SEQ))
    # next-token labels of the whole sequence, written out independently of the code
    expected = torch.cat([batch["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
    assert torch.equal(torch.cat([s["shift_labels"] for s in shards], dim=1), expected)
    assert all(s["tag"] == "x" and s["input_ids"].shape == (2, SEQ // size) for s in shards)


def test_a_shards_last_token_predicts_the_next_shards_first() -> None:
    first, second = (shard_batch(_batch(), sp_rank=r, sp_size=2) for r in (0, 1))
    assert torch.equal(first["shift_labels"][:, -1], second["labels"][:, 0])


def test_given_positions_and_shift_labels_are_cut_not_replaced() -> None:
    batch = _batch()
    batch["position_ids"] = torch.arange(SEQ).flip(0).expand(2, SEQ)
    batch["shift_labels"] = torch.zeros(2, SEQ, dtype=torch.long)
    shard = shard_batch(batch, sp_rank=1, sp_size=2)
    assert torch.equal(shard["position_ids"], batch["position_ids"][:, 6:])
    assert torch.equal(shard["shift_labels"], torch.zeros(2, 6, dtype=torch.long))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b.pop("input_ids"), "no input_ids"),
        (lambda b: b.update(input_ids=b["input_ids"][:, :10]), "not divisible by"),
        (lambda b: b["attention_mask"].__setitem__((0, 0), 0), "pad on the right"),
        (lambda b: b.update(attention_mask=torch.ones(2, 1, SEQ, SEQ)), "position_ids"),
        (lambda b: b.update(extra=torch.ones(2, 5)), "batch['extra']"),
    ],
)
def test_a_batch_that_cannot_be_sharded_is_refused(change: Any, message: str) -> None:
    batch = _batch()
    change(batch)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        shard_batch(batch, sp_rank=0, sp_size=4)


def _dims(rank: int, size: int) -> Any:
    return SimpleNamespace(sp=SimpleNamespace(get_local_rank=lambda: rank, size=lambda: size))


def test_the_adapter_yields_this_ranks_shard_of_every_batch() -> None:
    batches = [_batch(), _batch()]
    adapter = UlyssesDataLoaderAdapter(batches, parallel_dims=_dims(2, 3), device="cpu")
    assert len(adapter) == 2
    shards = list(adapter)
    assert len(shards) == 2
    assert torch.equal(shards[1]["input_ids"], batches[1]["input_ids"][:, 8:])
    with pytest.raises(ConfigError, match="dict batches"):
        list(UlyssesDataLoaderAdapter([(1, 2)], parallel_dims=_dims(0, 2)))  # type: ignore[list-item]


def _hf_mask(positions: torch.Tensor, attn: str) -> Any:
    from transformers import LlamaConfig
    from transformers.masking_utils import create_causal_mask

    config = LlamaConfig(hidden_size=8, num_attention_heads=2, attn_implementation=attn)
    embeds = torch.zeros(positions.shape[0], positions.shape[1], 8)
    return create_causal_mask(
        config=config,
        inputs_embeds=embeds,
        attention_mask=None,
        past_key_values=None,
        position_ids=positions,
    )


@pytest.mark.parametrize("packed", [False, True])
def test_masks_from_positions_are_transformers_masks(packed: bool) -> None:
    positions = torch.arange(SEQ).repeat(2, 1)
    if packed:  # row 1: documents of 4, 5 and 3 tokens
        positions[1] = torch.cat([torch.arange(4), torch.arange(5), torch.arange(3)])
    sdpa = mask_from_positions(positions, kind="bool", dtype=torch.float32)
    expected = _hf_mask(positions, "sdpa")
    if packed:
        assert sdpa is not None and torch.equal(sdpa, expected)
    else:
        assert sdpa is None  # plain causal: sdpa takes its is_causal path
    additive = mask_from_positions(positions, kind="additive", dtype=torch.float32)
    eager = _hf_mask(positions, "eager")
    assert additive is not None and torch.equal(additive, eager)


def test_positions_of_the_wrong_rank_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"\[batch, seq\]"):
        mask_from_positions(torch.arange(4), kind="bool", dtype=torch.float32)


def test_tiling_refuses_models_it_does_not_know_and_bad_shard_counts() -> None:
    with pytest.raises(ConfigError, match="tiled_mlp"):
        tile_hf_model(torch.nn.Linear(2, 2), mlp=True)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=16,
    )
    with pytest.raises(ConfigError, match="tiled_mlp_shards must be at least 1"):
        tile_hf_model(LlamaForCausalLM(config), mlp=True, mlp_shards=0)
