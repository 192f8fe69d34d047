"""Where offloaded state lives after a step, and that it survives ``state_dict`` round trips.

One 2-rank run (stage 2, fp32 MLP of `_training`, torch AdamW, clipping at 1.0) checks:

* ``device: "cpu"``: the fp32 masters and both Adam moments are host buffers of their own (not
  the model's flat buffer), and after one step the moments are what Adam's first step makes of
  the clipped full-batch gradient, ``m = (1 - beta1) g`` and ``v = (1 - beta2) g^2``, with ``g``
  computed here by one process on the whole batch (torch's ``clip_grad_norm_``) and cut by the
  shard maps; the model's parameters equal the updated masters.
* ``device: "nvme"``: one file per param group and state under the rank's own directory in
  ``nvme_path``, of partition × 4 bytes, whose bytes are those same moments and the masters;
  ``close()`` removes the directory.
* ``state_dict``: saved from a cpu-offload run after 2 steps and loaded into a fresh nvme-offload
  optimizer, 2 more steps give bit for bit the parameters of the run that went on (the same
  kernel on the same values, with the step count restored for the bias correction).

Tolerance of the moment checks: 1e-5 relative; the ranks reduce the gradient in another order
than the one-process backward (a few fp32 ulps).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")

WORLD = 2
BETAS = (0.9, 0.999)


def _zero(group: Any, device: str, root: str) -> tuple[torch.nn.Module, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    offload = {"device": device, **({"nvme_path": root} if device == "nvme" else {})}
    config = ZeroConfig(stage=2, sub_group_size=300, offload_optimizer=offload)
    zero = ZeroOptimizer(
        inner,
        group=group,
        config=config,
        gradient_clipping=_training.CLIP,
        named_parameters=model.named_parameters(),
    )
    return model, zero


def _train(model: torch.nn.Module, zero: Any, rank: int, steps: range) -> list[float]:
    mb = _training.GLOBAL_BATCH // WORLD
    losses = []
    for step in steps:
        x, y = _training.batch(step)
        rows = slice(rank * mb, (rank + 1) * mb)
        loss = _training.loss_fn(model, x[rows], y[rows])
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    return losses


def _pieces(zero: Any, rank: int) -> list[tuple[str, int, int, int, int]]:
    """``(name, group, flat_start, flat_stop, local_offset)`` of this rank's pieces."""
    return [
        (s.name, s.group_index, p.flat_start, p.flat_stop, p.local_offset)
        for s in zero.shard_maps()
        for p in s.shard_map.pieces
        if p.rank == rank
    ]


def _cpu_state(group: Any, rank: int, root: str) -> dict[str, Any]:
    model, zero = _zero(group, "cpu", root)
    _train(model, zero, rank, range(1))
    state = zero._offload.state
    buffers = [(f.buffer.data_ptr(), f.buffer.data_ptr() + f.buffer.nbytes) for f in zero._flat]
    own = all(
        not lo <= t.data_ptr() < hi
        for tensors in state.whole()
        for t in tensors
        for lo, hi in buffers
    )
    params = dict(model.named_parameters())
    written_back = all(
        torch.equal(
            params[name].detach().flatten()[start:stop],
            state.masters[g][local : local + stop - start],
        )
        for name, g, start, stop, local in _pieces(zero, rank)
    )
    return {
        "own_buffers": own,
        "written_back": written_back,
        "masters_are_partitions": all(
            torch.equal(a, b) for a, b in zip(state.masters, zero.master_partitions, strict=True)
        ),
        "exp_avg": [t.clone() for t in state.moments[0]],
        "exp_avg_sq": [t.clone() for t in state.moments[1]],
        "pieces": _pieces(zero, rank),
    }


