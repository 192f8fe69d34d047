"""Muon's full-gradient path is a store of its own behind `deepshard.interface.FullGradientPath`.

On 2 ranks, Muon on the odd-sized MLP (matrices: the ``use_muon`` group; biases: the Adam group)
with ``reduce_bucket_size`` 600 so each matrix is a bucket of its own, two micro-steps a cycle:

* at stages 0-2 the optimizer's path and stage 3's `Stage3FullGrads` both satisfy the protocol,
  and the path owns exactly the ``use_muon`` groups;
* the ordinary gradient store holds only the ordinary groups' layouts, the full groups' store only
  the ``use_muon`` groups';
* the non-boundary micro-step moves no Muon gradient (stages 0-1: nothing at all; stage 2: one
  reduce-scatter per ordinary bucket); the boundary pass all-reduces each Muon bucket exactly
  once, whole (bytes: the bucket's elements × 4), and reduce-scatters (stages 1-2) each ordinary
  bucket once, while stage 0 all-reduces the ordinary buckets too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_muon = import_beside(__file__, "_muon_training.py")
_training = _muon._training

WORLD, GA = 2, 2


def _buckets(layouts: Any) -> list[int]:
    return [b.numel for layout in layouts for b in layout.buckets if b.members]


def _stage(group: Any, stage: int) -> dict[str, Any]:
    from deepshard.comm import CommsLogger
    from deepshard.interface import FullGradientPath
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer

    rank = group.get_rank()
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    model = _training.make_model()
    muon = _muon.make_muon(model)
    flags = [bool(g.get("use_muon")) for g in muon.param_groups]
    zero = ZeroOptimizer(
        muon,
        group=group,
        config=ZeroConfig.model_validate({"stage": stage, "reduce_bucket_size": 600}),
        gradient_clipping=_muon.CLIP,
        named_parameters=model.named_parameters(),
        full_grad_transform=_muon.muon_transform,
        transformed_params=_muon.muon_params(muon),
        comms_logger=logger,
    )
    path, store = zero._full, zero._store
    muon_layouts = [zero.layouts[g] for g, flag in enumerate(flags) if flag]
    plain_layouts = [zero.layouts[g] for g, flag in enumerate(flags) if not flag]
    passes: list[list[tuple[str, int]]] = []
    for micro in range(GA):
        x, y = _muon.micro_batch(0, rank, WORLD, GA, micro)
        before = len(logger.records)
        zero.backward(_training.loss_fn(model, x, y) / GA, is_boundary=micro == GA - 1)
        passes.append([(r.op, r.msg_bytes) for r in logger.records[before:]])
    zero.step()
    return {
        "protocol": isinstance(path, FullGradientPath),
        "owned": list(path.groups),
        "expected_owned": [g for g, flag in enumerate(flags) if flag],
        "ordinary_is_plain": list(store.ordinary.layouts) == plain_layouts,
        "full_is_muon": store.full is not None and list(store.full.layouts) == muon_layouts,
        "muon_buckets": _buckets(muon_layouts),
        "plain_buckets": _buckets(plain_layouts),
        "passes": passes,
        "finite": all(torch.isfinite(p).all().item() for p in model.parameters()),
    }


def _stage3_protocol(group: Any) -> bool:
    from deepshard.interface import FullGradientPath
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    model = _training.make_model()
    muon = _muon.make_muon(model)
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,))
    zero = ZeroOptimizer(
        muon,
        shard(model, group=group, policy=policy),
        config=ZeroConfig(stage=3),
        full_grad_transform=_muon.muon_transform,
        transformed_params=_muon.muon_params(muon),
    )
    path = zero._transforms
    return isinstance(path, FullGradientPath) and path.active and len(path.groups) == 1


def _all(mesh: Any) -> dict[str, Any]:
    group = mesh["dp"]
    out: dict[str, Any] = {f"stage{s}": _stage(group, s) for s in (0, 1, 2)}
    out["stage3"] = _stage3_protocol(group)
    return out


@pytest.mark.slow
def test_muon_groups_have_their_own_store_behind_the_protocol(tmp_path: Path) -> None:
    for out in run_on_mesh(_all, WORLD, store_dir=tmp_path):
        assert out["stage3"], "Stage3FullGrads is a FullGradientPath owning the use_muon group"
        for stage in (0, 1, 2):
            got = out[f"stage{stage}"]
            assert got["protocol"] and got["owned"] == got["expected_owned"], stage
            assert got["ordinary_is_plain"] and got["full_is_muon"], stage
            assert got["finite"], stage
            muon, plain = got["muon_buckets"], got["plain_buckets"]
            assert len(muon) == 3, "one bucket per matrix at reduce_bucket_size 600"
            first, boundary = got["passes"]
            if stage < 2:
                assert first == [], f"stage {stage}: the first micro-step communicates nothing"
            else:
                assert [op for op, _ in first] == ["all_reduce"] * len(plain), first
            ops = Counter(op for op, _ in boundary)
            reduced = sorted(n for op, n in boundary if op == "all_reduce")
            if stage == 0:  # every bucket all-reduced once, fp32
                assert reduced == sorted(4 * n for n in muon + plain), boundary
                assert ops == Counter(all_reduce=len(muon) + len(plain)), ops
            else:  # Muon buckets all-reduced whole; ordinary ones too on CPU, each rank
                # keeping its chunk (gloo's reduce-scatter is slower)
                assert reduced == sorted(4 * n for n in muon + plain), boundary
                assert ops == Counter(all_reduce=len(muon) + len(plain)), ops
