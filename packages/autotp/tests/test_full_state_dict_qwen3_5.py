"""Whole weights into and out of a TP=2 Qwen3.5 (linear-attention and full-attention layers).

The reference model's every parameter is drawn at random (norm weights included: a loader that
skipped ``Qwen3_5RMSNorm`` or ``Qwen3_5RMSNormGated`` would leave them at their init and the
logits would differ) and saved to safetensors by the test process. Each rank builds the model
from a *different* seed, parallelizes it, loads the file with `load_full_state_dict`, and must
give the reference logits; `save_full_state_dict` must return the reference's state dict
exactly, and loading that dict, or a ``save_pretrained`` folder of several safetensors files
with an index, into a fresh TP model gives the same logits again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

from deepshard.autotp import load_full_state_dict, parallelize, save_full_state_dict
from deepshard.interface import Topology
from deepshard.interface.errors import CheckpointError
from deepshard.testing import run_on_mesh

CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    layer_types=["linear_attention", "full_attention"],
    use_cache=False,
    tie_word_embeddings=False,
)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    return model


def _ranks(mesh: Any, path: Path, folder: Path) -> dict[str, Any]:
    reference = _model(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(input_ids=ids).logits
        model = parallelize(_model(1), mesh)
        load_full_state_dict(model, path)
        from_file = (model(input_ids=ids).logits - want).abs().max().item()
        full = save_full_state_dict(model)
        fresh = parallelize(_model(2), mesh)
        unexpected = load_full_state_dict(fresh, {**full, "extra.weight": torch.zeros(1)})
        from_dict = (fresh(input_ids=ids).logits - want).abs().max().item()
        sharded = parallelize(_model(3), mesh)
        load_full_state_dict(sharded, folder)
        from_folder = (sharded(input_ids=ids).logits - want).abs().max().item()
    reference_state = reference.state_dict()
    saved_equal = set(full) == set(reference_state) and all(
        torch.equal(full[k], reference_state[k]) for k in full
    )
    missing = copy.copy(full)
    del missing["model.layers.0.linear_attn.norm.weight"]
    try:
        load_full_state_dict(fresh, missing)
        refused = ""
    except CheckpointError as error:
        refused = str(error)
    return {"from_file": from_file, "from_dict": from_dict, "from_folder": from_folder,
            "saved_equal": saved_equal,
            "unexpected": unexpected, "refused": refused}  # fmt: skip


def test_load_full_weights_into_tp2_qwen3_5_gives_the_unsharded_logits(tmp_path: Path) -> None:
    reference = _model(0)
    names = {type(m).__name__ for m in reference.modules()}
    assert {"Qwen3_5RMSNorm", "Qwen3_5RMSNormGated"} <= names  # the norms the issue names
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    folder = tmp_path / "hf"
    reference.save_pretrained(folder, max_shard_size="40KB")  # several files and an index
    assert len(list(folder.glob("*.safetensors"))) > 1
    results = run_on_mesh(
        _ranks, 2, topology=Topology(tp=2), args=(path, folder), store_dir=tmp_path, timeout_s=120
    )
    for rank, result in enumerate(results):
        assert result["from_file"] < 1e-5, rank
        assert result["from_dict"] < 1e-5, rank
        assert result["from_folder"] < 1e-5, rank
        assert result["saved_equal"], rank
        assert result["unexpected"] == ["extra.weight"], rank
        assert "model.layers.0.linear_attn.norm.weight" in result["refused"], rank


def test_a_folder_without_safetensors_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_full_state_dict(nn.Linear(2, 2), tmp_path)