def _nvme_files(group: Any, rank: int, root: str) -> dict[str, Any]:
    model, zero = _zero(group, "nvme", root)
    _train(model, zero, rank, range(1))
    state = zero._offload.state
    files: dict[str, Any] = {}
    for g, numel in enumerate(m.numel() for m in zero.master_partitions):
        for name in ("master", "exp_avg", "exp_avg_sq"):
            path = state.file(g, name)
            data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.float32)
            files[f"{g}.{name}"] = (path.stat().st_size == 4 * numel, data.clone())
    masters = [m.clone() for m in zero.master_partitions]
    directory = state.swapper.directory
    in_root = directory.parent == Path(root) and directory.is_dir()
    zero.close()
    return {
        "files": files,
        "masters": masters,
        "in_root": in_root,
        "removed": not directory.exists(),
    }


def _round_trip(group: Any, rank: int, root: str) -> dict[str, Any]:
    model_a, zero_a = _zero(group, "cpu", root)
    _train(model_a, zero_a, rank, range(2))
    saved = zero_a.state_dict()
    losses_a = _train(model_a, zero_a, rank, range(2, 4))
    model_b, zero_b = _zero(group, "nvme", root)
    zero_b.load_state_dict(saved)
    losses_b = _train(model_b, zero_b, rank, range(2, 4))
    zero_b.close()
    same = all(
        torch.equal(a, b) for a, b in zip(model_a.parameters(), model_b.parameters(), strict=True)
    )
    return {"same_params": same, "same_losses": losses_a == losses_b}


def _run(mesh: Any, root: str) -> dict[str, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    return {
        "cpu": _cpu_state(group, rank, root),
        "nvme": _nvme_files(group, rank, root),
        "round_trip": _round_trip(group, rank, root),
    }


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("offload_state")
    root = tmp / "nvme"
    root.mkdir()
    return run_on_mesh(_run, WORLD, args=(str(root),), store_dir=tmp, timeout_s=180)


def _first_step_moments() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Adam's moments after one step on the clipped full-batch gradient, per parameter."""
    model = _training.make_model()
    x, y = _training.batch(0)
    _training.loss_fn(model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(list(model.parameters()), _training.CLIP)
    # the kernel forms 1 - beta in fp32 (1 - 0.999 is then 0.99998713e-3, 1.3e-5 below 1e-3)
    one_minus = [1 - torch.tensor(beta, dtype=torch.float32) for beta in BETAS]
    return {
        name: (one_minus[0] * p.grad.flatten(), one_minus[1] * p.grad.flatten() ** 2)
        for name, p in model.named_parameters()
    }


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.slow
def test_cpu_offload_keeps_masters_and_moments_in_host_buffers(per_rank: list[Any]) -> None:
    expected = _first_step_moments()
    for result in (r["cpu"] for r in per_rank):
        assert result["own_buffers"] and result["written_back"]
        assert result["masters_are_partitions"]
        for name, g, start, stop, local in result["pieces"]:
            m, v = expected[name]
            end = local + stop - start
            assert _close(result["exp_avg"][g][local:end], m[start:stop])
            assert _close(result["exp_avg_sq"][g][local:end], v[start:stop])


def test_nvme_offload_keeps_state_in_files_of_the_expected_size(per_rank: list[Any]) -> None:
    expected = _first_step_moments()
    for rank, result in enumerate(per_rank):
        files = result["nvme"]["files"]
        assert result["nvme"]["in_root"] and result["nvme"]["removed"]
        assert all(size_ok for size_ok, _ in files.values())
        for g, master in enumerate(result["nvme"]["masters"]):
            assert torch.equal(files[f"{g}.master"][1], master)
        for name, g, start, stop, local in per_rank[rank]["cpu"]["pieces"]:  # same layout
            m, v = expected[name]
            end = local + stop - start
            assert _close(files[f"{g}.exp_avg"][1][local:end], m[start:stop])
            assert _close(files[f"{g}.exp_avg_sq"][1][local:end], v[start:stop])


def test_offloaded_state_dict_round_trip_continues_bit_for_bit(per_rank: list[Any]) -> None:
    for result in per_rank:
        assert result["round_trip"] == {"same_params": True, "same_losses": True}
