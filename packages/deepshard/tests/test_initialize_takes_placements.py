"""``initialize(placements=...)`` hands the model's placement registry to ZeRO at every stage.

Four gloo ranks on ``dp=2 × ep=2`` train, through ``initialize`` at stages 2 and 3, a model with
a dense input and output layer and one expert per ep rank (``experts.0`` holds expert ``e`` on
ep rank ``e``); the registry marks the experts as reduced over ``dp`` only. The reference is one
process holding both experts: each dense gradient averaged over the 4 ranks, each expert's over
the 2 dp ranks holding it, clipped by the norm of the whole gradient, then Adam. Five steps of
losses, norms and final parameters match, and the engine's comms logger shows collectives over
2 ranks (the experts') beside those over 4. Bad registries are refused before ZeRO touches the
model, on a fake process group (rank 1 of the same mesh).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import deepshard.engine as ds
from deepshard.interface import ParamPlacement, PlacementRegistry, Shard, Topology
from deepshard.interface.errors import ConfigError
from deepshard.testing import fake_mesh, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

D, H, C, EXPERTS, STEPS, LR, CLIP, WORLD, MB = 4, 8, 3, 2, 5, 1e-2, 0.05, 4, 3
TOPOLOGY = Topology(dp=2, ep=2)


class Net(torch.nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(D, H)
        self.experts = torch.nn.ModuleList(torch.nn.Linear(H, H) for _ in range(experts))
        self.out = torch.nn.Linear(H, C)

    def forward(self, x: torch.Tensor, expert: int = 0) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.tanh(self.experts[expert](h)))


def _ep(rank: int) -> int:
    return rank % 2  # row-major dp × ep: rank = dp * 2 + ep


def _full() -> Net:
    torch.manual_seed(0)
    return Net(EXPERTS)


def _local(expert: int) -> Net:
    """Ep rank ``expert``'s model: the dense layers and its own expert as ``experts.0``."""
    state = {
        k.replace(f"experts.{expert}.", "experts.0."): v
        for k, v in _full().state_dict().items()
        if "experts." not in k or f"experts.{expert}." in k
    }
    local = Net(1)
    local.load_state_dict(state)
    return local


def _registry(model: torch.nn.Module, topology: Topology = TOPOLOGY) -> PlacementRegistry:
    registry = PlacementRegistry.replicated([], topology)
    for name, param in model.named_parameters():
        if name.startswith("experts."):  # rows of the stacked experts, reduced over dp only
            shape = (EXPERTS * param.shape[0], *param.shape[1:])
            placement = ParamPlacement.replicated(shape, "float32", reduce_over=("dp",))
            registry.set(name, placement.with_axis("ep", Shard(0)))
        else:
            registry.set(name, ParamPlacement.replicated(tuple(param.shape), "float32"))
    return registry


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(MB, D, generator=g), torch.randn(MB, C, generator=g)


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MB,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "comms_logger": {"enabled": True},
        "steps_per_print": 10**9,
    }


def _train(mesh: Any, stage: int) -> dict[str, Any]:
    rank = mesh.get_rank()
    model = _local(_ep(rank))
    engine, _, _, _ = ds.initialize(
        model,
        _config(stage),
        optimizer=torch.optim.Adam(model.parameters(), lr=LR),
        mesh=mesh,
        placements=_registry(model),
    )
    losses, norms = [], []
    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    worlds = {r.world_size for r in engine.comms_logger.records}
    from deepshard.zero import GatheredParameters

    with GatheredParameters(list(model.parameters()), enabled=stage == 3):
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "worlds": worlds}


def _both(mesh: Any) -> dict[int, dict[str, Any]]:
    return {stage: _train(mesh, stage) for stage in (2, 3)}


def _reference() -> dict[str, Any]:
    model = _full()
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    losses: list[list[float]] = []
    norms = []
    for step in range(STEPS):
        total = torch.zeros(())
        per_rank = []
        for rank in range(WORLD):
            x, y = _batch(step, rank)
            loss = torch.nn.functional.mse_loss(model(x, _ep(rank)), y)
            per_rank.append(loss.item())
            total = total + loss
        total.backward()
        for name, param in model.named_parameters():
            assert param.grad is not None
            param.grad /= WORLD // EXPERTS if name.startswith("experts.") else WORLD
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        inner.step()
        inner.zero_grad()
        losses.append(per_rank)
    return {"losses": losses, "norms": norms, "params": dict(model.named_parameters())}


def test_expert_placements_train_like_one_process(tmp_path: Any) -> None:
    per_rank = run_on_mesh(_both, WORLD, topology=TOPOLOGY, store_dir=tmp_path, timeout_s=120)
    ref = _reference()
    assert min(ref["norms"]) > CLIP  # clipping acts on every step
    for rank, by_stage in enumerate(per_rank):
        for stage, got in by_stage.items():
            assert got["losses"] == pytest.approx([s[rank] for s in ref["losses"]], rel=1e-5)
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5), stage
            for name, value in got["params"].items():
                ref_name = name.replace("experts.0.", f"experts.{_ep(rank)}.")
                torch.testing.assert_close(
                    value, ref["params"][ref_name].detach(), rtol=1e-5, atol=1e-6
                )
            assert got["worlds"] == {2, 4}, stage  # expert collectives over 2 ranks


def _initialize(placements: Any, *, stage: int = 2) -> None:
    with fake_mesh(TOPOLOGY, 1) as mesh:
        model = _local(_ep(1))
        ds.initialize(
            model,
            _config(stage),
            optimizer=torch.optim.Adam(model.parameters(), lr=LR),
            mesh=mesh,
            placements=placements(model) if callable(placements) else placements,
        )


@pytest.mark.parametrize("stage", [2, 3])
def test_a_registry_that_does_not_fit_is_refused_naming_the_parameter(stage: int) -> None:
    def renamed(model: torch.nn.Module) -> PlacementRegistry:
        registry = _registry(model)
        registry.set("expert.weight", registry["experts.0.weight"])  # a typo'd name
        return registry

    with pytest.raises(ConfigError, match=r"placements=\): 'expert.weight' is not a parameter"):
        _initialize(renamed, stage=stage)

    def partial(model: torch.nn.Module) -> PlacementRegistry:
        registry = PlacementRegistry.replicated([], TOPOLOGY)
        registry.set("inp.weight", _registry(model)["inp.weight"])
        return registry

    with pytest.raises(ConfigError, match=r"parameter 'inp.bias' has no placement"):
        _initialize(partial, stage=stage)
    other = Topology(dp=4)
    with pytest.raises(ConfigError, match=r"built for topology .*'dp': 4.* training mesh"):
        _initialize(lambda model: _registry(model, other), stage=stage)
    with pytest.raises(ConfigError, match=r"expected a deepshard\.interface\.PlacementRegistry"):
        _initialize({"inp.weight": None}, stage=stage)
