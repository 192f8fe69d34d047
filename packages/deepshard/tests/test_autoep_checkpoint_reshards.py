"""An AutoEP checkpoint written at EP = 2 loads at EP = 1 and EP = 4 with the same logits.

Two gloo ranks train a tiny ``MixtralForCausalLM`` (4 experts, 2 per rank) through
``initialize`` with ``expert_parallel.enabled`` for 2 AdamW steps and save; their expert
entries' shard maps span every ``ep`` rank's experts, so the checkpoint holds the whole model.
One process (EP = 1, every expert) and four ranks (EP = 4, one expert each) build the untrained
model the same way and load it; each must then give the saving run's logits on a fixed batch
(within fp32 summation-order noise), which differ from the untrained model's. Saved at ZeRO-3
(loaded at ZeRO-3) and at ZeRO-2, where expert and dense parameters are two reduction groups of
one flat optimizer (loaded at ZeRO-0 at EP = 1 and ZeRO-1 at EP = 4, two groups again).
Before saving, ``safe_get_full_fp32_param`` of every parameter (gathered over its own group)
must be the rank's parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import deepshard.engine as ds
from deepshard.interface import Topology
from deepshard.testing import import_beside, run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

pytest.importorskip("transformers", reason="transformers is in the dev group only")
_parity = import_beside(__file__, "test_autoep_zero_matches_reference.py")

STEPS = 2


def _logits(engine: Any) -> torch.Tensor:
    ids = _parity._batch(99, 0)  # the same batch on every rank
    with torch.no_grad():
        return engine(input_ids=ids).logits.detach().clone()


def _save(mesh: Any, root: str, stage: int) -> dict[str, Any]:
    engine, _, _, _ = ds.initialize(_parity._model(), _parity._config(stage, ep=2), mesh=mesh)
    untrained = _logits(engine)
    for step in range(STEPS):
        ids = _parity._batch(step, engine.parallel_dims.batch_rank)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(root)
    from deepshard.zero import safe_get_full_fp32_param

    # every master, gathered over its own group (the experts' dp, the dense dp x ep)
    masters = {n: safe_get_full_fp32_param(p, engine.optimizer) for n, p in _named(engine)}
    whole = engine.optimizer.sharded.gathered() if stage == 3 else torch.no_grad()
    with whole:
        params = {n: p.detach().clone() for n, p in _named(engine)}
    return {"untrained": untrained, "logits": _logits(engine), "masters": masters, "params": params}


def _named(engine: Any) -> list[tuple[str, torch.Tensor]]:
    return list(engine.module.named_parameters())


def _load(mesh: Any, root: str, ep: int, stage: int) -> dict[str, Any]:
    engine, _, _, _ = ds.initialize(_parity._model(), _parity._config(stage, ep=ep), mesh=mesh)
    engine.load_checkpoint(root)
    whole = engine.optimizer.sharded.gathered() if stage == 3 else torch.no_grad()
    with whole:
        shapes = {
            n: tuple(p.shape) for n, p in engine.module.named_parameters() if ".experts." in n
        }
    return {"logits": _logits(engine), "shapes": shapes}


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("saved_at", "loads"), [(3, ((1, 3), (4, 3))), (2, ((1, 0), (4, 1)))], ids=["zero3", "zero2"]
)
def test_ep2_checkpoint_loads_at_ep1_and_ep4(
    tmp_path: Path, saved_at: int, loads: tuple[tuple[int, int], ...]
) -> None:
    root = str(tmp_path / "ckpt")
    saved = run_on_mesh(
        _save,
        2,
        topology=Topology(ep=2),
        args=(root, saved_at),
        store_dir=tmp_path / "s2",
        timeout_s=300,
    )
    want = saved[0]["logits"]
    assert float((want - saved[0]["untrained"]).abs().max()) > 1e-3  # training moved them
    for rank in saved:  # fp32 training: each master is the rank's parameter (its experts)
        assert any(".experts." in n for n in rank["masters"])
        for name, master in rank["masters"].items():
            torch.testing.assert_close(master, rank["params"][name], rtol=0, atol=0, msg=name)
    for ep, stage in loads:
        loaded = run_on_mesh(
            _load,
            ep,
            topology=Topology(ep=ep),
            args=(root, ep, stage),
            store_dir=tmp_path / f"l{ep}",
            timeout_s=300,
        )
        for rank in loaded:
            assert rank["shapes"], "no expert parameter"
            for name, shape in rank["shapes"].items():
                assert shape[0] == _parity.EXPERTS // ep, name
            torch.testing.assert_close(rank["logits"], want, rtol=0, atol=1e-5)
