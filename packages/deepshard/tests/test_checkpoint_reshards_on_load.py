"""An engine checkpoint loads at another world size and ZeRO stage, with no conversion step.

(W=2, stage 2) saves after 5 steps with small buckets and 96-element inner-optimizer views (the
layout a GPU run's bucket sizes give, against the CPU cap and 1 MiB views of the readers);
(W=1, stage 0) and (W=4, stage 3) load it; the (W=4, stage 3) run saves again at once, and
(W=2, stage 1) loads that. After each load, every rank's `state_shards` are rebuilt in the
parent element by element and must equal, bit for bit, the source checkpoint consolidated by
`deepshard.checkpoint.load_state_dict_from_checkpoint` (fp32 masters, both Adam moments, the
step count): padding removed, nothing lost. Each loaded run then trains 5 more steps, which
match the uninterrupted (W=2, stage 2) run's steps 6-10 within fp32 summation-order noise
(the data loader continues at the same share of the epoch's permutation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.checkpoint import load_state_dict_from_checkpoint
from deepshard.interface import ShardMap
from deepshard.testing import run_on_mesh

# multi-rank and over ~3 s: the main run covers it, the package tox env deselects it
pytestmark = pytest.mark.slow

SIZES = (13, 37, 29, 7)
SAMPLES, GLOBAL_BATCH = 160, 16
SAVE_AT, MORE = 5, 5


def _engine(mesh: Any, stage: int, small_layout: bool, seed: int) -> Any:
    import deepshard.engine as ds

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]),
        torch.nn.Tanh(),
        torch.nn.Linear(SIZES[1], SIZES[2]),
        torch.nn.Tanh(),
        torch.nn.Linear(SIZES[2], SIZES[3]),
    )
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, SIZES[0], generator=gen)
    data = torch.utils.data.TensorDataset(x, 3 * torch.randn(SAMPLES, SIZES[-1], generator=gen))
    zero: dict[str, Any] = {"stage": stage}
    if small_layout:
        zero["reduce_bucket_size"] = 500
    config = {
        "train_batch_size": GLOBAL_BATCH,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": zero,
    }
    engine, _, _, _ = ds.initialize(model, config, training_data=data, mesh=mesh)
    return engine


def _train(engine: Any, batches: Any, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        x, y = next(batches)
        loss = F.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _shards(engine: Any) -> dict[str, tuple[dict[str, Any], torch.Tensor]]:
    return {
        s.key: (s.shard_map.to_json(), s.tensor.detach().clone())
        for s in engine.optimizer.state_shards()
        if s.kind != "param"
    }


def _source(mesh: Any, root: str) -> dict[str, Any]:
    import deepshard.zero._optimizer_check as check

    check.MASTER_VIEW_NUMEL = 96  # this process only: a layout unlike the readers'
    engine = _engine(mesh, stage=2, small_layout=True, seed=0)
    batches = iter(engine.training_dataloader)  # one epoch's iteration, across the save
    first = _train(engine, batches, SAVE_AT)
    engine.save_checkpoint(root)
    return {"first": first, "rest": _train(engine, batches, MORE)}


def _reader(mesh: Any, stage: int, load_from: str, save_to: str | None) -> dict[str, Any]:
    engine = _engine(mesh, stage=stage, small_layout=False, seed=1)
    engine.load_checkpoint(load_from)
    out: dict[str, Any] = {"shards": _shards(engine), "steps": engine.global_steps}
    if save_to is not None:
        engine.save_checkpoint(save_to)
    out["rest"] = _train(engine, iter(engine.training_dataloader), MORE)
    return out


def _rebuild(per_rank: list[dict[str, Any]], key: str) -> torch.Tensor:
    """The full tensor from every rank's local tensor and map, element by element."""
    smap = ShardMap.from_json(next(o["shards"][key][0] for o in per_rank if key in o["shards"]))
    full = torch.full((smap.numel,), float("nan"), dtype=torch.float64)
    for rank, out in enumerate(per_rank):
        if key not in out["shards"]:  # a rank holding none of a parameter names no state of it
            assert not any(p.numel for p in smap.pieces_of(rank)), f"{key}: rank {rank}"
            continue
        local = out["shards"][key][1].reshape(-1)
        for piece in smap.pieces_of(rank):
            for i, index in enumerate(smap.iter_global_flat(piece)):
                full[index] = float(local[piece.local_offset + i])
    assert not full.isnan().any(), f"{key}: elements no rank holds"
    return full.view(smap.global_shape)


def _check_against(per_rank: list[dict[str, Any]], source_dir: Path, what: str) -> None:
    saved = load_state_dict_from_checkpoint(source_dir)
    names = [k.removeprefix("module/") for k in saved if k.startswith("module/")]
    assert len(names) == 6
    for name in names:
        pairs = {"master": f"module/{name}"}
        pairs |= {kind: f"optimizer/{name}/{kind}" for kind in ("exp_avg", "exp_avg_sq")}
        for kind, source_key in pairs.items():
            rebuilt = _rebuild(per_rank, f"{name}/{kind}")
            expected = saved[source_key].double()
            assert torch.equal(rebuilt, expected), f"{what}: {name}/{kind} differs from source"
    for out in per_rank:
        steps = out["shards"]["param_groups.0/step"][1]
        assert int(steps) == SAVE_AT and out["steps"] == SAVE_AT, what


def _mean_losses(per_rank: list[dict[str, Any]]) -> torch.Tensor:
    return torch.tensor([out["rest"] for out in per_rank], dtype=torch.float64).mean(0)


def test_checkpoint_reshards_across_world_sizes_and_stages(tmp_path: Path) -> None:
    first_dir, second_dir = tmp_path / "w2-stage2", tmp_path / "w4-stage3"
    source = run_on_mesh(
        _source, 2, args=(str(first_dir),), store_dir=tmp_path / "s0", timeout_s=200
    )
    reference = _mean_losses(source)
    legs = [
        (1, 0, first_dir, None),
        (4, 3, first_dir, second_dir),
        (2, 1, second_dir, None),
    ]
    for world, stage, load_from, save_to in legs:
        what = f"(W={world}, stage {stage}) from {load_from.name}"
        args = (stage, str(load_from), None if save_to is None else str(save_to))
        store = tmp_path / f"s{world}{stage}"
        per_rank = run_on_mesh(_reader, world, args=args, store_dir=store, timeout_s=240)
        _check_against(per_rank, load_from, what)
        torch.testing.assert_close(
            _mean_losses(per_rank), reference, rtol=1e-5, atol=0.0,
            msg=lambda m, what=what: f"{what}: training after the load: {m}",
        )  # fmt: skip
