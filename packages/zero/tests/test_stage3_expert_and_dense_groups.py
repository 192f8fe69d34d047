"""Stage 3 with expert and dense parameters in one model: one layout per (unit × group).

Four gloo ranks on a ``dp=2 × ep=2`` mesh train a tiny MoE-like model: a dense input and
output layer in the root unit and two blocks (each a unit, chosen by ``unit_rule``) holding a
dense ``gate`` and an ``experts`` ModuleList of one expert — ep rank ``e`` holds expert ``e``.
The placements, built by hand, mark the experts' parameters as reduced over ``dp`` (and split
over ``ep`` in the global tensor, ``Shard(0)``); everything else is dense (``dp × ep``). So each
block unit mixes both groups and gets two plans on the same module.

The reference is one process holding both experts of every block: each rank's loss is taken
through that rank's expert and summed; the hand-computed gradient averages each dense
parameter over all four ranks (sum / 4) and each expert over the two dp ranks that hold it
(sum / 2). Clipping uses the norm of that whole gradient (every expert counted once), then
Adam. Five steps of losses, reported norms and final parameters must match, and the comms
logger must show the experts' reduce-scatters and all-gathers over 2 ranks, the dense ones
over 4.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh

D, H, C, BLOCKS, EXPERTS, STEPS, LR, CLIP = 4, 8, 3, 2, 2, 5, 1e-2, 0.05
WORLD, MB = 4, 3


class Block(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(H, H)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(experts))

    def forward(self, h: torch.Tensor, expert: int) -> torch.Tensor:
        return h + torch.tanh(self.experts[expert](torch.tanh(self.gate(h))))


class MoE(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, H)
        self.blocks = torch.nn.ModuleList(Block(experts) for _ in range(BLOCKS))
        self.out = torch.nn.Linear(H, C)

    def forward(self, x: torch.Tensor, expert: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h, expert)
        return self.out(h)


def _full_model() -> MoE:
    torch.manual_seed(0)
    return MoE(EXPERTS)


def _local_model(expert: int) -> MoE:
    """The model ep rank ``expert`` holds: the dense layers and its own expert per block."""
    full, local = _full_model(), MoE(1)
    state = {
        k.replace(f"experts.{expert}.", "experts.0."): v
        for k, v in full.state_dict().items()
        if ".experts." not in k or f".experts.{expert}." in k
    }
    local.load_state_dict(state)
    return local


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MB, D, generator=g), torch.randn(MB, C, generator=g)


def _ep(rank: int) -> int:
    return rank % 2  # Topology(dp=2, ep=2) is row-major: rank = dp * 2 + ep


def _placements(model: torch.nn.Module) -> Any:
    from deepshard.interface import ParamPlacement, PlacementRegistry, Shard, Topology

    registry = PlacementRegistry.replicated([], Topology(dp=2, ep=2))
    for name, param in model.named_parameters():
        if ".experts." in name:
            shape = (EXPERTS * param.shape[0], *param.shape[1:])
            placement = ParamPlacement.replicated(shape, "float32", reduce_over=("dp",))
            registry.set(name, placement.with_axis("ep", Shard(0)))
        else:
            registry.set(name, ParamPlacement.replicated(tuple(param.shape), "float32"))
    return registry


def _train_sharded(mesh: Any) -> dict[str, Any]:
    from deepshard.comm import CommsLogger, ParallelDims
    from deepshard.interface.config import CommsLoggerConfig, ZeroConfig
    from deepshard.zero import ZeroOptimizer, ZeroPolicy, shard, shard_info

    dims, rank = ParallelDims.from_mesh(mesh), mesh.get_rank()
    model = _local_model(_ep(rank))
    logger = CommsLogger(CommsLoggerConfig(enabled=True))
    policy = ZeroPolicy(
        unit_rule=lambda name, _: name.startswith("blocks.") and name.count(".") == 1,
        max_reuse_distance=0,
        param_persistence_threshold=0,
    )
    sharded = shard(
        model, parallel_dims=dims, policy=policy, placements=_placements(model), comms_logger=logger
    )
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    zero = ZeroOptimizer(inner, sharded, config=ZeroConfig(stage=3), gradient_clipping=CLIP)
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(model(x), y)
        zero.backward(loss)
        norms.append(zero.step().grad_norm)
        losses.append(loss.item())
    records = [(r.op, r.world_size, r.msg_bytes) for r in logger.records]
    maps = {
        shard.name: [
            (piece.rank, piece.coords, piece.box_offset, piece.flat_start, piece.stop)
            for piece in shard.shard_map.pieces
        ]
        for shard in zero.shard_maps()
    }
    by_name = {shard.name: shard for shard in zero.shard_maps()}
    assert by_name == {name: shard_info(p).shard for name, p in model.named_parameters()}
    plans = [(p.name, p.reduce_over, p.param_names, p.layout.numel) for p in sharded.plans]
    with sharded.gathered():
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert sharded.is_gathered(model.blocks[0])  # both of its plans
    assert not sharded.is_gathered(model.blocks[0])
    return {
        "losses": losses,
        "norms": norms,
        "params": params,
        "records": records,
        "plans": plans,
        "maps": maps,
    }


def _reference() -> dict[str, Any]:
    """Both experts in one process; gradients averaged by hand per group, then clip and Adam."""
    model = _full_model()
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    losses: list[list[float]] = []
    norms = []
    for step in range(STEPS):
        total = torch.zeros(())
        step_losses = []
        for rank in range(WORLD):
            x, y = _batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x, _ep(rank)), y)
            step_losses.append(loss.item())
            total = total + loss
        total.backward()
        for name, param in model.named_parameters():
            assert param.grad is not None
            # Dense: mean over the 4 ranks; expert e: mean over the 2 dp ranks holding it.
            param.grad /= WORLD // EXPERTS if ".experts." in name else WORLD
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        inner.step()
        inner.zero_grad()
        losses.append(step_losses)
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


@pytest.mark.slow
def test_expert_and_dense_groups_match_one_process(tmp_path: Path) -> None:
    from deepshard.interface import Topology

    per_rank = run_on_mesh(
        _train_sharded, WORLD, topology=Topology(dp=2, ep=2), store_dir=tmp_path, timeout_s=50
    )
    ref = _reference()
    assert min(ref["norms"]) > CLIP  # clipping acts on every step
    for rank, got in enumerate(per_rank):
        expert = _ep(rank)
        assert got["losses"] == pytest.approx([s[rank] for s in ref["losses"]], rel=1e-5)
        assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5)
        for name, value in got["params"].items():
            ref_name = name.replace("experts.0.", f"experts.{expert}.")
            torch.testing.assert_close(
                value, ref["params"][ref_name].detach(), rtol=1e-5, atol=1e-6
            )
        # Each block unit is two plans on one module: dense over 4 ranks, experts over 2.
        groups = {(name, axes) for name, axes, _, _ in got["plans"]}
        for b in range(BLOCKS):
            assert {(f"blocks.{b}", ()), (f"blocks.{b}", ("dp",))} <= groups
        expert_plans = [p for p in got["plans"] if p[1] == ("dp",)]
        assert sorted(n for p in expert_plans for n in p[2]) == sorted(
            n for n in got["params"] if ".experts." in n
        )
        _check_traffic(got["records"], got["plans"])
        _check_maps(got["maps"], {n: v.numel() for n, v in got["params"].items()}, rank)


def _check_traffic(records: list[Any], plans: list[Any]) -> None:
    """Expert plans' collectives run over 2 ranks, dense ones over 4, each a whole unit.

    Per step every plan is reduce-scattered once; the expert plans are gathered for forward
    and again for backward unless the recorded order keeps the last block for backward.
    """
    for world, axes in ((2, ("dp",)), (4, ())):
        mine = [numel * 4 for _, a, _, numel in plans if a == axes]
        assert all(numel * 4 >= 4 * (H * H + H) for _, a, _, numel in plans if a == ("dp",))
        scatters = [b for o, w, b in records if o == "reduce_scatter_tensor" and w == world]
        assert sorted(scatters) == sorted(mine * STEPS), (world, scatters)
        gathers = [b for o, w, b in records if o == "all_gather_into_tensor" and w == world]
        assert set(gathers) <= set(mine), (world, gathers)
        if axes:  # each forward gathers every expert plan; backward re-gathers (some)
            assert BLOCKS * STEPS < len(gathers) <= 2 * BLOCKS * STEPS
    assert {w for _, w, _ in records} == {2, 4}


def _check_maps(maps: dict[str, Any], numels: dict[str, int], rank: int) -> None:
    """Each map's pieces name their holders' group ranks and mesh coordinates: experts over
    this rank's dp group (its ep coordinate, its rows of the stacked tensor), dense over all."""
    from deepshard.interface import Topology

    topology = Topology(dp=2, ep=2)
    for name, pieces in maps.items():
        expert = ".experts." in name
        covered = 0
        for group_rank, coords, box_offset, start, stop in pieces:
            holder = group_rank * 2 + _ep(rank) if expert else group_rank
            assert coords == tuple(topology.coords(holder).values()), (name, group_rank)
            assert box_offset[0] == (_ep(rank) * H if expert else 0)
            covered += stop - start
        assert {p[0] for p in pieces} <= set(range(2 if expert else 4))
        assert covered == numels[name], name  # the pieces partition the rank's tensor
