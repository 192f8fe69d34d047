"""`deepshard.zero.Init` builds a model partitioned: never whole on a rank, same weights, same
training.

2 gloo ranks, one ``run_on_mesh`` call:

* **Memory.** A 16-layer MLP of 128×128 ``Linear`` layers (1 MiB of fp32 parameters) is built
  under a ``TorchDispatchMode`` that keeps a weak reference to every tensor an op returns; after
  every op it sums the bytes of the distinct live storages (a released buffer has 0 bytes). The
  peak while building under ``Init`` (the exit, where units are formed, included) must stay within
  ``full / W + 3 × largest layer``: the finished layers' slices, plus at most the layer being
  built and the one just finished (a layer is partitioned when the next one registers its first
  parameter), or at exit one unit's gather output, its gathered buffer and its partition. The
  same count over the same build without ``Init`` reaches the full size (the count sees
  everything).
* **Weights.** The odd-sized MLP of `_training` built under ``Init`` (seed 0) gathers to exactly
  the weights of ``make_model()`` without it; ``shard_info(param)`` equals what ``shard`` of the
  model built whole reports (full shape, dtype, slice, shard map); ``dtype=bfloat16`` casts while
  partitioning; ``Init(module=model)`` partitions an existing model.
* **Training.** Three AdamW steps of the Init-built model and of the same model sharded after
  building give identical losses and parameters, and match the single-process reference.
* **No global state left.** torch's global registration-hook tables are as before the block.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WIDTH, DEPTH, STEPS = 128, 16, 3


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the distinct live storages of every tensor an op returned."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.refs.append(weakref.ref(t))
        self.peak = max(self.peak, self.live())
        return out

    def live(self) -> int:
        storages: dict[int, int] = {}
        alive = [t for t in (r() for r in self.refs) if t is not None]
        self.refs = [weakref.ref(t) for t in alive]
        for t in alive:
            storage = t.untyped_storage()
            if storage.nbytes():
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def wide_mlp() -> torch.nn.Sequential:
    torch.manual_seed(1)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])


def _units() -> Any:
    from deepshard.zero import ZeroPolicy

    return ZeroPolicy(unit_classes=(torch.nn.Linear,), param_persistence_threshold=0)


def _hook_tables() -> tuple[int, int]:
    from torch.nn.modules import module

    return (
        len(module._global_module_registration_hooks),
        len(module._global_parameter_registration_hooks),
    )


def _gathered(sharded: Any, model: torch.nn.Module) -> list[torch.Tensor]:
    with sharded.gathered():
        return [p.detach().clone() for p in model.parameters()]


def _train(model: torch.nn.Module, sharded: Any, rank: int, world: int) -> dict[str, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    inner = torch.optim.AdamW(model.parameters(), lr=_training.LR)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=0.0)
    mb = _training.GLOBAL_BATCH // world
    losses = []
    for step in range(STEPS):
        x, y = _training.batch(step)
        loss = F.mse_loss(model(x[rank * mb : (rank + 1) * mb]), y[rank * mb : (rank + 1) * mb])
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    return {"losses": losses, "params": _gathered(sharded, model)}


def _memory(mesh: Any) -> dict[str, int]:
    from deepshard.zero import Init, sharded_module_of

    with LiveBytes() as plain:
        model = wide_mlp()
    del model
    with LiveBytes() as under_init, Init(mesh=mesh, policy=_units()):
        model = wide_mlp()  # alive at exit: sharded there, which the count includes
    assert sharded_module_of(model) is not None
    return {"plain": plain.peak, "init": under_init.peak}


def _rank(mesh: Any) -> dict[str, Any]:
    from deepshard.comm import ParallelDims
    from deepshard.interface import PlacementRegistry
    from deepshard.zero import Init, shard, shard_info, sharded_module_of

    rank, world = mesh.get_rank(), mesh.size()
    tables = _hook_tables()
    out: dict[str, Any] = {"memory": _memory(mesh)}
    with Init(mesh=mesh, policy=_units()) as init:
        model = _training.make_model()
    out["tables"] = (tables, _hook_tables())
    sharded = sharded_module_of(model)
    assert sharded is not None and init.sharded == [sharded]
    out["data_numel"] = [p.numel() for p in model.parameters()]
    out["weights"] = _gathered(sharded, model)
    whole = _training.make_model()
    dims = ParallelDims.from_mesh(mesh)
    placements = PlacementRegistry.replicated(whole.named_parameters(), dims.topology)
    by_shard = shard(whole, parallel_dims=dims, policy=_units(), placements=placements)
    out["infos"] = [shard_info(p) for p in model.parameters()]
    out["shard_infos"] = [shard_info(p) for p in whole.parameters()]
    out["init"] = _train(model, sharded, rank, world)
    out["shard"] = _train(whole, by_shard, rank, world)
    with Init(mesh=mesh, dtype=torch.bfloat16, policy=_units()):
        half = _training.make_model()
    half_sharded = sharded_module_of(half)
    out["bf16"] = _gathered(half_sharded, half)
    out["bf16_partitions"] = {str(u.partition.dtype) for u in half_sharded.units if u.plan.params}
    existing = _training.make_model()
    converted = Init(module=existing, mesh=mesh, policy=_units()).sharded[0]
    out["module_numel"] = [p.numel() for p in existing.parameters()]
    out["module"] = _gathered(converted, existing)
    return out


@pytest.mark.slow
def test_init_builds_partitioned_and_trains_like_shard(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_rank, 2, store_dir=tmp_path)
    world = 2
    ref_model = _training.make_model()
    ref = [p.detach() for p in ref_model.parameters()]
    full = sum(p.numel() * 4 for p in wide_mlp().parameters())
    largest = (WIDTH * WIDTH + WIDTH) * 4
    for r in per_rank:
        memory = r["memory"]
        assert memory["plain"] >= full  # the count sees a whole build
        assert memory["init"] <= full // world + 3 * largest < full, memory
        assert r["tables"][0] == r["tables"][1]
        assert all(n == 0 for n in r["data_numel"])  # partitioned: .data is empty
        for got, want in zip(r["weights"], ref, strict=True):
            assert torch.equal(got, want)
        for got, want in zip(r["bf16"], ref, strict=True):
            assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
        assert r["bf16_partitions"] == {"torch.bfloat16"}
        assert all(n == 0 for n in r["module_numel"])
        for got, want in zip(r["module"], ref, strict=True):
            assert torch.equal(got, want)
        assert r["infos"] == r["shard_infos"]
        assert [i.shape for i in r["infos"]] == [tuple(p.shape) for p in ref]
        assert [i.numel for i in r["infos"]] == [p.numel() for p in ref]
        assert r["init"]["losses"] == r["shard"]["losses"]
        for a, b in zip(r["init"]["params"], r["shard"]["params"], strict=True):
            assert torch.equal(a, b)
    # the ranks' slices cover every element once
    for i, p in enumerate(ref):
        sizes = [r["infos"][i].local_numel for r in per_rank]
        assert sum(sizes) == p.numel()
    # and both match one process on the whole batch
    reference = _reference_losses()
    for step in range(STEPS):
        mean = sum(r["init"]["losses"][step] for r in per_rank) / world
        assert abs(mean - reference[0][step]) <= 1e-5 * abs(reference[0][step])
    for got, want in zip(per_rank[0]["init"]["params"], reference[1], strict=True):
        assert float((got - want).norm() / want.norm()) <= 1e-5


def _reference_losses() -> tuple[list[float], list[torch.Tensor]]:
    model = _training.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=_training.LR)
    losses = []
    for step in range(STEPS):
        x, y = _training.batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]
