"""`state_shards()` describes every element of every master and Adam moment exactly once, and
equals a single-process AdamW's state; `load_state_shards` puts them back into a fresh run.

One 2-rank run trains the odd-sized MLP (`_training`: parameters straddle the rank boundary)
for 2 steps under ZeRO stages 0-3 with small buckets and inner-optimizer views of 96 elements
(so pieces straddle views), with optimizer offload to the host (the CPU Adam kernel's own
moments) and to files. The parent rebuilds each full tensor from both ranks' local tensors and
shard maps, by element, without the implementation's bookkeeping: every element is held once
(stage 0: by both ranks, equal), no rank holds padding, and the values equal the reference's
parameters and AdamW state. Then a model built from other weights gets the state loaded
(`materialize_state` first: it has none yet) and both take a third step: their state is equal
bit for bit, so the masters, moments, step counts and the model copy were all restored
(offloaded state written back to the host buffers and files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepshard.interface import ShardMap
from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD = 2
STEPS = 2
VIEW = 96
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0, "prefetch_bucket_size": 600}
# name: (stage, offload_optimizer device)
RUNS = {
    "stage0": (0, "none"),
    "stage2": (2, "none"),
    "stage2-cpu": (2, "cpu"),
    "stage1-nvme": (1, "nvme"),
    "stage3": (3, "none"),
    "stage3-cpu": (3, "cpu"),
}


def _build(group: Any, run: str, seed: int, root: str) -> tuple[Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    stage, device = RUNS[run]
    offload = None if device == "none" else {"device": device, "nvme_path": root}
    config = ZeroConfig(
        stage=stage, reduce_bucket_size=500, sub_group_size=300, offload_optimizer=offload
    )
    model = _training.make_model(torch.float32, seed=seed)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    if stage == 3:
        policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), **EAGER)
        sharded = shard(model, group=group, policy=policy)
        return model, ZeroOptimizer(inner, sharded, config=config, gradient_clipping=_training.CLIP)
    named = list(model.named_parameters())
    zero = ZeroOptimizer(
        inner, group=group, config=config, gradient_clipping=_training.CLIP, named_parameters=named
    )
    return model, zero


def _step(model: Any, zero: Any, rank: int, step: int) -> float:
    mb = _training.GLOBAL_BATCH // WORLD
    x, y = _training.batch(step)
    loss = _training.loss_fn(model, x[rank * mb : (rank + 1) * mb], y[rank * mb : (rank + 1) * mb])
    zero.backward(loss)
    zero.step()
    return loss.item()


def _run(mesh: Any, root: str) -> dict[str, Any]:
    import deepshard.zero._optimizer_check as check

    check.MASTER_VIEW_NUMEL = VIEW  # this process only: pieces straddle the inner views
    group, rank = mesh["dp"], mesh.get_rank()
    out: dict[str, Any] = {}
    for run in RUNS:
        model, zero = _build(group, run, seed=0, root=root)
        for step in range(STEPS):
            _step(model, zero, rank, step)
        shards = zero.state_shards()
        out[run] = {s.key: (s.shard_map.to_json(), s.tensor.detach().clone()) for s in shards}
        views = {s.key: s.tensor for s in shards if s.kind == "master"}
        out[run + "/live"] = all(
            any(t.untyped_storage().data_ptr() == m.untyped_storage().data_ptr()
                for m in zero.master_partitions)
            for t in views.values() if t.numel()
        )  # fmt: skip
        values = {s.key: s.tensor.detach().clone() for s in shards}
        other, fresh = _build(group, run, seed=1, root=root)
        fresh.materialize_state()
        fresh.load_state_shards(values)
        losses = (_step(model, zero, rank, STEPS), _step(other, fresh, rank, STEPS))
        after = [{s.key: s.tensor.clone() for s in z.state_shards()} for z in (zero, fresh)]
        out[run + "/resumed"] = losses[0] == losses[1] and all(
            torch.equal(after[0][k], after[1][k]) for k in after[0]
        )
        zero.close()
        fresh.close()
    return out


def _reference() -> dict[str, torch.Tensor]:
    """One process, the whole batch: AdamW with clipping, as `_training.reference`, its state."""
    model = _training.make_model(torch.float32)
    params = list(model.parameters())
    inner = torch.optim.AdamW(_training.param_groups(params), lr=_training.LR)
    for step in range(STEPS):
        x, y = _training.batch(step)
        model.zero_grad()
        _training.loss_fn(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, _training.CLIP)
        inner.step()
    out = {}
    for name, param in model.named_parameters():
        out[f"{name}/master"] = param.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}/{key}"] = inner.state[param][key].clone()
    return out


def _rebuild(
    per_rank: list[tuple[dict[str, Any], torch.Tensor] | None], replicated: bool
) -> list[float]:
    """The full tensor from each rank's local tensor, element by element; checks coverage.

    A rank without the entry (``None``) must hold no piece of it (it cannot know the state
    keys of a parameter it holds nothing of)."""
    maps = [ShardMap.from_json(entry[0]) for entry in per_rank if entry is not None]
    smap = maps[0]
    assert all(m == smap for m in maps), "ranks disagree on the map"
    assert smap.missing_elements() == 0
    full: list[float | None] = [None] * smap.numel
    for rank, entry in enumerate(per_rank):
        pieces = smap.pieces_of(rank)
        if entry is None:
            assert not any(p.numel for p in pieces), f"rank {rank} holds a piece but no entry"
            continue
        _, local = entry
        assert local.numel() == sum(p.numel for p in pieces), "padding or a missing element"
        values = local.reshape(-1).tolist()
        for piece in pieces:
            for i, index in enumerate(smap.iter_global_flat(piece)):
                value = values[piece.local_offset + i]
                if full[index] is not None:
                    assert replicated and full[index] == value, f"element {index} held twice"
                full[index] = value
    assert all(v is not None for v in full)
    return [float(v) for v in full if v is not None]


def test_state_shards_cover_match_adam_and_reload(tmp_path: Path) -> None:
    swap = tmp_path / "swap"
    swap.mkdir()
    per_rank = run_on_mesh(_run, WORLD, args=(str(swap),), store_dir=tmp_path, timeout_s=280)
    reference = _reference()
    for run, (stage, _) in RUNS.items():
        entries = {**per_rank[1][run], **per_rank[0][run]}
        for key, expected in reference.items():
            full = _rebuild([out[run].get(key) for out in per_rank], replicated=stage == 0)
            torch.testing.assert_close(
                torch.tensor(full).view(expected.shape), expected, rtol=1e-4, atol=1e-6,
                msg=lambda m, run=run, key=key: f"{run} {key}: {m}",
            )  # fmt: skip
        steps = sorted(key for key in entries if key.endswith("/step"))
        assert steps == ["param_groups.0/step", "param_groups.1/step"], run
        assert all(out[run][k][1].item() == STEPS for out in per_rank for k in steps)
        assert all(set(steps) <= set(out[run]) for out in per_rank), "every rank has the steps"
        kinds = {key.rsplit("/", 1)[1] for key in entries}
        assert kinds == {"param", "master", "exp_avg", "exp_avg_sq", "step"}, run
        assert all(out[run + "/resumed"] for out in per_rank), f"{run} did not resume exactly"
        if RUNS[run][1] != "nvme":
            assert all(out[run + "/live"] for out in per_rank), f"{run}: masters not live views"
