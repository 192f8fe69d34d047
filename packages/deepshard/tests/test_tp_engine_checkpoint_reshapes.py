"""Engine checkpoints of an AutoTP model load at other TP and DP sizes.

A tiny ``LlamaForCausalLM`` (8 heads, 4 KV heads: TP 4 splits evenly) trains `SAVED` AdamW
steps through ``initialize`` at (TP 2, DP 2, ZeRO-1) on 4 gloo ranks and saves with
``engine.save_checkpoint`` (over the world: ZeRO's maps span dp × tp). Engines at
(TP 1, DP 4, ZeRO-2) and (TP 4, DP 1, ZeRO-0), built from other weights, load it: their logits
equal the one-process reference's after `SAVED` steps and `MORE` further steps give the
reference's losses (masters, moments and step counts restored across the reshape).
``ds-checkpoint export`` of the TP checkpoint writes the full (unsharded) weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

SAVED, MORE, LR, EPS, CLIP, ROWS, SEQ = 2, 2, 1e-2, 1e-3, 1.0, 4, 8
SHAPE = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
}


def _model(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, SHAPE["vocab_size"], (ROWS, SEQ), generator=g)


def _engine(mesh: Any, stage: int, seed: int) -> Any:
    import deepshard.engine as ds

    dp = mesh["dp"].size()
    config = {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
    }
    engine, _, _, _ = ds.initialize(_model(seed), config, mesh=mesh)
    return engine


def _train(engine: Any, steps: range) -> list[float]:
    dims = engine.parallel_dims
    dp, d = dims.topology.dp, dims.coordinate["dp"]
    losses = []
    for step in steps:
        ids = _global_batch(step).chunk(dp)[d]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save(mesh: Any, root: str) -> list[float]:
    engine = _engine(mesh, stage=1, seed=0)
    losses = _train(engine, range(SAVED))
    engine.save_checkpoint(root, tag="tp2")
    return losses


def _load(mesh: Any, root: str, stage: int) -> dict[str, Any]:
    engine = _engine(mesh, stage=stage, seed=1)  # other weights: only the load restores them
    engine.load_checkpoint(root, tag="tp2")
    with torch.no_grad():
        logits = engine(input_ids=_global_batch(0)).logits
    return {"logits": logits, "losses": _train(engine, range(SAVED, SAVED + MORE))}


def _reference() -> tuple[list[float], torch.Tensor, dict[str, torch.Tensor]]:
    """Losses of every step, logits and the weights after `SAVED` steps, in one process."""
    model = _model(0)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
    losses, probe, weights = [], None, {}
    for step in range(SAVED + MORE):
        if step == SAVED:
            with torch.no_grad():
                probe = model(input_ids=_global_batch(0)).logits
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        ids = _global_batch(step)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        inner.step()
        inner.zero_grad()
        losses.append(loss.item())
    assert probe is not None
    return losses, probe, weights


def _mean_over_dp(per_rank: list[list[float]], tp: int) -> list[float]:
    firsts = per_rank[::tp]  # tp peers see the same batch
    return [sum(step) / len(firsts) for step in zip(*firsts, strict=True)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[float]]]:
    from deepshard.interface import Topology

    root = tmp_path_factory.mktemp("tp_engine_ckpt")
    topology = Topology(dp=2, tp=2)
    losses = run_on_mesh(
        _save, 4, topology=topology, args=(str(root / "ckpt"),), store_dir=root, timeout_s=120
    )
    return root / "ckpt", losses


@pytest.mark.parametrize(("tp", "stage"), [(1, 2), (4, 0)], ids=["tp1-dp4-zero2", "tp4-dp1-zero0"])
def test_engine_tp_checkpoint_loads_at_other_sizes(
    saved: tuple[Path, list[list[float]]], tmp_path: Path, tp: int, stage: int
) -> None:
    from deepshard.interface import Topology

    ckpt, saved_losses = saved
    ref_losses, probe, _ = _reference()
    # the per-rank losses are of each dp rank's half of the batch: their mean is the batch's
    assert _mean_over_dp(saved_losses, 2) == pytest.approx(ref_losses[:SAVED], rel=1e-5)
    per_rank = run_on_mesh(
        _load,
        4,
        topology=Topology(dp=4 // tp, tp=tp),
        args=(str(ckpt), stage),
        store_dir=tmp_path,
        timeout_s=120,
    )
    for got in per_rank:
        torch.testing.assert_close(got["logits"], probe, rtol=1e-4, atol=1e-5)
    losses = _mean_over_dp([got["losses"] for got in per_rank], tp)
    assert losses == pytest.approx(ref_losses[SAVED:], rel=1e-5)


def test_export_of_a_tp_checkpoint_gives_full_weights(
    saved: tuple[Path, list[list[float]]], tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from deepshard.checkpoint.cli import main

    ckpt, _ = saved
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--tag", "tp2"]) == 0
    exported: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    _, _, weights = _reference()
    assert set(weights) <= set(exported)
    for name, want in weights.items():
        assert tuple(exported[name].shape) == tuple(want.shape), name  # whole, not a TP slice
        torch.testing.assert_close(exported[name], want, rtol=1e-5, atol=1e-5, msg=name)
