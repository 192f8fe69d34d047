"""``offload_states`` → ``reload_states`` at ZeRO stage 3 leaves training bit-identical; bad input.

On 2 gloo ranks, fp32 and bf16 (bf16 keeps separate fp32 masters, fp32 partitions are their own
masters) and once with ``offload_param: cpu``, one run trains 4 steps plainly and one moves
states out and back: everything after step 1, each state type alone between the boundary's
backward and the step (when the gradient partitions exist), everything unpinned after step 3.
Losses and final parameters are equal bit for bit.

Each offload is checked against tensors found without the implementation's lists: the inner
optimizer's state, ``master_partitions``, the units' partitions and gradient partitions. The
named type's storages (and what shares them) drop to 0 bytes, the others keep theirs, every
gathered unit is released, and after the reload every tensor holds its old bytes. While
offloaded, a forward, a backward, ``step`` and ``zero_grad`` are refused.

Bad input, without processes: ``offload_param`` below stage 3, nvme without ``nvme_path``, a
partition larger than ``offload_param.buffer_size``, partial optimizer offload at stage 3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD, STEPS = 2, 4
TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads")
CASES = [(torch.float32, "none"), (torch.bfloat16, "none"), (torch.bfloat16, "cpu")]


def _build(group: Any, dtype: torch.dtype, param_offload: str) -> tuple[Any, Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard
    from deepshard.zero._param_offload import ParamOffload

    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    offload = ParamOffload("cpu") if param_offload == "cpu" else None
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=offload)
    sharded = shard(model, group=group, policy=policy)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3))
    return model, sharded, zero


def _by_type(sharded: Any, zero: Any) -> dict[str, list[torch.Tensor]]:
    state = [t for s in zero.inner.state.values() for t in s.values() if torch.is_tensor(t)]
    found = {
        "optim_states": state,
        "hp_params": list(zero.master_partitions),
        "lp_params": [u.partition for u in sharded.units],
        "lp_grads": [u.grad_partition for u in sharded.units if u.grad_partition is not None],
    }  # the root owns no parameter: its empty tensors hold no bytes to move
    return {name: [t for t in ts if t.numel()] for name, ts in found.items()}


def _refusals(model: Any, zero: Any, x: torch.Tensor, y: torch.Tensor) -> list[str]:
    """Names of the calls refused (CommError) while everything is offloaded."""
    from deepshard.interface.errors import CommError

    refused = []
    calls = {
        "forward": lambda: _training.loss_fn(model, x, y),
        "step": zero.step,
        "zero_grad": zero.zero_grad,
        "state_dict": zero.state_dict,
    }
    for name, call in calls.items():
        try:
            call()
        except CommError as error:
            assert "reload_states()" in str(error)
            refused.append(name)
    return refused


def _round_trip(sharded: Any, zero: Any, names: tuple[str, ...], pin: bool) -> dict[str, Any]:
    """Offload ``names``, check storages and released units, reload, check bytes."""
    tensors = _by_type(sharded, zero)
    before = {id(t): t.clone() for ts in tensors.values() for t in ts}
    report = zero.offload_states(include=list(names), pin_memory=pin)
    facts: dict[str, Any] = {"states": report.states, "nbytes": report.nbytes}
    facts["released_units"] = not any(u.gathered or u.in_flight for u in sharded.units)
    facts["empty"] = {
        n: [t.untyped_storage().nbytes() == 0 for t in ts] for n, ts in tensors.items()
    }
    zero.reload_states()
    facts["restored"] = all(torch.equal(t, before[id(t)]) for ts in tensors.values() for t in ts)
    return facts


def _train(mesh: Any, dtype: torch.dtype, par: str, offload: bool) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    model, sharded, zero = _build(group, dtype, par)
    mb = _training.GLOBAL_BATCH // WORLD
    losses, checks, refused = [], [], []
    for step in range(STEPS):
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        loss = _training.loss_fn(model, x[rows], y[rows])
        zero.backward(loss)
        if offload and step == 1:
            checks += [(name, _round_trip(sharded, zero, (name,), True)) for name in TYPES]
        zero.step()
        losses.append(loss.item())
        if offload and step == 0:
            checks.append(("all", _round_trip(sharded, zero, TYPES, True)))
            zero.offload_states()
            refused = _refusals(model, zero, x[rows], y[rows])
            zero.reload_states()
        if offload and step == 2:
            checks.append(("unpinned", _round_trip(sharded, zero, TYPES, False)))
    with sharded.gathered():
        params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "checks": checks, "refused": refused}


def _both(mesh: Any) -> dict[Any, Any]:
    return {
        (dtype, par, offload): _train(mesh, dtype, par, offload)
        for dtype, par in CASES
        for offload in (False, True)
    }


def test_offload_states_round_trip_keeps_stage3_training_bit_identical(tmp_path: Path) -> None:
    per_rank = run_on_mesh(_both, WORLD, store_dir=tmp_path, timeout_s=180)
    for dtype, par in CASES:
        for results in per_rank:
            plain, moved = results[(dtype, par, False)], results[(dtype, par, True)]
            assert moved["losses"] == plain["losses"], (dtype, par)
            for a, b in zip(moved["params"], plain["params"], strict=True):
                assert torch.equal(a, b), (dtype, par)
            assert moved["refused"] == ["forward", "step", "zero_grad", "state_dict"]
            for name, facts in moved["checks"]:
                names = TYPES if name in ("all", "unpinned") else (name,)
                assert facts["states"] == names
                assert facts["nbytes"] > 0 and facts["released_units"] and facts["restored"]
                for kind, empty in facts["empty"].items():
                    # an fp32 partition is its own master: offloading one empties the other
                    shares = dtype == torch.float32 and {kind, *names} >= {"hp_params", "lp_params"}
                    if kind in names or shares:
                        assert all(empty), (dtype, par, name, kind)
                    else:
                        assert not any(empty), (dtype, par, name, kind)


def test_bad_input_names_the_key_and_the_fix(tmp_path: Path) -> None:
    from deepshard.interface.config import DeepShardConfig, ZeroConfig
    from deepshard.interface.errors import ConfigError
    from deepshard.zero import zero_problems
    from deepshard.zero._param_offload import ParamOffload, build_homes

    with pytest.warns(UserWarning, match="offload_param has no effect at stage 2"):
        stage2 = DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}
        )
    assert stage2.zero_optimization.offload_param is None  # ignored, as DeepSpeed does
    with pytest.raises(ConfigError) as caught:
        DeepShardConfig.from_dict(
            {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}
        )
    assert "zero_optimization.offload_param.nvme_path" in str(caught.value)
    offload = ParamOffload("nvme", nvme_path=tmp_path, buffer_size=10)
    with pytest.raises(ConfigError) as caught:
        build_homes(offload, [4, 25], torch.device("cpu"))
    assert "zero_optimization.offload_param.buffer_size" in str(caught.value)
    assert "at least 25" in str(caught.value)
    missing = ParamOffload("nvme", nvme_path=tmp_path / "absent")
    with pytest.raises(ConfigError) as caught:
        build_homes(missing, [4], torch.device("cpu"))
    assert "zero_optimization.offload_param.nvme_path" in str(caught.value)
    partial = ZeroConfig(stage=3, offload_optimizer={"device": "cpu", "ratio": 0.5})
    assert zero_problems(partial, gradient_clipping=1.0) == []  # stage 3, cpu: supported
    nvme = {"device": "nvme", "ratio": 0.5, "nvme_path": str(tmp_path)}
    nvme_config = ZeroConfig(stage=3, offload_optimizer=nvme)
    keys = [k for k, _ in zero_problems(nvme_config, gradient_clipping=1.0)]
    assert keys == ["zero_optimization.offload_optimizer.ratio"]  # the host share is CPU Adam's
    with pytest.raises(ConfigError, match=r"offload_optimizer\.ratio"):  # the schema's rule
        ZeroConfig(stage=2, offload_optimizer={"device": "cpu", "ratio": 0.5})
    whole = ZeroConfig(stage=3, offload_optimizer={"device": "cpu"})
    assert zero_problems(whole, gradient_clipping=1.0) == []
