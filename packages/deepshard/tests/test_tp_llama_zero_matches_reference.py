"""``initialize`` with a ``tp = 2`` mesh: a tiny ``LlamaForCausalLM`` split by AutoTP, trained
under ZeRO 1, 2 and 3 on 4 gloo ranks (TP 2 × DP 2), against one process.

``initialize`` parallelizes the model (`deepshard.autotp.parallelize`, before the cast) and
hands its placements to ZeRO, which partitions over ``dp`` only. Five AdamW steps with
clipping 1.0 (active on every step) must give, on every rank, the reference's loss for its dp
rank's batch at every step, and every parameter equal to the matching slice of the reference
(its TP shard map cut from the full tensor); Qwen3 (whose ``q_norm``/``k_norm`` gradients are
partial sums over TP, summed by ZeRO at the step) is checked at ZeRO-2.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

STEPS, LR, CLIP, WD, MB, SEQ = 5, 1e-2, 1.0, 0.01, 2, 8
EPS = 1e-3
"""Adam's ``eps``: its update ``g / (|g| + eps)`` turns the rounding of a gradient that nearly
cancels (an embedding row of a token seen twice in a step: its two contributions are summed in
another order by the TP embedding's ``index_add_`` than by ``nn.Embedding``) into an update
difference of up to ``lr`` when ``eps`` is torch's 1e-8 (measured: 1e-4 after 5 steps; 4e-5
with 1e-6). With 1e-3 a rounding error ``δ`` moves an update by at most ``lr · δ / eps``."""

ATOL = 1e-5
"""Parameters agree to this (measured: 2e-6 .. 5e-6 in a few embedding elements, the rest to
1e-7); one step's AdamW update is ~``lr`` = 1e-2, so a missing or wrong update is 1000x this."""
RUNS = (("llama", 1), ("llama", 2), ("llama", 3), ("qwen3", 2))
SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _model(kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=8, **SHAPE))


def _batch(step: int, dp_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + dp_rank)
    return torch.randint(0, SHAPE["vocab_size"], (MB, SEQ), generator=g)


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "eps": EPS}},
        "zero_optimization": {"stage": stage},
    }


def _train(mesh: Any, kind: str, stage: int) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.autotp import tp_state

    engine, _, _, _ = ds.initialize(_model(kind), _config(stage), mesh=mesh)
    dp = engine.parallel_dims.coordinate["dp"]
    losses = []
    for step in range(STEPS):
        ids = _batch(step, dp)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    gathered = engine.optimizer.sharded.gathered() if stage == 3 else torch.no_grad()
    with gathered:
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    maps = tp_state(engine.module).shard_maps
    return {"losses": losses, "params": params, "maps": maps, **engine.parallel_dims.coordinate}


def _all(mesh: Any) -> list[dict[str, Any]]:
    return [_train(mesh, kind, stage) for kind, stage in RUNS]


def _reference(kind: str) -> dict[str, Any]:
    model = _model(kind)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, eps=EPS)
    losses = []
    for step in range(STEPS):
        per_rank = []
        for dp in range(2):
            ids = _batch(step, dp)
            per_rank.append(model(input_ids=ids, labels=ids).loss)
        torch.stack(per_rank).mean().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # clipping acts
        inner.step()
        inner.zero_grad()
        losses.append([loss.item() for loss in per_rank])
    return {"losses": losses, "params": dict(model.named_parameters())}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict[str, Any]]]:
    from deepshard.interface import Topology

    store = tmp_path_factory.mktemp("tp_llama")
    return run_on_mesh(_all, 4, topology=Topology(dp=2, tp=2), store_dir=store, timeout_s=200)


@pytest.mark.parametrize("run", range(len(RUNS)), ids=[f"{k}-zero{s}" for k, s in RUNS])
def test_tp2_llama_matches_one_process(results: list[list[dict[str, Any]]], run: int) -> None:
    kind, _ = RUNS[run]
    ref = _reference(kind)
    for rank_runs in results:
        got = rank_runs[run]
        want_losses = [step[got["dp"]] for step in ref["losses"]]
        assert got["losses"] == pytest.approx(want_losses, rel=1e-5)
        split = 0
        for name, value in got["params"].items():
            full = ref["params"][name].detach()
            smap = got["maps"].get(name)
            if smap is None:
                torch.testing.assert_close(
                    value, full, rtol=1e-5, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
                )
                continue
            split += 1
            want = torch.tensor(smap.extract(full.reshape(-1).tolist(), got["tp"]))
            torch.testing.assert_close(
                value.reshape(-1), want, rtol=1e-5, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert split >= 7 * SHAPE["num_hidden_layers"]  # q k v o gate up down per layer
