"""``checkpoint=``: sharded ``save_pretrained`` folders and single files load tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

from deepshard.inference import init_inference, load_checkpoint
from deepshard.interface import CheckpointError


def _qwen3(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        head_dim=16, num_key_value_heads=1, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


def test_a_sharded_folder_loads_to_the_original_logits(tmp_path: Path) -> None:
    original = _qwen3(0)
    original.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    engine = init_inference(_qwen3(1), checkpoint=str(tmp_path), dtype="fp32")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(engine(ids).logits, original(ids).logits)
        # tied: the head follows the loaded embedding
        assert engine.module.lm_head.weight is engine.module.model.embed_tokens.weight


def test_a_single_file_with_extra_names_loads_and_reports_them(tmp_path: Path) -> None:
    original = _qwen3(0)
    state = {k: v.contiguous() for k, v in original.state_dict().items() if k != "lm_head.weight"}
    save_file({**state, "unused.extra": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    model = _qwen3(1)
    assert load_checkpoint(model, tmp_path / "w.safetensors") == ["unused.extra"]
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_missing_or_misshapen_entries_are_named(tmp_path: Path) -> None:
    state = {k: v.contiguous() for k, v in _qwen3(0).state_dict().items() if k != "lm_head.weight"}
    norm = "model.norm.weight"
    save_file({k: v for k, v in state.items() if k != norm}, str(tmp_path / "a.safetensors"))
    with pytest.raises(CheckpointError, match=norm):
        load_checkpoint(_qwen3(1), tmp_path / "a.safetensors")
    save_file({**state, norm: torch.ones(3)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{norm}.*shape"):
        load_checkpoint(_qwen3(1), tmp_path / "b.safetensors")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(_qwen3(1), tmp_path / "nowhere")
