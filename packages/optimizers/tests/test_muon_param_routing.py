"""Which parameters Muon takes, and which settings each of its groups ends up with.

Muon takes parameters whose layer shape has 2+ dimensions and whose name contains neither
"embed" nor "lm_head"; the rest go to the auxiliary Adam (betas (0.9, 0.95), eps 1e-10).
"""

from __future__ import annotations

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.interface.params import ParamShapes
from deepshard.optimizers import Muon


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(20, 8)
        self.proj = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 20, bias=False)


def _half(optimizer: Muon, param: torch.Tensor) -> dict:
    (group,) = [g for g in optimizer.param_groups if any(p is param for p in g["params"])]
    return group


def test_embedding_head_and_vectors_go_to_adam() -> None:
    model = TinyLM()
    optimizer = Muon(model.named_parameters())
    assert _half(optimizer, model.proj.weight)["use_muon"] is True
    for param in (model.embed_tokens.weight, model.lm_head.weight, model.proj.bias,
                  model.norm.weight, model.norm.bias):  # fmt: skip
        group = _half(optimizer, param)
        assert group["use_muon"] is False
        assert group["betas"] == (0.9, 0.95) and group["eps"] == 1e-10
    assert {g["name"] for g in optimizer.param_groups} == {"muon-params", "adam-params"}
    # torch keeps the names of named parameters in the groups (and in state_dict()).
    assert _half(optimizer, model.proj.weight)["param_names"] == ["proj.weight"]


def test_names_can_come_from_a_mapping_and_are_required_for_matrices() -> None:
    model = TinyLM()
    optimizer = Muon(model.parameters(), names=dict(model.named_parameters()))
    assert _half(optimizer, model.proj.weight)["use_muon"] is True
    assert _half(optimizer, model.embed_tokens.weight)["use_muon"] is False
    with pytest.raises(ConfigError, match="named_parameters"):
        Muon(model.parameters())


def test_lr_overrides_and_user_groups_keep_their_values() -> None:
    model = TinyLM()
    decay = [(n, p) for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [(n, p) for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = Muon(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 0.5}],
        lr=0.1, weight_decay=0.01, muon_lr=0.03, adam_lr=0.002, momentum=0.9,
    )  # fmt: skip
    assert _half(optimizer, model.proj.weight)["lr"] == 0.03
    assert _half(optimizer, model.proj.weight)["momentum"] == 0.9
    assert _half(optimizer, model.proj.weight)["weight_decay"] == 0.01
    assert _half(optimizer, model.lm_head.weight)["lr"] == 0.002
    assert _half(optimizer, model.lm_head.weight)["weight_decay"] == 0.01
    assert _half(optimizer, model.norm.weight)["lr"] == 0.5
    assert _half(optimizer, model.norm.weight)["weight_decay"] == 0.0
    assert "momentum" not in _half(optimizer, model.norm.weight)

    # The values are used: with a zero gradient Adam moves nothing, so only decay shows.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    torch.testing.assert_close(model.norm.weight.detach(), before["norm.weight"])
    expected_head = before["lm_head.weight"] * (1 - 0.002 * 0.01)
    torch.testing.assert_close(model.lm_head.weight.detach(), expected_head)


def test_shared_lr_applies_to_both_halves_without_overrides() -> None:
    model = TinyLM()
    optimizer = Muon(model.named_parameters(), lr=0.07)
    assert {g["lr"] for g in optimizer.param_groups} == {0.07}
    defaults = Muon(TinyLM().named_parameters())
    assert {g["name"]: g["lr"] for g in defaults.param_groups} == {
        "muon-params": 0.02, "adam-params": 3e-4,
    }  # fmt: skip


def test_explicit_use_muon_groups_are_taken_as_given() -> None:
    model = TinyLM()
    optimizer = Muon([
        {"params": [model.embed_tokens.weight], "use_muon": True},
        {"params": [model.proj.weight, model.proj.bias], "use_muon": False},
    ])  # fmt: skip
    assert _half(optimizer, model.embed_tokens.weight)["use_muon"] is True
    assert _half(optimizer, model.proj.weight)["use_muon"] is False
    with pytest.raises(ConfigError, match="matrices only"):
        Muon([{"params": [model.proj.bias], "use_muon": True}])


class FlatShapes:
    """Plays the ZeRO-3 side: parameters stored flat, their layer shapes known here."""

    def __init__(self, shapes: dict[int, tuple[int, ...]]) -> None:
        self.shapes = shapes

    def full_shape(self, param: object) -> tuple[int, ...] | None:
        return self.shapes.get(id(param))


def test_param_shapes_decide_for_a_flattened_parameter() -> None:
    flat = torch.nn.Parameter(torch.randn(32))  # a (4, 8) weight stored as a 1-D partition
    shapes = FlatShapes({id(flat): (4, 8)})
    assert isinstance(shapes, ParamShapes)
    assert _half(Muon([("block.weight", flat)]), flat)["use_muon"] is False
    optimizer = Muon([("block.weight", flat)], param_shapes=shapes, lr=0.1, weight_decay=0.5)
    assert _half(optimizer, flat)["use_muon"] is True
    # Its gradient already holds ZeRO's orthogonalized update: Muon applies decay and lr only.
    start = flat.detach().clone()
    flat.grad = torch.randn(32)
    optimizer.step()
    torch.testing.assert_close(flat.detach(), start * (1 - 0.1 * 0.5) - 0.1 * flat.grad)
    assert "momentum_buffer" not in optimizer.state[flat]
