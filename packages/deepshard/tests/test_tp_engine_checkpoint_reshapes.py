"""Engine checkpoints of an AutoTP model load at other TP and DP sizes.

A tiny ``LlamaForCausalLM`` (8 heads, 4 KV heads: TP 4 splits evenly) trains `SAVED` AdamW
steps through ``initialize`` at (TP 2, DP 2, ZeRO-1) on 4 gloo ranks and saves with
``engine.save_checkpoint`` (over the world: ZeRO's maps span dp × tp). Engines at
(TP 1, DP 4, ZeRO-2) and (TP 4, DP 1, ZeRO-0), built from other weights, load it: their logits
equal the one-process reference's after `SAVED` steps and `MORE` further steps give the
reference's losses (masters, moments and step counts restored across the reshape).
``ds-checkpoint export`` of the TP checkpoint writes the full (unsharded) weights.

A tiny ``Phi3ForCausalLM`` does the same with fused weights (``qkv_proj``: 8 q + 2 k + 2 v heads;
``gate_up_proj``): each rank's slice is two or three boxes of the whole weight
(``Shard(0, parts)``), which ZeRO-1's flat partitions cut across; it loads at (TP 1, DP 4,
ZeRO-2) and at (TP 2, DP 2, ZeRO-3). Its attention reads ``config.num_attention_heads`` at every
forward, so matching the reference also shows AutoTP gives it this rank's head count.
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


def _model(seed: int, kind: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM, Phi3Config, Phi3ForCausalLM

    torch.manual_seed(seed)
    if kind == "phi3":
        ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
        return Phi3ForCausalLM(Phi3Config(**{**SHAPE, "num_key_value_heads": 2, **ids}))
    return LlamaForCausalLM(LlamaConfig(**SHAPE))


def _global_batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(700 + step)
    return torch.randint(0, SHAPE["vocab_size"], (ROWS, SEQ), generator=g)


def _engine(mesh: Any, stage: int, seed: int, kind: str) -> Any:
    import deepshard.engine as ds

    dp = mesh["dp"].size()
    config = {
        "train_batch_size": ROWS,
        "train_micro_batch_size_per_gpu": ROWS // dp,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        # Phi-3's own tp_plan uses a style AutoTP does not apply: its preset instead
        "tensor_parallel": {"preset_model": "phi3"} if kind == "phi3" else {},
    }
    engine, _, _, _ = ds.initialize(_model(seed, kind), config, mesh=mesh)
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


def _save(mesh: Any, root: str, kind: str) -> list[float]:
    engine = _engine(mesh, stage=1, seed=0, kind=kind)
    losses = _train(engine, range(SAVED))
    engine.save_checkpoint(root, tag="tp2")
    return losses


def _load(mesh: Any, root: str, stage: int, kind: str) -> dict[str, Any]:
    engine = _engine(mesh, stage=stage, seed=1, kind=kind)  # only the load restores the weights
    engine.load_checkpoint(root, tag="tp2")
    from deepshard.zero import safe_get_full_fp32_param

    masters = {  # this rank's TP slice of every master, gathered over dp (a fused one too)
        name: safe_get_full_fp32_param(param, engine.optimizer)
        for name, param in engine.module.named_parameters()
    }
    with torch.no_grad():
        logits = engine(input_ids=_global_batch(0)).logits
    losses = _train(engine, range(SAVED, SAVED + MORE))
    return {"logits": logits, "losses": losses, "masters": masters, **_tp_maps(engine)}


def _tp_maps(engine: Any) -> dict[str, Any]:
    if engine.parallel_dims.topology.tp == 1:
        return {"maps": {}, "tp_rank": 0}
    from deepshard.autotp import tp_state

    return {
        "maps": tp_state(engine.module).shard_maps,
        "tp_rank": engine.parallel_dims.coordinate["tp"],
    }


def _reference(kind: str) -> tuple[list[float], torch.Tensor, dict[str, torch.Tensor]]:
    """Losses of every step, logits and the weights after `SAVED` steps, in one process."""
    model = _model(0, kind)
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


_SAVES: dict[str, tuple[Path, list[list[float]]]] = {}


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``saves(kind)``: the checkpoint of `_save` for that model (made once) and its losses."""
    from deepshard.interface import Topology

    def save(kind: str) -> tuple[Path, list[list[float]]]:
        if kind not in _SAVES:
            root = tmp_path_factory.mktemp(f"tp_engine_ckpt_{kind}")
            args = (str(root / "ckpt"), kind)
            losses = run_on_mesh(
                _save, 4, topology=Topology(dp=2, tp=2), args=args, store_dir=root, timeout_s=120
            )
            _SAVES[kind] = root / "ckpt", losses
        return _SAVES[kind]

    return save


LOADS = [("llama", 1, 2), ("llama", 4, 0), ("phi3", 1, 2), ("phi3", 2, 3)]


@pytest.mark.parametrize(
    ("kind", "tp", "stage"), LOADS, ids=[f"{k}-tp{t}-dp{4 // t}-zero{s}" for k, t, s in LOADS]
)
def test_engine_tp_checkpoint_loads_at_other_sizes(
    saves: Any, tmp_path: Path, kind: str, tp: int, stage: int
) -> None:
    from deepshard.interface import Topology

    ckpt, saved_losses = saves(kind)
    ref_losses, probe, weights = _reference(kind)
    # the per-rank losses are of each dp rank's half of the batch: their mean is the batch's
    assert _mean_over_dp(saved_losses, 2) == pytest.approx(ref_losses[:SAVED], rel=1e-5)
    per_rank = run_on_mesh(
        _load,
        4,
        topology=Topology(dp=4 // tp, tp=tp),
        args=(str(ckpt), stage, kind),
        store_dir=tmp_path,
        timeout_s=120,
    )
    for got in per_rank:
        torch.testing.assert_close(got["logits"], probe, rtol=1e-4, atol=1e-5)
        for name, master in got["masters"].items():
            full = weights[name]
            smap = got["maps"].get(name)
            want = full if smap is None else smap.extract(full.reshape(-1).tolist(), got["tp_rank"])
            want = torch.as_tensor(want).reshape(master.shape)
            torch.testing.assert_close(master, want, rtol=1e-5, atol=1e-6, msg=name)
    losses = _mean_over_dp([got["losses"] for got in per_rank], tp)
    assert losses == pytest.approx(ref_losses[SAVED:], rel=1e-5)


@pytest.mark.parametrize("kind", ["llama", "phi3"])
def test_export_of_a_tp_checkpoint_gives_full_weights(
    saves: Any, tmp_path: Path, kind: str
) -> None:
    from safetensors.torch import load_file

    from deepshard.checkpoint.cli import main

    ckpt, _ = saves(kind)
    assert main(["export", str(ckpt), str(tmp_path / "hf"), "--tag", "tp2"]) == 0
    exported: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(path)))
    _, _, weights = _reference(kind)
    assert set(weights) <= set(exported)
    for name, want in weights.items():
        assert tuple(exported[name].shape) == tuple(want.shape), name  # whole, not a TP slice
        torch.testing.assert_close(exported[name], want, rtol=1e-5, atol=1e-5, msg=name)
