"""Tensor and sequence parallelism on one mesh: ``autotp_size: 2`` with ``sequence_parallel_size:
2`` through ``initialize`` on 4 gloo ranks (tp 2 × sp 2) trains a tiny Llama like one process.

The model has 8 query and 2 KV heads, so AutoTP leaves each TP rank 4 query heads and 1 KV head,
and Ulysses over ``sp`` has fewer KV heads than ranks: it replicates the local KV head and gives
each sp rank 2 query heads. The data comes from the loader ``initialize`` builds: TP peers read
the same samples, each sp rank its half of the sequence (asserted against the reference's batch).
Labels are masked so that the two halves hold different numbers of valid tokens (a sample's first
half may hold none).

ZeRO stages 0-3, AdamW, clipping at 0.5 (active every step), fp32, `STEPS` steps: every
rank's per-step loss must equal the single-process model's on the whole sequences to 1e-5
relative, and every parameter its TP slice of the reference's (shard maps cut from the full
tensor) to 1e-5. A model whose heads cannot be split (6 query / 2 KV heads: 3/1 per TP rank, and
3 query heads cannot share one KV head replicated over 2 sp ranks) is refused at ``initialize``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

from deepshard.interface import Topology
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

STEPS, SEQ, ROWS, VOCAB = 5, 16, 2, 64
LR, CLIP = 1e-2, 0.5
STAGES = (0, 1, 2, 3)
EPS = 1e-3
"""Adam's ``eps``, as in ``test_tp_llama_zero_matches_reference.py``: the TP embedding sums a
repeated token's gradient rows in another order than ``nn.Embedding``, and with torch's 1e-8
Adam's ``g / (|g| + eps)`` turns that rounding into updates of up to ``lr``."""


def _llama(heads: int = 8, kv_heads: int = 2) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=4 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
        use_cache=False,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _samples() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    samples = []
    for i in range(STEPS * ROWS):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=gen)
        labels = ids.clone()
        if i % 2:
            labels[SEQ - 2 - i % 5 :] = -100  # the second half loses a few labels
        else:
            labels[: int(torch.randint(SEQ // 2, SEQ - 2, (1,), generator=gen))] = -100
        samples.append({"input_ids": ids, "labels": labels})
    return samples


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_clipping": CLIP,
        "sequence_parallel_size": 2,
        "tensor_parallel": {"autotp_size": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }


def _run(dims: Any, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.autotp import tp_state

    engine, _, loader, _ = ds.initialize(
        _llama(), _config(stage), training_data=_samples(), mesh=dims
    )
    losses, shards = [], []
    for batch in loader:
        shards.append(batch["input_ids"])
        losses.append(engine.backward(engine(**batch).loss).item())
        engine.step()
    gathered = engine.optimizer.sharded.gathered() if stage == 3 else torch.no_grad()
    with gathered:
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    maps = tp_state(engine.module).shard_maps
    return {"losses": losses, "shards": shards, "params": params, "maps": maps}


def _train(mesh: Any) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.comm import ParallelDims
    from deepshard.interface.errors import ConfigError

    dims = ParallelDims.from_mesh(mesh)
    runs = {stage: _run(dims, stage) for stage in STAGES}
    try:
        ds.initialize(_llama(heads=6), _config(0), mesh=dims)
        refusal = "accepted"
    except ConfigError as exc:
        refusal = str(exc)
    return {"runs": runs, "refusal": refusal, **dims.coordinate}


def _reference() -> dict[str, Any]:
    samples = _samples()
    order = list(DistributedSampler(samples, num_replicas=1, rank=0, shuffle=True, seed=0))
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses, batches = [], []
    for step in range(STEPS):
        rows = [samples[i] for i in order[step * ROWS : (step + 1) * ROWS]]
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
        loss = model(**batch).loss
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP) > CLIP  # clipping acts
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        batches.append(batch)
    return {"losses": losses, "batches": batches, "params": dict(model.named_parameters())}


def _check_params(got: dict[str, Any], ref: dict[str, Any], tp_rank: int, what: str) -> int:
    split = 0
    for name, value in got["params"].items():
        full = ref["params"][name].detach()
        smap = got["maps"].get(name)
        if smap is not None:
            split += 1
            full = torch.tensor(smap.extract(full.reshape(-1).tolist(), tp_rank))
        torch.testing.assert_close(
            value.reshape(-1), full.reshape(-1), rtol=1e-5, atol=1e-5, msg=f"{what} {name}"
        )
    return split


def _valid_per_half(labels: torch.Tensor) -> tuple[int, int]:
    """Valid next-token labels in each sp rank's half (labels shift on the whole sequence)."""
    valid = labels[:, 1:] != -100
    return int(valid[:, : SEQ // 2].sum()), int(valid[:, SEQ // 2 :].sum())


def test_tp2_sp2_llama_matches_one_process(tmp_path: Path) -> None:
    results = run_on_mesh(
        _train, 4, topology=Topology(tp=2, sp=2), store_dir=tmp_path, timeout_s=300
    )
    ref = _reference()
    for batch in ref["batches"]:  # a mean of per-shard means would be wrong on every step
        first, second = _valid_per_half(batch["labels"])
        assert first != second, (first, second)
    initial = dict(_llama().named_parameters())
    assert max(float((ref["params"][n] - p).detach().norm()) for n, p in initial.items()) > 1e-3
    for rank in results:
        half = slice(rank["sp"] * SEQ // 2, (rank["sp"] + 1) * SEQ // 2)
        for stage in STAGES:
            got, what = rank["runs"][stage], f"tp {rank['tp']} sp {rank['sp']} zero-{stage}"
            for shard, batch in zip(got["shards"], ref["batches"], strict=True):
                assert torch.equal(shard, batch["input_ids"][:, half]), what
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), what
            assert _check_params(got, ref, rank["tp"], what) >= 7 * 2  # q k v o gate up down
        assert rank["refusal"].startswith("sequence_parallel_size: the attention heads left")
        assert "3 query heads" in rank["refusal"], rank["refusal"]
