"""How `Muon` splits the caller's param groups into Muon halves and auxiliary-Adam halves.

Muon is defined on matrices, and only on hidden ones: a parameter takes the Muon update when its
layer shape has two or more dimensions and its name contains neither ``"embed"`` nor
``"lm_head"`` (compared lower-case); everything else (embeddings, the output head, biases,
norms) takes Adam. The layer shape is the parameter's own shape unless a `ParamShapes` says the
parameter is stored partitioned (ZeRO-3 keeps a flat 1-D piece) and gives the real one.

Each incoming group becomes up to two groups flagged ``use_muon``. Their settings resolve
most-specific-last: the optimizer's defaults, then ``muon_lr`` / ``adam_lr``, then whatever the
incoming group sets for a key that half understands (``lr``, ``momentum``, ``weight_decay``,
``ns_method`` for Muon; ``lr``, ``betas``, ``eps``, ``weight_decay`` for Adam). Other keys of
the group are kept on both halves. A group that already says ``use_muon`` is taken as it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from deepshard.interface.errors import ConfigError
from deepshard.interface.params import ParamShapes

__all__ = ["ADAM_KEYS", "MUON_KEYS", "layer_shape", "split_group", "uses_muon"]

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_EXCLUDED_NAMES = ("embed", "lm_head")
_STRUCTURE_KEYS = ("params", "param_names", "use_muon", "name")


def layer_shape(param: torch.Tensor, shapes: ParamShapes | None) -> tuple[int, ...]:
    """The parameter's shape as a layer: the `ParamShapes` answer, else its own shape."""
    full = shapes.full_shape(param) if shapes is not None else None
    return tuple(param.shape) if full is None else tuple(full)


def uses_muon(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a parameter of this name and layer shape takes the Muon update."""
    lowered = name.lower()
    return len(shape) >= 2 and not any(word in lowered for word in _EXCLUDED_NAMES)


def _unpack(group: dict[str, Any], names: Mapping[int, str]) -> tuple[list[Any], list[Any], bool]:
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    inline = bool(params) and all(isinstance(p, tuple) for p in params)
    if inline:
        return [p for _, p in params], [n for n, _ in params], True
    given = group.get("param_names")
    if given is not None:
        return params, list(given), True
    return params, [names.get(id(p)) for p in params], False


def _classify(params: list[Any], param_names: list[Any], shapes: ParamShapes | None) -> list[bool]:
    flags = []
    for param, name in zip(params, param_names, strict=True):
        shape = layer_shape(param, shapes)
        if len(shape) >= 2 and name is None:
            raise ConfigError(
                f"Muon needs the name of every matrix parameter to keep embeddings and the "
                f"output head on Adam, and a parameter of shape {shape} has none (through "
                "deepshard.engine.initialize: model_parameters holds a parameter the model "
                "does not); pass model.named_parameters(), or names=dict(model.named_parameters"
                "()), or put it in a param group with use_muon=True/False"
            )
        flags.append(len(shape) >= 2 and uses_muon(str(name), shape))
    return flags


def split_group(
    group: dict[str, Any],
    *,
    index: int,
    names: Mapping[int, str],
    shapes: ParamShapes | None,
    halves: Mapping[bool, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Splits one incoming param group into its Muon and Adam halves.

    Args:
        group: The group as the caller gave it.
        index: Its position among the caller's groups (names the halves).
        names: Parameter name by ``id(param)``, from the explicit mapping.
        shapes: Where partitioned parameters' layer shapes come from.
        halves: Default settings of the Muon (``True``) and Adam (``False``) halves.

    Returns:
        One or two groups, each with ``use_muon`` and every setting of its half.
    """
    params, param_names, named = _unpack(group, names)
    if "use_muon" in group:
        flags = [bool(group["use_muon"])] * len(params)
    else:
        flags = _classify(params, param_names, shapes)
    overrides = {k: v for k, v in group.items() if k not in _STRUCTURE_KEYS}
    prefix = group.get("name") or (f"group{index}" if index else None)
    out = []
    for use_muon, label, keys in ((True, "muon", MUON_KEYS), (False, "adam", ADAM_KEYS)):
        chosen = [i for i, flag in enumerate(flags) if flag is use_muon]
        if not chosen:
            continue
        other = ADAM_KEYS if use_muon else MUON_KEYS
        half = dict(halves[use_muon])
        half.update({k: v for k, v in overrides.items() if k in keys or k not in other})
        half["params"] = [params[i] for i in chosen]
        if named:
            half["param_names"] = [param_names[i] for i in chosen]
        half["use_muon"] = use_muon
        half["name"] = f"{prefix}-{label}-params" if prefix else f"{label}-params"
        out.append(half)
    return out
