"""Muon with ``offload_optimizer: cpu`` at ZeRO stage 3 trains like Muon without offload.

Newton–Schulz needs a matrix's whole reduced gradient, so it stays on the device: at the step
each unit holding a ``use_muon`` matrix all-gathers its gradient partitions and the transform
writes each rank's piece of the update into its gradient partition, as without offload
(`deepshard.zero._stage3_muon`). Only then does the host step run: the gradients (Muon updates
for the matrices, raw gradients for the biases) are copied to the host per sub-group and Muon
itself steps the fp32 host masters (the learning rate and decoupled weight decay for its
``use_muon`` views, its auxiliary Adam for the biases, state in host memory).

One 2-rank run on the odd-sized MLP (`_muon_training`: matrices to Muon, biases to the auxiliary
Adam, clipping that triggers at every step), each ``Linear`` a unit, ``sub_group_size`` 100 (so
each unit's master is stepped in several sub-groups): stage 3 without offload, with optimizer
offload, and with optimizer offload plus NVMe parameter offload over 2 micro-steps. Every run
must match the single-process Muon reference (`_muon_training.reference`, 1e-5 relative, as
`test_stage3_safe_get_muon_frozen`), and the offloaded run at one micro-step the run without
offload (the same Muon arithmetic on other tensors: 1e-6). Where things live, from the tensors
themselves: no fp32 master on the device, every tensor the inner Muon steps is a view of a host
master partition (none of a unit partition), its auxiliary Adam state exists for every bias
view and no ``use_muon`` view has state of its own, and Muon's momentum is kept per matrix
the rank holds a piece of, as without offload.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_muon = import_beside(__file__, "_muon_training.py")

WORLD = 2
EAGER = {"max_reuse_distance": 0, "param_persistence_threshold": 0}
RUNS = [("none", "none", 1), ("cpu", "none", 1), ("cpu", "nvme", 2)]  # (optimizer, param, ga)


def _build(group: Any, run: tuple[str, str, int], root: str) -> tuple[Any, Any, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard

    opt, par, _ = run
    nvme = {"device": "nvme", "nvme_path": root, "buffer_count": 2, "buffer_size": 2000}
    config = ZeroConfig(
        stage=3,
        sub_group_size=100,
        offload_optimizer={"device": "cpu"} if opt == "cpu" else None,
        offload_param=nvme if par == "nvme" else None,
    )
    model = _training.make_model()
    muon = _muon.make_muon(model)  # built on the whole parameters: its halves see real shapes
    offload = ZeroPolicy.from_config(config).param_offload
    policy = ZeroPolicy(unit_classes=(torch.nn.Linear,), param_offload=offload, **EAGER)
    sharded = shard(model, group=group, policy=policy)
    zero = ZeroOptimizer(muon, sharded, config=config, gradient_clipping=_muon.CLIP,
                         full_grad_transform=_muon.muon_transform,
                         transformed_params=_muon.muon_params(muon))  # fmt: skip
    return model, sharded, zero


def _where(sharded: Any, zero: Any) -> dict[str, Any]:
    masters = {m.untyped_storage().data_ptr() for m in zero.master_partitions}
    units = {u.partition.untyped_storage().data_ptr() for u in sharded.units if u.plan.params}
    stepped = [p for g in zero.inner.param_groups for p in g["params"]]
    with_state = {g["use_muon"]: [bool(zero.inner.state.get(p)) for p in g["params"]]
                  for g in zero.inner.param_groups}  # fmt: skip
    return {
        "master_bytes": zero.master_bytes(),
        "on_host_masters": all(p.untyped_storage().data_ptr() in masters for p in stepped),
        "on_partitions": any(p.untyped_storage().data_ptr() in units for p in stepped),
        "stepped": len(stepped),
        "with_state": with_state,
        "buffers": sorted(zero.state_dict()["full_grad_buffers"]),
    }


def _train(mesh: Any, root: str) -> dict[Any, Any]:
    group, rank = mesh["dp"].get_group(), mesh.get_rank()
    out: dict[Any, Any] = {}
    for run in RUNS:
        model, sharded, zero = _build(group, run, root)
        ga, norms = run[2], []
        for step in range(_muon.STEPS):
            for micro in range(ga):
                x, y = _muon.micro_batch(step, rank, WORLD, ga, micro)
                zero.backward(_training.loss_fn(model, x, y) / ga, is_boundary=micro == ga - 1)
            norms.append(zero.step().grad_norm)
        with sharded.gathered():
            params = [p.detach().clone() for p in model.parameters()]
        out[run] = {"norms": norms, "params": params, "where": _where(sharded, zero)}
        zero.close()
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_muon_with_cpu_optimizer_offload_matches_reference_and_device(tmp_path: Path) -> None:
    root = tmp_path / "nvme"
    root.mkdir()
    per_rank = run_on_mesh(_train, WORLD, args=(str(root),), store_dir=tmp_path, timeout_s=240)
    ref = _muon.reference()
    assert min(ref["norms"]) > _muon.CLIP  # clipping is exercised at every step
    plain = per_rank[0][RUNS[0]]
    for run in RUNS:
        got = per_rank[0][run]
        for a, b in zip(per_rank[1][run]["params"], got["params"], strict=True):
            assert torch.equal(a, b), run  # the ranks agree
        assert _rel(torch.tensor(got["norms"]), torch.tensor(ref["norms"])) < 1e-5, run
        for p, r in zip(got["params"], ref["params"], strict=True):
            assert _rel(p, r) < 1e-5, run
        if run[2] == 1:
            torch.testing.assert_close(got["norms"], plain["norms"], rtol=1e-6, atol=0)
            for p, q in zip(got["params"], plain["params"], strict=True):
                torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    for rank_results in per_rank:
        for run in RUNS[1:]:
            where = rank_results[run]["where"]
            assert where["master_bytes"] == 0, run  # no fp32 master on the device
            assert where["stepped"] > 0 and where["on_host_masters"], run
            assert not where["on_partitions"], run
            assert all(where["with_state"][False]), run  # auxiliary Adam's state, on the host
            assert not any(where["with_state"][True]), run  # the update came from ZeRO
            assert where["buffers"] == rank_results[RUNS[0]]["where"]["buffers"], run
        assert rank_results[RUNS[0]]["where"]["buffers"] == ["0.weight", "2.weight", "4.weight"]
    for run in RUNS[1:]:  # some rank holds bias elements (a unit's bias ends its layout)
        assert any(r[run]["where"]["with_state"][False] for r in per_rank), run
