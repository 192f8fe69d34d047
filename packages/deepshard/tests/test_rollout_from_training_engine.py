"""A rollout generates from the training engine's own weights and leaves training untouched.

Two gloo ranks build a tiny seeded ``LlamaForCausalLM`` (fp32, attention dropout 0.1 so the
random streams matter) through ``deepshard.engine.initialize`` at ZeRO-0, 2 and 3 (``dp = 2``)
and under AutoTP (``tensor_parallel.autotp_size = 2`` on a ``tp = 2`` mesh), and generate 3
prompts greedily through `build_rollout`. Every rank's tokens must equal Hugging Face's greedy
``generate`` of the unsharded model, prompt by prompt, in this process. At ZeRO-3 the gathered
elements while generating stay within the ``gather_units`` largest units and nothing
non-resident is gathered after.

Training: three ZeRO-3 steps with a (sampled) rollout between steps give exactly the losses,
parameters and step count of three steps without one, and the recorded execution order the
stage-3 prefetch follows is the same before and after a rollout.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from deepshard.interface import Topology
from deepshard.testing import greedy_new_tokens, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

PROMPTS = ((5, 9, 2), (7, 1, 3, 3, 8), (11, 4))
NEW, STEPS, VOCAB = 6, 3, 64
SHAPE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "attention_dropout": 0.1,
    "tie_word_embeddings": False,
}
TOKENIZER = SimpleNamespace(pad_token_id=0, eos_token_id=None)


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _config(stage: int, tp: int = 1) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    return config


def _greedy(engine: Any) -> list[list[int]]:
    from deepshard.inference import RolloutRequest, SamplingConfig, build_rollout

    sampling = SamplingConfig(max_new_tokens=NEW, temperature=0, continuous_batch_size=2)
    rollout = build_rollout({"sampling": sampling, "gather_units": 1}, engine, TOKENIZER)
    batch = rollout.generate([RolloutRequest(p, request_id=i) for i, p in enumerate(PROMPTS)])
    return batch.responses.tolist()


def _generate(mesh: Any, runs: tuple[tuple[int, int], ...]) -> dict[str, Any]:
    import deepshard.engine as ds

    out: dict[str, Any] = {}
    for stage, tp in runs:
        engine, _, _, _ = ds.initialize(_model(), _config(stage, tp), mesh=mesh)
        sharded = engine._sharded
        if sharded is not None:
            sharded.peak_live_numel(reset=True)
        out[f"zero{stage}-tp{tp}"] = _greedy(engine)
        if sharded is not None:
            resident = sharded.fetcher.resident
            sizes = [u.numel for u in sharded.units if u.plan.index not in resident]
            out["peak"], out["largest"] = sharded.peak_live_numel(), max(sizes)
            out["live_after"] = sharded.live_numel()
        engine.destroy()
    return out


def _train(mesh: Any, with_rollout: bool) -> dict[str, Any]:
    import deepshard.engine as ds
    from deepshard.inference import RolloutRequest, SamplingConfig, build_rollout

    engine, _, _, _ = ds.initialize(_model(), _config(3), mesh=mesh)
    rollout = build_rollout(None, engine, TOKENIZER)
    sampling = SamplingConfig(max_new_tokens=4, temperature=1.0, n_samples_per_prompt=2)
    torch.manual_seed(1234 + mesh.get_rank())  # dropout draws from here
    losses, traces = [], []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + mesh.get_rank())
        ids = torch.randint(0, VOCAB, (2, 8), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if with_rollout:
            trace = engine._sharded.fetcher.trace
            rollout.sync_weights(engine.global_steps)
            rollout.generate(
                [RolloutRequest(p, request_id=i) for i, p in enumerate(PROMPTS)], sampling
            )
            traces.append(trace == engine._sharded.fetcher.trace and engine.module.training)
    with engine.optimizer.sharded.gathered():
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "params": params, "steps": engine.global_steps, "traces": traces}


def _train_both(mesh: Any) -> dict[str, Any]:
    return {"plain": _train(mesh, False), "rollout": _train(mesh, True)}


def _reference() -> list[list[int]]:
    model = _model()  # the rollout's tokenizer names no EOS
    return [
        greedy_new_tokens(model, torch.tensor([prompt]), max_new_tokens=NEW) for prompt in PROMPTS
    ]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _reference()


def test_zero_stages_generate_the_unsharded_tokens(
    tmp_path: Path, reference: list[list[int]]
) -> None:
    runs = ((0, 1), (2, 1), (3, 1))
    results = run_on_mesh(_generate, 2, args=(runs,), store_dir=tmp_path, timeout_s=200)
    for got in results:
        for stage, _ in runs:
            assert got[f"zero{stage}-tp1"] == reference, stage
        assert 0 < got["peak"] <= got["largest"]  # gather_units=1: one unit at a time
        assert got["live_after"] == 0


def test_autotp_generates_the_unsharded_tokens(tmp_path: Path, reference: list[list[int]]) -> None:
    results = run_on_mesh(
        _generate,
        2,
        args=(((1, 2),),),
        topology=Topology(dp=1, tp=2),
        store_dir=tmp_path,
        timeout_s=200,
    )
    for got in results:
        assert got["zero1-tp2"] == reference


def test_rollout_between_steps_leaves_training_unchanged(tmp_path: Path) -> None:
    for got in run_on_mesh(_train_both, 2, store_dir=tmp_path, timeout_s=200):
        plain, rolled = got["plain"], got["rollout"]
        assert rolled["losses"] == plain["losses"]
        assert rolled["steps"] == plain["steps"] == STEPS
        assert rolled["traces"] == [True] * STEPS
        for name, value in plain["params"].items():
            assert torch.equal(rolled["params"][name], value), name
