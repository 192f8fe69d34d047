"""`build_optimizer`: the optimizer a config's ``optimizer`` section names.

Type names are DeepSpeed's, compared case-insensitively: ``Adam`` and ``AdamW`` (with
DeepSpeed's ``adam_w_mode``, ``torch_adam`` and ``fp32_optimizer_states`` params), ``Lion``,
``Muon``, and, as in DeepSpeed, any optimizer class of ``torch.optim`` by its name (``SGD``,
``Adagrad``, ``RMSprop``, ...). Every ``params`` key is checked against the type, so a typo
fails with its key path instead of reaching a constructor as a ``TypeError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from deepshard.interface.config import OptimizerConfig
from deepshard.interface.errors import ConfigError
from deepshard.interface.params import ParamShapes
from deepshard.optimizers.adam import Adam, AdamW, ParamsT
from deepshard.optimizers.lion import Lion
from deepshard.optimizers.muon import Muon

__all__ = ["build_optimizer", "known_optimizer_types", "takes_param"]

_ADAM_KEYS = frozenset({
    "lr", "betas", "eps", "weight_decay", "bias_correction", "amsgrad", "adam_w_mode",
    "torch_adam", "foreach", "fp32_optimizer_states", "impl",
})  # fmt: skip
_LION_KEYS = frozenset({"lr", "betas", "weight_decay", "fp32_optimizer_states", "impl"})
_MUON_KEYS = frozenset({
    "lr", "momentum", "weight_decay", "ns_method", "betas", "eps", "muon_lr", "adam_lr",
    "adam_w_mode", "torch_adam", "fp32_optimizer_states",
})  # fmt: skip
_NOT_CARRIED = {
    "lamb": "DeepShard does not carry FusedLamb; use AdamW, or build a LAMB optimizer yourself "
    "and pass it to deepshard.engine.initialize(optimizer=...)",
    **{
        name: f"{name} comes from the mup package, which DeepShard does not depend on; build "
        "it with mup and pass it to deepshard.engine.initialize(optimizer=...)"
        for name in ("muadam", "muadamw", "musgd")
    },
}


def _torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    found = {}
    for name in dir(torch.optim):
        value = getattr(torch.optim, name)
        is_optimizer = isinstance(value, type) and issubclass(value, torch.optim.Optimizer)
        if is_optimizer and value is not torch.optim.Optimizer:
            found[name.lower()] = value
    return found


_OUR_KEYS = {"adam": _ADAM_KEYS, "adamw": _ADAM_KEYS, "lion": _LION_KEYS, "muon": _MUON_KEYS}


def takes_param(type_name: str, key: str) -> bool:
    """Whether DeepShard's optimizer of ``optimizer.type`` ``type_name`` (case-insensitive)
    takes ``optimizer.params.<key>``; False for the ``torch.optim`` types."""
    return key in _OUR_KEYS.get(type_name.lower(), frozenset())


def known_optimizer_types() -> list[str]:
    """Every ``optimizer.type`` `build_optimizer` accepts, as written in DeepSpeed configs."""
    ours = ["Adam", "AdamW", "Lion", "Muon"]
    taken = {name.lower() for name in ours}
    extra = sorted(c.__name__ for k, c in _torch_optimizers().items() if k not in taken)
    return ours + extra


def _check_keys(params: dict[str, Any], allowed: frozenset[str], type_name: str) -> None:
    problems = []
    if "max_grad_norm" in params:
        problems.append(
            (
                "optimizer.params.max_grad_norm",
                "gradient clipping is not an "
                "optimizer parameter; set the top-level gradient_clipping key instead",
            )
        )
    unknown = sorted(set(params) - allowed - {"max_grad_norm"})
    known = ", ".join(sorted(allowed))
    problems += [(f"optimizer.params.{key}", f"not a parameter of {type_name}; it takes: {known}")
                 for key in unknown]  # fmt: skip
    if problems:
        raise ConfigError.from_problems(problems)


def _refuse(key: str, message: str) -> ConfigError:
    return ConfigError.from_problems([(f"optimizer.params.{key}", message)])


def _build_adam(name: str, params: ParamsT, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    _check_keys(kwargs, _ADAM_KEYS, name)
    adam_w_mode = kwargs.pop("adam_w_mode", True)
    if name == "AdamW" and adam_w_mode is False:
        raise _refuse("adam_w_mode", 'false contradicts type AdamW; use "type": "Adam" for L2')
    if kwargs.pop("torch_adam", False):
        kwargs.pop("fp32_optimizer_states", None)  # torch keeps moments in the param dtype
        for key in ("bias_correction", "impl"):
            if key in kwargs:
                raise _refuse(key, "does not apply with torch_adam: true (torch.optim.Adam has "
                              "no such option); remove it or drop torch_adam")  # fmt: skip
        cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        return cls(params, **kwargs)
    if "foreach" in kwargs:
        raise _refuse("foreach", 'applies only with torch_adam: true; use "impl": "foreach"')
    if name == "AdamW":
        return AdamW(params, **kwargs)
    return Adam(params, adam_w_mode=bool(adam_w_mode), **kwargs)


def _build_lion(params: ParamsT, kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    _check_keys(kwargs, _LION_KEYS, "Lion")
    return Lion(params, **kwargs)


def _build_muon(
    params: ParamsT,
    kwargs: dict[str, Any],
    shapes: ParamShapes | None,
    names: Mapping[str, torch.Tensor] | None,
) -> torch.optim.Optimizer:
    _check_keys(kwargs, _MUON_KEYS, "Muon")
    if kwargs.pop("torch_adam", False):
        kwargs["adam_impl"] = "foreach"
    return Muon(params, param_shapes=shapes, names=names, **kwargs)


def _build_torch(
    cls: type[torch.optim.Optimizer], params: ParamsT, kwargs: dict[str, Any]
) -> torch.optim.Optimizer:
    signature = inspect.signature(cls.__init__)
    allowed = frozenset(n for n in signature.parameters if n not in ("self", "params"))
    _check_keys(kwargs, allowed, f"torch.optim.{cls.__name__}")
    return cls(params, **kwargs)


def _builder(
    type_name: str, shapes: ParamShapes | None, names: Mapping[str, torch.Tensor] | None
) -> Callable[[ParamsT, dict[str, Any]], torch.optim.Optimizer]:
    key = type_name.lower()
    if key in ("adam", "adamw"):
        canonical = "AdamW" if key == "adamw" else "Adam"
        return lambda params, kwargs: _build_adam(canonical, params, kwargs)
    if key == "lion":
        return _build_lion
    if key == "muon":
        return lambda params, kwargs: _build_muon(params, kwargs, shapes, names)
    if key in _NOT_CARRIED:
        raise ConfigError.from_problems([("optimizer.type", _NOT_CARRIED[key])])
    torch_cls = _torch_optimizers().get(key)
    if torch_cls is None:
        known = ", ".join(known_optimizer_types())
        raise ConfigError.from_problems(
            [("optimizer.type", f"unknown optimizer {type_name!r}; known types: {known}")]
        )
    return lambda params, kwargs: _build_torch(torch_cls, params, kwargs)


def _prefixed(error: ConfigError) -> ConfigError:
    if not error.problems:
        return ConfigError(f"optimizer: {error}")
    problems = [
        (path if path.startswith("optimizer.") else f"optimizer.params.{path}", message)
        for path, message in error.problems
    ]
    return ConfigError.from_problems(problems)


def build_optimizer(
    config: OptimizerConfig,
    params: ParamsT,
    *,
    param_shapes: ParamShapes | None = None,
    names: Mapping[str, torch.Tensor] | None = None,
) -> torch.optim.Optimizer:
    """Builds the optimizer the ``optimizer`` config section describes.

    Args:
        config: The section: ``type`` (case-insensitive) and ``params``.
        params: What the optimizer updates: parameters, ``model.named_parameters()``, or param
            groups (a group's ``use_muon`` decides its half under Muon).
        param_shapes: Layer shapes of partitioned parameters, for Muon (from the ZeRO package).
        names: Parameters by name, e.g. ``dict(model.named_parameters())``: Muon routes plain
            parameters by these names (embeddings and ``lm_head`` to Adam); other types
            ignore it.

    Returns:
        The optimizer.

    Raises:
        ConfigError: Unknown type (``optimizer.type``), unknown or bad parameter
            (``optimizer.params.<key>``).
    """
    build = _builder(config.type, param_shapes, names)
    try:
        return build(params, dict(config.params))
    except ConfigError as error:
        raise _prefixed(error) from error
    except (TypeError, ValueError) as error:
        raise ConfigError.from_problems([("optimizer.params", str(error))]) from error
