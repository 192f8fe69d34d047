"""``deepshard.engine.init_inference`` at TP 2 on 2 gloo ranks: tiny Llama and Qwen3 generate, token
for token, what the unsharded model's Hugging Face ``generate`` does (16 new tokens, a left-padded
batch of 3 prompts of different lengths); a safetensors folder from ``save_pretrained`` loaded at
TP 1 and TP 2 gives the original model's logits; sampling without a seed gives the same tokens
on both ranks.
"""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import deepshard.engine as ds
from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

VOCAB, PAD = 96, 0
LENGTHS = (3, 7, 5)


def _model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    shape = dict(
        intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=PAD,
    )  # fmt: skip
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(hidden_size=32, **shape)).eval()
    return Qwen3ForCausalLM(Qwen3Config(hidden_size=64, head_dim=32, **shape)).eval()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompts of different lengths (token 0 never appears in a prompt)."""
    generator = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    ids = torch.full((len(LENGTHS), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(LENGTHS):
        ids[row, width - length :] = torch.randint(1, VOCAB, (length,), generator=generator)
        mask[row, width - length :] = 1
    return ids, mask


def _ranks(mesh: Any, checkpoints: dict[str, str]) -> dict[str, Any]:
    ids, mask = _batch()
    out: dict[str, Any] = {}
    for kind in ("llama", "qwen3"):
        reference = _model(kind, seed=1)
        engine = ds.init_inference(
            copy.deepcopy(reference), mesh=mesh, tensor_parallel={"tp_size": 2}, dtype="fp32"
        )
        out[f"{kind}_kv_heads"] = engine._parallel.kv_heads
        out[f"{kind}_tp"] = engine.generate(ids, mask, max_new_tokens=16, pad_token_id=PAD)
        # No seed given: each rank draws its own (made to differ here), the group's first
        # rank's is used by all.
        random.seed(1000 + mesh.get_rank())
        out[f"{kind}_sampled"] = engine.generate(
            ids, mask, max_new_tokens=8, pad_token_id=PAD, do_sample=True, top_k=20
        )
        with torch.no_grad():
            out[f"{kind}_hf"] = reference.generate(
                ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=PAD
            )
            out[f"{kind}_logits_ref"] = reference(ids, attention_mask=mask).logits
            for tp in (1, 2):
                loaded = ds.init_inference(
                    _model(kind, seed=7), mesh=mesh, checkpoint=checkpoints[kind], mp_size=tp
                )
                out[f"{kind}_logits_tp{tp}"] = loaded(ids, attention_mask=mask).logits
    return out


def test_tp2_generate_matches_hf_and_checkpoints_load(tmp_path: Path) -> None:
    checkpoints = {}
    for kind in ("llama", "qwen3"):
        folder = tmp_path / kind
        _model(kind, seed=1).save_pretrained(folder, safe_serialization=True)
        checkpoints[kind] = str(folder)
    results = run_on_mesh(
        _ranks, 2, topology=Topology(tp=2), args=(checkpoints,), store_dir=tmp_path, timeout_s=120
    )
    for kind in ("llama", "qwen3"):
        assert torch.equal(results[0][f"{kind}_sampled"], results[1][f"{kind}_sampled"]), kind
    for rank, result in enumerate(results):
        for kind in ("llama", "qwen3"):
            assert result[f"{kind}_kv_heads"] == 1, (rank, kind)
            hf = result[f"{kind}_hf"]
            assert hf.shape == (3, max(LENGTHS) + 16)
            assert torch.equal(result[f"{kind}_tp"], hf), (rank, kind)
            # A model of another seed, loaded from the first one's folder, is the first model.
            ref = result[f"{kind}_logits_ref"]
            assert not torch.allclose(_model(kind, seed=7)(_batch()[0]).logits, ref[:, :, :])
            for tp in (1, 2):
                torch.testing.assert_close(
                    result[f"{kind}_logits_tp{tp}"], ref, rtol=1e-5, atol=1e-5
                )
