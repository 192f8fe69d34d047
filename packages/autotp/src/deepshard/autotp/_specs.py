"""The first plan source: explicit ``partition_config.layer_specs`` and ``preset_model`` presets.

Specs are tried in order (the user's first, then the preset's when ``use_default_specs``
merges them) and the first that matches a module decides it; when several match, a warning
names the winner and the others. A spec's patterns are regular expressions matched, like
DeepSpeed's, from the start of a name (``re.match``) against the module's name and the full
names of its own parameters (``"model.layers.0.mlp.up_proj.weight"``). With specs present,
modules no spec matches are left whole; ``strict_mode`` refuses them instead (and refuses a
user spec that matches nothing), so a typo in a pattern cannot silently leave a layer whole.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch

from deepshard.autotp._decision import Decision
from deepshard.autotp._meta import AutoTPMeta
from deepshard.autotp._plan_types import Style
from deepshard.autotp._presets import preset_specs
from deepshard.autotp._warnings import AutoTPWarning
from deepshard.interface.config import TensorParallelConfig, TpLayerSpecConfig
from deepshard.interface.errors import ConfigError

__all__ = ["LabelledSpec", "SpecMatcher", "resolve_specs"]

_USER = "partition_config.layer_specs"


@dataclass(frozen=True)
class LabelledSpec:
    """A layer spec with where it came from."""

    spec: TpLayerSpecConfig
    """The rule."""

    label: str
    """``"partition_config.layer_specs[2]"`` or ``"preset:llama"`` (the plan's ``source``)."""

    user: bool
    """Written by the user (checked by ``strict_mode``), not taken from a preset."""

    patterns: tuple[re.Pattern[str], ...]
    """``spec.patterns``, compiled."""

    @property
    def key(self) -> str:
        """The config key to change it: the spec's path, or ``tensor_parallel.preset_model``."""
        return f"tensor_parallel.{self.label}" if self.user else "tensor_parallel.preset_model"


def _compile(spec: TpLayerSpecConfig, label: str, user: bool) -> LabelledSpec:
    try:
        patterns = tuple(re.compile(pattern) for pattern in spec.patterns)
    except re.error as exc:
        key = f"tensor_parallel.{label}.patterns"
        raise ConfigError(f"{key}: {exc.pattern!r} is not a regular expression ({exc})",
                          [(key, str(exc))]) from exc  # fmt: skip
    return LabelledSpec(spec, label, user, patterns)


def resolve_specs(config: TensorParallelConfig, meta: AutoTPMeta) -> list[LabelledSpec]:
    """The specs in matching order: the user's, then the preset's (unless replaced)."""
    partition = config.partition_config
    user = partition.layer_specs if partition is not None else []
    specs = [_compile(spec, f"{_USER}[{index}]", True) for index, spec in enumerate(user)]
    if config.preset_model is not None and (partition is None or partition.use_default_specs):
        label = f"preset:{config.preset_model.lower()}"
        specs += [_compile(spec, label, False) for spec in preset_specs(config.preset_model, meta)]
    return specs


def _parts_from_shape(
    entry: LabelledSpec, name: str, weight: torch.Tensor, dim: int
) -> tuple[int, ...]:
    """The sub-parameters the spec's ``shape`` declares along split dimension ``dim``."""
    shape, rows = entry.spec.shape, weight.shape[dim]
    key = f"{entry.key}.shape"
    if shape is None:
        return (rows,)
    problem = None
    if len(shape) != weight.dim():
        problem = f"has {len(shape)} dimensions but {name}'s weight has {weight.dim()}"
    else:
        for index, size in enumerate(shape):
            if index != dim and isinstance(size, int) and size not in (-1, weight.shape[index]):
                problem = (
                    f"says dimension {index} is {size}, {name}'s weight has {weight.shape[index]}"
                )
    split = shape[dim] if problem is None else -1
    if isinstance(split, list) and sum(split) != rows:
        problem = f"sub-parameters {split} sum to {sum(split)}, {name} has {rows} rows"
    elif isinstance(split, int) and split > 0 and rows % split:
        problem = f"{split} equal sub-parameters do not divide the {rows} rows of {name}"
    if problem is not None:
        raise ConfigError(f"{key}: {shape} {problem}", [(key, problem)])
    if isinstance(split, list):
        return tuple(split)
    return (rows,) if split == -1 else (rows // split,) * split


def spec_decision(entry: LabelledSpec, name: str, module: torch.nn.Module) -> Decision:
    """What a matched spec does to ``module``.

    Raises:
        ConfigError: When the spec cannot apply to the module (a split of something that is
            not a Linear or Embedding, a row-split embedding, a split dimension other than the
            style's, a ``shape`` that does not fit the weight).
    """
    spec, key = entry.spec, entry.key
    if spec.partition_type == "skip":
        style = Style.REPLICATE_GRAD_ALLREDUCE if spec.grad_allreduce else Style.REPLICATE
        return Decision(style, entry.label, key)
    linear = isinstance(module, torch.nn.Linear)
    if spec.grad_allreduce:
        raise ConfigError(f"{key}.grad_allreduce: only 'skip' specs keep a weight whole and "
                          f"all-reduce its gradient; {name} is split ({spec.partition_type})",
                          [(f"{key}.grad_allreduce", "applies to skip specs only")])  # fmt: skip
    if spec.partition_type == "column" and (linear or isinstance(module, torch.nn.Embedding)):
        style, dim = (Style.COLUMN if linear else Style.VOCAB), 0
    elif spec.partition_type == "row" and linear:
        style, dim = Style.ROW, 1
    else:
        what = type(module).__name__
        raise ConfigError(
            f"{key}.partition_type: {spec.partition_type!r} cannot split {name} ({what}); AutoTP "
            "splits torch.nn.Linear (column or row) and torch.nn.Embedding (column: by "
            "vocabulary); use 'skip' for it or narrow the spec's patterns",
            [(f"{key}.partition_type", f"cannot split {what} {name}")],
        )
    if spec.split_dim != dim:
        raise ConfigError(
            f"{key}.partition_dim: {spec.partition_type} splits dimension {dim} of {name}'s "
            f"weight, not {spec.split_dim}; remove partition_dim or set it to {dim}",
            [(f"{key}.partition_dim", f"must be {dim} for {spec.partition_type}")],
        )
    if spec.gather_output and style is not Style.COLUMN:
        raise ConfigError(f"{key}.gather_output: only a column-parallel Linear gathers its "
                          f"output; {name} is {style.value}",
                          [(f"{key}.gather_output", "applies to column Linears only")])  # fmt: skip
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    parts = _parts_from_shape(entry, name, weight, dim)
    return Decision(style, entry.label, key, spec.gather_output, parts)


class SpecMatcher:
    """Decides modules from specs, remembering what matched for warnings and strict mode."""

    def __init__(self, specs: list[LabelledSpec], model_type: str | None) -> None:
        wanted = model_type.lower() if model_type is not None else None
        self._specs = [
            entry
            for entry in specs
            if not entry.spec.model_types
            or wanted in {kind.lower() for kind in entry.spec.model_types}
        ]
        self._used: set[str] = set()
        self._overlaps: dict[tuple[str, ...], list[str]] = {}
        self.unmatched_linears: list[str] = []
        """Linears no spec matched, in model order."""

    def decide(self, name: str, module: torch.nn.Module) -> Decision | None:
        """The first matching spec's decision for ``module``, or None when none matches."""
        names = [name, *(f"{name}.{param}" for param, _ in module.named_parameters(recurse=False))]
        hits = [e for e in self._specs if any(p.match(n) for p in e.patterns for n in names)]
        if not hits:
            if isinstance(module, torch.nn.Linear):
                self.unmatched_linears.append(name)
            return None
        self._used.update(entry.label for entry in hits)
        if len(hits) > 1:
            labels = tuple(dict.fromkeys(entry.label for entry in hits))
            if len(labels) > 1:
                self._overlaps.setdefault(labels, []).append(name)
        return spec_decision(hits[0], name, module)

    def finish(self, strict: bool) -> None:
        """Warns about overlapping specs; in strict mode, refuses what matched nothing.

        Raises:
            ConfigError: In strict mode, for Linears no spec matched or user specs that
                matched no module.
        """
        for labels, modules in self._overlaps.items():
            others = ", ".join(labels[1:])
            warnings.warn(
                f"AutoTP: {len(modules)} module(s) ({modules[0]}, ...) match {labels[0]} and "
                f"{others}; the first match, {labels[0]}, decides them",
                AutoTPWarning,
                stacklevel=3,
            )
        if not strict:
            return
        problems = [(e.key, "matches no module of the model") for e in self._specs
                    if e.user and e.label not in self._used]  # fmt: skip
        if self.unmatched_linears:
            listed = ", ".join(self.unmatched_linears[:4])
            more = len(self.unmatched_linears) - 4
            listed += f" and {more} more" if more > 0 else ""
            problems.append((
                "tensor_parallel.partition_config.strict_mode",
                f"no layer spec matches the Linear(s) {listed}: add a spec (partition_type "
                "'skip' keeps one whole) or turn strict_mode off",
            ))  # fmt: skip
        if problems:
            raise ConfigError.from_problems(problems)
