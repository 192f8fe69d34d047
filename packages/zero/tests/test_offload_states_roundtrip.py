"""``offload_states`` → ``reload_states`` mid-training leaves ZeRO 0-2 training bit-identical.

On 2 gloo ranks, for stages 0, 1, 2 in fp32 and bf16 with 2 accumulation steps, one run trains
4 steps plainly and one moves states out and back three times: everything in the middle of an
accumulation cycle (stage 2's partial gradient partitions, stages 0-1's half-filled buffers),
each state type alone between the boundary's backward and the step (when the reduced gradients
exist), and everything again without pinning. The runs' losses and final parameters are equal
bit for bit.

Each single offload is checked against storages found independently of the implementation: the
inner optimizer's state tensors, the master partitions, the parameters' storage, and the
gradient store's buffers (stage 0-1 full buffers, stage 1 partitions, stage 2 accumulators).
Exactly the named type's storages (and whatever shares them: a stage-0 fp32 master *is* the
parameter buffer) drop to 0 bytes, every other keeps its size, and after the reload every tensor
holds its old bytes. Then the refusals: unknown type, device, offload twice, reload without
offload, memory torch does not own, and step / backward / zero_grad / state_dict / safe_get
while offloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

STEPS, GA = 4, 2
TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


def _build(group: Any, stage: int, dtype: torch.dtype) -> tuple[Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model(dtype)
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    config = ZeroConfig(stage=stage, reduce_bucket_size=600, allgather_bucket_size=500)
    zero = ZeroOptimizer(
        inner, group=group, config=config, named_parameters=model.named_parameters()
    )
    return model, zero


def _by_type(model: Any, zero: Any, stage: int) -> dict[str, list[torch.Tensor]]:
    """Every tensor of each state type, found without the implementation's own lists."""
    store = zero._store.ordinary  # no full-gradient groups here: the ordinary store holds all
    state = [t for s in zero.inner.state.values() for t in s.values() if torch.is_tensor(t)]
    grads: dict[str, list[torch.Tensor]] = {"lp_grads": [], "contiguous_grad_buffer": []}
    if stage < 2:
        grads["contiguous_grad_buffer"] = list(store.buffers)
        grads["lp_grads"] = list(store.partitions or []) if stage == 1 else []
    else:
        grads["lp_grads"] = list(store.accumulators)
    return {
        "optim_states": state,
        "hp_params": list(zero.master_partitions),
        "lp_params": list(model.parameters()),
        **grads,
    }


def _check_single(model: Any, zero: Any, stage: int, name: str) -> int:
    """Offload ``name`` alone; exactly its storages empty; reload restores every byte."""
    tensors = _by_type(model, zero, stage)
    everything = [t for ts in tensors.values() for t in ts]
    sizes = [t.untyped_storage().nbytes() for t in everything]
    saved = [t.detach().clone() for t in everything]
    released = {t.untyped_storage().data_ptr() for t in tensors[name] if t.numel()}
    ptrs = [t.untyped_storage().data_ptr() for t in everything]
    report = zero.offload_states(include=[name])
    assert report.states == (name,) and report.device_bytes_freed is None  # CPU: no stats
    for t, size, ptr in zip(everything, sizes, ptrs, strict=True):
        assert t.untyped_storage().nbytes() == (0 if ptr in released else size), name
    assert zero.offloaded_states == (name,)
    assert report.nbytes == sum(
        size for size, ptr in set(zip(sizes, ptrs, strict=True)) if ptr in released
    )
    zero.reload_states()
    after = [t for ts in _by_type(model, zero, stage).values() for t in ts]
    assert len(after) == len(saved)
    for t, old in zip(after, saved, strict=True):
        assert torch.equal(t, old), name
    return len(released)


def _train(group: Any, rank: int, stage: int, dtype: torch.dtype, offload: bool) -> dict[str, Any]:
    model, zero = _build(group, stage, dtype)
    world = group.size()
    mb = _training.GLOBAL_BATCH // (world * GA)
    losses, released = [], {}
    for step in range(STEPS):
        x, y = _training.batch(step)
        for m in range(GA):
            rows = slice((m * world + rank) * mb, (m * world + rank + 1) * mb)
            loss = _training.loss_fn(model, x[rows], y[rows]) / GA
            zero.backward(loss, is_boundary=m == GA - 1)
            losses.append(loss.item())
            if offload and step == 1 and m == 0:  # mid-cycle: partial gradients
                assert zero.offload_states().states == TYPES
                zero.reload_states()
            if offload and step == 2 and m == GA - 1:  # reduced gradients exist
                released = {name: _check_single(model, zero, stage, name) for name in TYPES}
                zero.offload_states(pin_memory=False, non_blocking=True)
                zero.reload_states(non_blocking=True)
        zero.step()
    params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "released": released}


