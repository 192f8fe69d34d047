"""`GatheredParameters` and `partition(free_data=)` on stage-3 parameters, 2 gloo ranks.

The odd-sized MLP of `_training`, each ``Linear`` a unit, sharded after building (and once
under an open `Init`). Every value a rank expects is computed from the weights of the same
model built whole (``make_model()``), in the same rank body:

* ``modifier_rank=0``: rank 0 doubles ``0.weight`` while rank 1 adds 100 to it; afterwards both
  ranks gather exactly the doubled weight, and one AdamW step from there matches the
  single-process reference started from the doubled weight (the optimizer's masters followed).
  With bf16 parameters the fp32 master of the changed range takes the new values while an
  untouched range keeps the extra precision training gave it.
* ``modifier_rank=None`` discards the change, also for resident (persistent) units.
* Nested blocks: the inner exit leaves what the outer block holds gathered.
* ``partition(free_data=False)`` writes the new values into the partitions and leaves the
  parameter its whole values in storage of its own after the block; ``free_data=True`` frees it.
* ``fwd_module=`` makes the weight gathered during that module's forward.
* Inside an open ``Init`` block, ``GatheredParameters(modifier_rank=0)`` changes a finished
  layer's weights (the way to re-initialise them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from deepshard.interface.errors import ConfigError
from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")


def _sharded(mesh: Any, dtype: torch.dtype = torch.float32, **knobs: Any) -> tuple[Any, Any]:
    from deepshard.zero import ZeroPolicy, shard

    model = _training.make_model(dtype)
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), **knobs)
    return model, shard(model, group=mesh["dp"], policy=policy)


def _weight(sharded: Any, param: torch.Tensor) -> torch.Tensor:
    from deepshard.zero import GatheredParameters

    with GatheredParameters(param):
        return param.detach().clone()


def _step(model: torch.nn.Module, sharded: Any, rank: int) -> list[torch.Tensor]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    inner = torch.optim.AdamW(model.parameters(), lr=_training.LR)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=0.0)
    _modify(model[0].weight, rank)
    x, y = _training.batch(0)
    mb = _training.GLOBAL_BATCH // 2
    zero.backward(F.mse_loss(model(x[rank * mb : (rank + 1) * mb]), y[rank * mb : (rank + 1) * mb]))
    zero.step()
    with sharded.gathered():
        return [p.detach().clone() for p in model.parameters()]


def _modify(weight: torch.Tensor, rank: int) -> None:
    """Rank 0 doubles the weight, rank 1 adds 100; only rank 0's change may survive."""
    from deepshard.zero import GatheredParameters

    with GatheredParameters([weight], modifier_rank=0), torch.no_grad():
        weight.mul_(2.0) if rank == 0 else weight.add_(100.0)


def _masters(mesh: Any, rank: int) -> dict[str, Any]:
    """bf16: step once, change ``0.weight``; its master range follows, ``0.bias``'s (same unit)
    keeps its fp32 values."""
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, shard_info

    model, sharded = _sharded(mesh, torch.bfloat16)
    inner = torch.optim.AdamW(model.parameters(), lr=_training.LR)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=0.0)
    x, y = _training.batch(0)
    zero.backward(F.mse_loss(model(x.bfloat16()).float(), y))
    zero.step()

    def master(param: torch.Tensor) -> torch.Tensor:
        info = shard_info(param)
        lo = info.local_offset
        return zero.master_partitions[info.unit][lo : lo + info.local_numel].clone()

    before = {"changed": master(model[0].weight), "kept": master(model[0].bias)}
    _modify(model[0].weight, rank)
    info = shard_info(model[0].weight)
    doubled = _weight(sharded, model[0].weight).reshape(-1)[info.flat_start : info.flat_stop]
    return {
        "before": before,
        "changed": master(model[0].weight),
        "kept": master(model[0].bias),
        "doubled": doubled.float(),
    }


def _discard_nested_partition(mesh: Any, rank: int) -> dict[str, Any]:
    from deepshard.zero import GatheredParameters, partition

    out: dict[str, Any] = {}
    for name, knobs in (("released", {"param_persistence_threshold": 0}), ("resident", {})):
        model, sharded = _sharded(mesh, **knobs)
        w = model[0].weight
        with GatheredParameters(w), torch.no_grad():
            w.add_(float(rank + 1))
        out[name] = _weight(sharded, w)
    model, sharded = _sharded(mesh, param_persistence_threshold=0, max_reuse_distance=0)
    params = list(model.parameters())
    with GatheredParameters(params):
        with GatheredParameters(params[0]):
            pass
        out["outer_holds"] = (params[0].numel(), sharded.is_gathered(model[0]))
        model(torch.zeros(1, _training.SIZES[0]))  # forwards inside release nothing it holds
        out["after_forward"] = params[0].numel()
    out["after_outer"] = (params[0].numel(), sharded.is_gathered(model[0]))
    w, b = model[0].weight, model[0].bias
    with GatheredParameters([w, b]), torch.no_grad():
        w.mul_(3.0)  # the same change on every rank, kept by partition()
        b.mul_(3.0)
        partition(w, free_data=False)
        partition(b)
    out["kept_data"] = w.detach().clone()
    out["kept_own_storage"] = w.untyped_storage().nbytes() == w.numel() * w.element_size()
    out["freed"] = b.numel()
    out["partitioned"] = (_weight(sharded, w), _weight(sharded, b))
    return out


