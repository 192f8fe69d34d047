"""build_optimizer turns the `optimizer` section into the right optimizer, or names the key."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.interface.config import OptimizerConfig
from deepshard.interface.errors import ConfigError
from deepshard.optimizers import Adam, AdamW, Lion, Muon, build_optimizer


def _config(type_name: str, **params: Any) -> OptimizerConfig:
    return OptimizerConfig.model_validate({"type": type_name, "params": params})


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def _problem_keys(error: pytest.ExceptionInfo[ConfigError]) -> list[str]:
    return [path for path, _ in error.value.problems]


@pytest.mark.parametrize("spelling", ["Adam", "adam", "ADAM"])
def test_adam_defaults_to_decoupled_decay_like_deepspeed(spelling: str) -> None:
    optimizer = build_optimizer(_config(spelling, lr=1e-3, betas=[0.8, 0.9]), _model().parameters())
    assert type(optimizer) is Adam
    assert optimizer.param_groups[0]["adam_w_mode"] is True
    assert optimizer.param_groups[0]["betas"] == (0.8, 0.9)


def test_adam_w_mode_false_gives_l2_adam_and_adamw_refuses_it() -> None:
    model = _model()
    optimizer = build_optimizer(_config("Adam", adam_w_mode=False), model.parameters())
    assert optimizer.param_groups[0]["adam_w_mode"] is False
    assert type(build_optimizer(_config("AdamW", weight_decay=0.1), model.parameters())) is AdamW
    with pytest.raises(ConfigError) as error:
        build_optimizer(_config("AdamW", adam_w_mode=False), model.parameters())
    assert _problem_keys(error) == ["optimizer.params.adam_w_mode"]


def test_torch_adam_builds_torch_optimizers() -> None:
    model = _model()
    adamw = build_optimizer(_config("AdamW", torch_adam=True, foreach=False), model.parameters())
    assert type(adamw) is torch.optim.AdamW
    adam = build_optimizer(_config("Adam", torch_adam=True, adam_w_mode=False), model.parameters())
    assert type(adam) is torch.optim.Adam


def test_lion_muon_and_torch_names() -> None:
    model = _model()
    lion = build_optimizer(_config("lion", lr=1e-4, betas=[0.9, 0.99]), model.parameters())
    assert type(lion) is Lion and lion.param_groups[0]["lr"] == 1e-4
    muon = build_optimizer(_config("Muon", muon_lr=0.01, adam_lr=1e-3, momentum=0.9),
                           model.named_parameters())  # fmt: skip
    assert type(muon) is Muon
    assert {g["name"]: g["lr"] for g in muon.param_groups} == {"muon-params": 0.01,
                                                                "adam-params": 1e-3}  # fmt: skip
    sgd = build_optimizer(_config("SGD", lr=0.1, momentum=0.9), model.parameters())
    assert type(sgd) is torch.optim.SGD and sgd.param_groups[0]["momentum"] == 0.9
    adagrad = build_optimizer(_config("adagrad", lr=0.1), model.parameters())
    assert type(adagrad) is torch.optim.Adagrad


def test_muon_routes_plain_parameters_by_the_names_given() -> None:
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(6, 4), "proj": torch.nn.Linear(4, 4)})
    names = dict(model.named_parameters())
    muon = build_optimizer(_config("Muon"), model.parameters(), names=names)
    routed = {n: g["use_muon"] for g in muon.param_groups for n, p in names.items()
              if any(p is q for q in g["params"])}  # fmt: skip
    assert routed == {"embed.weight": False, "proj.weight": True, "proj.bias": False}
    stray = torch.nn.Parameter(torch.zeros(3, 3))  # a matrix the names do not cover
    with pytest.raises(ConfigError, match="use_muon"):
        build_optimizer(_config("Muon"), [*model.parameters(), stray], names=names)
    # Other types take the same argument and ignore it.
    assert type(build_optimizer(_config("SGD", lr=0.1), model.parameters(), names=names)) is (
        torch.optim.SGD
    )


def test_every_built_optimizer_steps() -> None:
    for type_name in ("Adam", "AdamW", "Lion", "Muon", "SGD", "Adagrad", "RMSprop"):
        model = _model()
        optimizer = build_optimizer(_config(type_name, lr=0.01), model.named_parameters())
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_unknown_type_names_the_key_and_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        build_optimizer(_config("Adamm"), _model().parameters())
    assert _problem_keys(error) == ["optimizer.type"]
    for known in ("Adam", "AdamW", "Lion", "Muon", "SGD"):
        assert known in str(error.value)
    with pytest.raises(ConfigError, match="FusedLamb") as lamb:
        build_optimizer(_config("Lamb"), _model().parameters())
    assert _problem_keys(lamb) == ["optimizer.type"]


@pytest.mark.parametrize(
    ("type_name", "params", "key"),
    [
        ("Adam", {"lrr": 0.1}, "optimizer.params.lrr"),
        ("Lion", {"eps": 1e-8}, "optimizer.params.eps"),
        ("Muon", {"nesterov": True}, "optimizer.params.nesterov"),
        ("SGD", {"betas": [0.9, 0.9]}, "optimizer.params.betas"),
        ("Adam", {"max_grad_norm": 1.0}, "optimizer.params.max_grad_norm"),
        ("Adam", {"lr": -1.0}, "optimizer.params.lr"),
        ("AdamW", {"betas": [0.9]}, "optimizer.params.betas"),
        ("Adam", {"amsgrad": True}, "optimizer.params.amsgrad"),
        ("Adam", {"impl": "cuda"}, "optimizer.params.impl"),
        ("Muon", {"ns_method": "svd"}, "optimizer.params.ns_method"),
    ],
)
def test_bad_params_name_their_key(type_name: str, params: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        build_optimizer(_config(type_name, **params), _model().named_parameters())
    assert key in _problem_keys(error)
    assert key in str(error.value)
