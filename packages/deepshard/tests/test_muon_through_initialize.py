"""A config naming Muon trains through ``initialize`` like plain Muon in one process.

Muon is not element-wise, so the engine hands ZeRO a full-gradient transform for Muon's
``use_muon`` matrices (ZeRO reduces their gradients whole and Muon receives the finished
update). The engine takes the parameter names from the model, as DeepSpeed's ``initialize``
tags every parameter of the model with ``use_muon`` (matrix and not embedding/head), so
``model_parameters`` may be plain parameters or param groups, and a group's own ``use_muon``
puts all of its parameters in that half.

One ``run_on_mesh`` call per world size (1 and 2 ranks) trains the MLP for `STEPS` steps at
ZeRO stages 0, 1 and 2 with ``{"type": "Muon"}`` and each form of ``model_parameters`` in
`VARIANTS`. The reference is ``deepshard.optimizers.Muon`` on the whole batch in one process,
given the groups written out by hand in `_reference_groups`: which half each parameter is in
and every setting of that half (config value, then ``muon_lr``/``adam_lr``, then the group's
own), so the reference does not share the engine's routing. Clipping is off, so both sides apply
exactly Muon's update (how ZeRO clips a Muon update is ZeRO's own test). Tolerance: parameters
to 1e-4 relative per tensor (fp32; Newton-Schulz iterations amplify the reduction-order
differences of the gradient a little beyond AdamW's 1e-5).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.optimizers import Muon
from deepshard.testing import import_beside, run_on_mesh

pytestmark = pytest.mark.slow  # the main run covers it; the package env keeps a few lighter ones

_models = import_beside(__file__, "_models.py")
STEPS = 5
STAGES = (0, 1, 2)
MUON = {"muon_lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.1, "momentum": 0.95}
VARIANTS = ("default", "plain", "groups", "flagged")
"""``model_parameters``: none; ``model.parameters()``; two groups with their own lr and weight
decay; groups with ``use_muon`` (the output layer's weight forced to Adam, a weight to Muon)."""

# The halves' settings DeepSpeed resolves from MUON: config value, then muon_lr / adam_lr.
_MUON_HALF = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1, "ns_method": "gram"}
_ADAM_HALF = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.1}


def _model_parameters(model: torch.nn.Module, variant: str) -> Any:
    """What the test passes to ``initialize`` as ``model_parameters``."""
    p = dict(model.named_parameters())  # the MLP's Linear layers are 0, 2 and 4
    if variant == "default":
        return None
    if variant == "plain":
        return model.parameters()
    if variant == "groups":
        return [
            {"params": [p["0.weight"], p["0.bias"]], "lr": 0.01},
            {"params": [p[k] for k in ("2.weight", "2.bias", "4.weight", "4.bias")],
             "weight_decay": 0.0},
        ]  # fmt: skip
    assert variant == "flagged"
    return [
        {"params": [p["0.weight"]], "use_muon": True},
        {"params": [p["4.weight"], p["4.bias"]], "use_muon": False},
        {"params": [p["0.bias"], p["2.weight"], p["2.bias"]]},
    ]


def _reference_groups(model: torch.nn.Module, variant: str) -> list[dict[str, Any]]:
    """Each variant's halves written out: parameters, ``use_muon`` and every setting."""
    p = dict(model.named_parameters())

    def half(names: tuple[str, ...], use_muon: bool, **changes: Any) -> dict[str, Any]:
        settings = dict(_MUON_HALF if use_muon else _ADAM_HALF, **changes)
        return {"params": [p[n] for n in names], "use_muon": use_muon, **settings}

    weights, biases = ("0.weight", "2.weight", "4.weight"), ("0.bias", "2.bias", "4.bias")
    if variant in ("default", "plain"):
        return [half(weights, True), half(biases, False)]
    if variant == "groups":
        return [
            half(("0.weight",), True, lr=0.01),
            half(("0.bias",), False, lr=0.01),
            half(("2.weight", "4.weight"), True, weight_decay=0.0),
            half(("2.bias", "4.bias"), False, weight_decay=0.0),
        ]
    return [
        half(("0.weight",), True),
        half(("4.weight", "4.bias"), False),
        half(("2.weight",), True),
        half(("0.bias", "2.bias"), False),
    ]


def _train(mesh: Any, stage: int, variant: str) -> list[torch.Tensor]:
    import deepshard.engine as ds

    rank, world = mesh.get_rank(), mesh.size()
    model = _models.make_mlp()
    config = _models.engine_config(stage=stage, precision="fp32", ga=1)
    config.update(optimizer={"type": "Muon", "params": MUON}, gradient_clipping=0.0)
    params = _model_parameters(model, variant)
    engine, _, _, _ = ds.initialize(model, config, model_parameters=params, mesh=mesh)
    for step in range(STEPS):
        rows = _models.micro_batch(_models.mlp_batch(step), micro=0, rank=rank, world=world, ga=1)
        engine.backward(_models.mlp_loss(engine, rows, torch.float32))
        engine.step()
    return [p.detach().clone() for p in model.parameters()]


def _all_runs(mesh: Any) -> dict[tuple[int, str], list[torch.Tensor]]:
    return {(s, v): _train(mesh, s, v) for s in STAGES for v in VARIANTS}


def _reference(variant: str) -> list[torch.Tensor]:
    model = _models.make_mlp()
    muon = Muon(_reference_groups(model, variant))
    for step in range(STEPS):
        muon.zero_grad()
        _models.mlp_loss(model, _models.mlp_batch(step), torch.float32).backward()
        muon.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module", params=[1, 2], ids=["1rank", "2ranks"])
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[int, str], list[torch.Tensor]]:
    store = tmp_path_factory.mktemp(f"muon{request.param}")
    ranks = run_on_mesh(_all_runs, request.param, store_dir=store, timeout_s=120)
    for other in ranks[1:]:  # ZeRO all-gathers the parameters: every rank holds the same
        for key, tensors in other.items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, ranks[0][key], strict=True))
    result: dict[tuple[int, str], list[torch.Tensor]] = ranks[0]
    return result


def test_references_differ_where_the_routing_does() -> None:
    """The variants' references are not one run under four names: routing changes the result."""
    plain, flagged, groups = (_reference(v) for v in ("plain", "flagged", "groups"))
    assert torch.equal(plain[0], _reference("default")[0])
    assert not torch.allclose(plain[4], flagged[4], rtol=1e-3)  # 4.weight: Muon vs Adam
    assert not torch.allclose(plain[0], groups[0], rtol=1e-3)  # 0.weight: lr 0.02 vs 0.01


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("stage", STAGES)
def test_muon_config_trains_like_plain_muon(
    results: dict[tuple[int, str], list[torch.Tensor]], stage: int, variant: str
) -> None:
    expected = _reference(variant)
    initial = [p.detach() for p in _models.make_mlp().parameters()]
    for got, want, start in zip(results[stage, variant], expected, initial, strict=True):
        assert not torch.equal(want, start)  # every tensor moved
        error = float((got - want).norm() / want.norm())
        assert error <= 1e-4, f"stage {stage}, {variant}: off by {error:.3g} relative"