def _fwd_module(mesh: Any) -> dict[str, int]:
    from deepshard.zero import GatheredParameters

    seen: dict[str, int] = {}
    for registered in (False, True):
        model, _ = _sharded(mesh, param_persistence_threshold=0, max_reuse_distance=0)
        if registered:
            with GatheredParameters(model[0].weight, fwd_module=model[2]):
                pass

        def record(
            module: torch.nn.Module, args: Any, key: str = str(registered), first: Any = model[0]
        ) -> None:
            seen[key] = first.weight.numel()

        model[2].register_forward_pre_hook(record)
        model(torch.zeros(1, _training.SIZES[0]))
    return seen


def _under_init(mesh: Any, rank: int) -> torch.Tensor:
    from deepshard.zero import GatheredParameters, Init, ZeroPolicy, sharded_module_of

    with Init(mesh=mesh, policy=ZeroPolicy(unit_classes=(torch.nn.Linear,))):
        model = _training.make_model()
        with GatheredParameters(model[0].weight, modifier_rank=0), torch.no_grad():
            model[0].weight.fill_(0.5 if rank == 0 else -1.0)
    return _weight(sharded_module_of(model), model[0].weight)


def _rank(mesh: Any) -> dict[str, Any]:
    from deepshard.zero import GatheredParameters, partition, shard_info

    rank = mesh.get_rank()
    model, sharded = _sharded(mesh, param_persistence_threshold=0)
    out = {"stepped": _step(model, sharded, rank), "masters": _masters(mesh, rank)}
    out.update(_discard_nested_partition(mesh, rank))
    out["fwd_module"] = _fwd_module(mesh)
    out["under_init"] = _under_init(mesh, rank)
    errors = {}
    plain = torch.ones(3)
    for name, call in {
        "gathered": lambda: GatheredParameters(plain),
        "gathered_list": lambda: GatheredParameters([model[0].weight, plain]),
        "modifier": lambda: GatheredParameters(model[0].weight, modifier_rank=2),
        "partition": lambda: partition(plain),
        "not_gathered": lambda: partition(model[0].weight),
        "shard_info": lambda: shard_info(plain),
    }.items():
        try:
            call()
            errors[name] = "no error"
        except ConfigError as error:
            errors[name] = str(error)
    GatheredParameters(plain, enabled=False).__enter__()  # disabled: not even checked
    out["errors"] = errors
    return out


@pytest.mark.slow
def test_gathered_parameters_modify_discard_nest_and_partition(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_rank, 2, store_dir=tmp_path)
    init = [p.detach() for p in _training.make_model().parameters()]
    ref = _training.make_model()
    with torch.no_grad():
        ref[0].weight.mul_(2.0)
    opt = torch.optim.AdamW(ref.parameters(), lr=_training.LR)
    x, y = _training.batch(0)
    F.mse_loss(ref(x), y).backward()
    opt.step()
    assert any(r["masters"]["kept"].numel() for r in per_rank)
    for r in per_rank:
        for got, want in zip(r["stepped"], ref.parameters(), strict=True):
            want = want.detach()
            assert float((got - want).norm() / want.norm()) <= 1e-5
        m = r["masters"]
        assert torch.equal(m["changed"], m["doubled"])
        assert not torch.equal(m["changed"], m["before"]["changed"])
        assert torch.equal(m["kept"], m["before"]["kept"])
        if m["kept"].numel():  # the rank holding part of the bias
            assert not torch.equal(m["kept"], m["kept"].bfloat16().float())  # beyond bf16
        assert torch.equal(r["released"], init[0]) and torch.equal(r["resident"], init[0])
        assert r["outer_holds"] == (init[0].numel(), True)
        assert r["after_forward"] == init[0].numel()
        assert r["after_outer"] == (0, False)
        assert torch.equal(r["kept_data"], 3 * init[0]) and r["kept_own_storage"]
        assert r["freed"] == 0
        assert torch.equal(r["partitioned"][0], 3 * init[0])
        assert torch.equal(r["partitioned"][1], 3 * init[1])
        assert r["fwd_module"] == {"False": 0, "True": init[0].numel()}
        assert torch.equal(r["under_init"], torch.full_like(init[0], 0.5))
        errors = r["errors"]
        assert "GatheredParameters(params)" in errors["gathered"]  # the argument is named
        assert "not a ZeRO stage-3" in errors["gathered"]
        assert "not a ZeRO stage-3" in errors["gathered_list"]
        assert "modifier_rank=2" in errors["modifier"]
        assert "partition(params)" in errors["partition"]
        assert "not gathered" in errors["not_gathered"]
        assert "shard_info(param)" in errors["shard_info"]


def test_bad_input_without_a_world() -> None:
    from deepshard.zero import GatheredParameters, Init

    with pytest.raises(ConfigError, match=r"Init\(mesh=None\)"):
        Init()
    with pytest.raises(ConfigError, match="offload_param"):
        Init(remote_device="nvme")
    with pytest.raises(ConfigError, match=r"Init\(remote_device=\)"):
        Init(remote_device="gpu")
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage"):
        Init(config={"zero_optimization": {"stage": 2}})
    nvme = {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}
    with pytest.raises(ConfigError, match=r"Init\(mesh=None\)"):  # NVMe slices are supported
        Init(config={"zero_optimization": nvme})
    with pytest.raises(ConfigError, match="not a ZeRO stage-3"):
        GatheredParameters(torch.nn.Linear(2, 2).weight)
    with Init(enabled=False):  # disabled: a plain model, no world needed
        model = torch.nn.Linear(3, 4)
    assert model.weight.shape == (4, 3)
