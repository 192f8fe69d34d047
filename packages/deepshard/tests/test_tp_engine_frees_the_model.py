"""Deleting a tensor-parallel engine frees the model: no DeepShard bookkeeping pins it.

AutoTP keeps per-model state (the plan, the gradient reducer, placements and shard maps) and
the engine adds ZeRO's flat buffers and hooks; each refers to the model only through the
model itself or weakly, so once the caller drops the engine and the model nothing is left
(v0.19.7 fixed debug-name maps that pinned models). Two gloo ranks on a ``tp = 2`` mesh train
one step at ZeRO-1 and ZeRO-3, drop everything, collect, and report whether the model, a
replaced submodule and a parameter are gone.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

SHAPE = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _one_engine(mesh: Any, stage: int) -> dict[str, weakref.ref[Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    import deepshard.engine as ds

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": 2},
    }
    engine, _, _, _ = ds.initialize(model, config, mesh=mesh)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    return {
        "model": weakref.ref(model),
        "replaced q_proj": weakref.ref(
            engine.module.get_submodule("model.layers.0.self_attn.q_proj")
        ),
        "a parameter": weakref.ref(next(engine.module.parameters())),
        "engine": weakref.ref(engine),
    }


def _alive_after_delete(mesh: Any) -> dict[int, list[str]]:
    alive = {}
    for stage in (1, 3):
        refs = _one_engine(mesh, stage)  # the engine and the model go out of scope here
        gc.collect()
        alive[stage] = [name for name, ref in refs.items() if ref() is not None]
    return alive


def test_deleting_the_engine_frees_the_tp_model(tmp_path: Path) -> None:
    results = run_on_mesh(
        _alive_after_delete, 2, topology=Topology(dp=1, tp=2), store_dir=tmp_path, timeout_s=200
    )
    for alive in results:
        assert alive == {1: [], 3: []}, alive