def _refusals(group: Any, rank: int) -> dict[str, str]:
    from deepshard.interface.errors import CommError, ConfigError
    from deepshard.zero import safe_get_full_fp32_param

    model, zero = _build(group, 2, torch.float32)
    x, y = _training.batch(0)
    zero.backward(_training.loss_fn(model, x[:4], y[:4]))
    zero.step()
    refused: dict[str, str] = {}

    def expect(what: str, error: type[Exception], call: Any) -> None:
        try:
            call()
        except error as exc:
            refused[what] = str(exc)

    expect("unknown", ConfigError, lambda: zero.offload_states(include=["optim_state", "lp"]))
    expect("device", ConfigError, lambda: zero.offload_states(device="nvme"))
    expect("reload", CommError, zero.reload_states)
    state = next(iter(zero.inner.state.values()))
    state["foreign"] = torch.frombuffer(bytearray(16), dtype=torch.float32)  # not torch-owned
    expect("foreign", CommError, zero.offload_states)
    refused["after_foreign"] = str(zero.offloaded_states)
    del state["foreign"]
    zero.offload_states(include="lp_grads")
    expect("twice", CommError, lambda: zero.offload_states(include=["optim_states", "lp_grads"]))
    loss = _training.loss_fn(model, x[:4], y[:4])  # lp_params stay: the forward runs
    expect("backward", CommError, loss.backward)
    expect("step", CommError, zero.step)
    expect("zero_grad", CommError, zero.zero_grad)
    expect("state_dict", CommError, zero.state_dict)
    expect("safe_get", CommError, lambda: safe_get_full_fp32_param(model[0].weight, zero))
    zero.offload_states(include=["lp_params"])
    refused["empty_params"] = str([p.numel() for p in model.parameters()])
    expect("forward", RuntimeError, lambda: model(x[:4]))
    zero.reload_states()
    zero.backward(_training.loss_fn(model, x[:4], y[:4]))  # training works again
    zero.step()
    return refused


def _all(mesh: Any) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    runs = {
        (stage, dtype, offload): _train(group, rank, stage, dtype, offload)
        for stage in (0, 1, 2)
        for dtype in (torch.float32, torch.bfloat16)
        for offload in (False, True)
    }
    return {"runs": runs, "refused": _refusals(group, rank)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    store = tmp_path_factory.mktemp("store")
    return run_on_mesh(_all, 2, store_dir=Path(store), timeout_s=180)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_offload_and_reload_leave_training_bit_identical(
    results: list[dict[str, Any]], stage: int, dtype: torch.dtype
) -> None:
    for rank_results in results:
        plain = rank_results["runs"][(stage, dtype, False)]
        moved = rank_results["runs"][(stage, dtype, True)]
        assert moved["losses"] == plain["losses"]
        for a, b in zip(moved["params"], plain["params"], strict=True):
            assert torch.equal(a, b)
        released = moved["released"]
        assert released["optim_states"] > 0 and released["hp_params"] > 0
        assert released["lp_params"] > 0
        # stage 0 keeps its reduced gradients in the contiguous buffer, stage 2 has none
        assert (released["lp_grads"] > 0) == (stage > 0)
        assert (released["contiguous_grad_buffer"] > 0) == (stage < 2)
    assert not torch.equal(
        results[0]["runs"][(stage, dtype, False)]["params"][0],
        _training.make_model(dtype).state_dict()["0.weight"],
    )


def test_offload_refusals(results: list[dict[str, Any]]) -> None:
    for rank_results in results:
        refused = rank_results["refused"]
        assert "['lp', 'optim_state']" in refused["unknown"]
        assert "'contiguous_grad_buffer'" in refused["unknown"]  # the valid names are listed
        assert "device='nvme'" in refused["device"] and "'cpu'" in refused["device"]
        assert "no state is offloaded" in refused["reload"]
        assert "not owned by torch" in refused["foreign"] and refused["after_foreign"] == "()"
        assert "['lp_grads'] are already offloaded" in refused["twice"]
        for what in ("backward", "step", "zero_grad", "state_dict", "safe_get"):
            assert "call reload_states() first" in refused[what], what
        assert refused["empty_params"] == str([0] * 6)
        assert "forward" in refused
