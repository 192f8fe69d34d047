"""`make_plan`: a model's AutoTP plan, chosen from one source and sized by its metadata.

The sources, in priority order; the first one present decides the whole model:

1. explicit specs: ``partition_config.layer_specs`` and the ``preset_model`` preset (merged
   when ``use_default_specs``), or any ``partition_config`` with ``strict_mode`` on;
2. the model's Hugging Face ``tp_plan`` (config, class and instance); one using a style AutoTP
   cannot apply (Phi-3's ``rowwise_split_input``) is refused whole, and the preset of the
   model's type is used instead when there is one, with a warning;
3. the structural heuristic.

One source per model, as in DeepSpeed: mixing them module by module could pair a column split
from one source with a row split another never planned. Then, whatever the source, the rules
that keep a model correct: a row-parallel LM head is refused in training (its input, the last
hidden state, is whole on every rank); an LM head tied to the input embedding stays whole, and
the embedding with it (a split of one would silently untie them), with a warning. Finally each
split module gets its sizes: per sub-parameter (the spec's ``shape``, else the architecture's
fused layout), by KV-head groups inside attention, by grain elsewhere (`deepshard.autotp._sizes`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch

from deepshard.autotp._decision import SPLIT_STYLES, Decision
from deepshard.autotp._heuristic import HeuristicSource
from deepshard.autotp._hf_plan import TpPlanSource, hf_tp_plan
from deepshard.autotp._layout import fused_parts, in_attention, leaf
from deepshard.autotp._meta import AutoTPMeta
from deepshard.autotp._plan_types import LayerPlan, Style, TPPlan
from deepshard.autotp._presets import PRESETS
from deepshard.autotp._sizes import sub_parameter_sizes
from deepshard.autotp._specs import LabelledSpec, SpecMatcher, resolve_specs
from deepshard.autotp._warnings import AutoTPWarning
from deepshard.interface.config import TensorParallelConfig
from deepshard.interface.errors import ConfigError

__all__ = ["make_plan"]

_TP_KEY = "tensor_parallel.autotp_size"


def _owners(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """Modules that own parameters directly, in model order (shared modules once)."""
    for name, module in model.named_modules():
        if name and next(module.parameters(recurse=False), None) is not None:
            yield name, module


def _lm_heads(model: torch.nn.Module, patterns: list[str]) -> frozenset[str]:
    """Names of the output projections: by ``lm_head_patterns`` or ``get_output_embeddings``."""
    getter = getattr(model, "get_output_embeddings", None)
    output = getter() if callable(getter) else None
    return frozenset(
        name
        for name, module in model.named_modules()
        if name and (leaf(name) in patterns or (output is not None and module is output))
    )


def _input_embeddings(model: torch.nn.Module, meta: AutoTPMeta) -> frozenset[str]:
    """Names of the token embeddings: ``get_input_embeddings``, else vocabulary-sized ones."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        found = getter() if callable(getter) else None
    except NotImplementedError:  # transformers' base class, for models without one
        found = None
    return frozenset(
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding)
        and (module is found or (found is None and module.num_embeddings == meta.vocab_size))
    )


def _check_sizes(tp_size: int, config: TensorParallelConfig) -> None:
    if tp_size < 1:
        raise ConfigError(f"{_TP_KEY}: {tp_size} must be at least 1", [(_TP_KEY, "must be >= 1")])
    if config.autotp_size > 1 and config.autotp_size != tp_size:
        raise ConfigError(
            f"{_TP_KEY}: the config says {config.autotp_size} but the plan is for {tp_size} "
            "ranks (the mesh's tp axis); make them agree",
            [(_TP_KEY, f"{config.autotp_size} != tp size {tp_size}")],
        )


def _decide_all(
    model: torch.nn.Module, config: TensorParallelConfig, meta: AutoTPMeta, lm_heads: frozenset[str]
) -> dict[str, Decision]:
    """Every module's decision from the first source the model and config have."""
    owners = list(_owners(model))
    partition = config.partition_config
    strict = partition is not None and partition.strict_mode
    specs = resolve_specs(config, meta)
    source = None
    if not (specs or strict) and (plan := hf_tp_plan(model)):
        try:
            source = TpPlanSource(plan)
        except ConfigError as exc:
            specs = _preset_instead(config, meta, exc)
            if not specs:
                raise
    if specs or strict:
        matcher = SpecMatcher(specs, meta.model_type)
        decided = {name: matcher.decide(name, module) for name, module in owners}
        matcher.finish(strict)
    elif source is not None:
        decided = {name: source.decide(name, module) for name, module in owners}
    else:
        linears = [name for name, module in owners if isinstance(module, torch.nn.Linear)]
        embeddings = _input_embeddings(model, meta)
        heuristic = HeuristicSource(linears, lm_heads, embeddings, meta)
        decided = {name: heuristic.decide(name, module) for name, module in owners}
    return {name: decision for name, decision in decided.items() if decision is not None}


def _preset_instead(
    config: TensorParallelConfig, meta: AutoTPMeta, refusal: ConfigError
) -> list[LabelledSpec]:
    """The preset of the model's own type, when its Hugging Face ``tp_plan`` uses a style
    AutoTP cannot apply (Phi-3's ``rowwise_split_input``); empty when there is no such preset.
    Warns, so the choice is visible (setting ``preset_model`` says it and silences this)."""
    if meta.model_type is None or meta.model_type.lower() not in PRESETS:
        return []
    warnings.warn(
        f"{refusal}. Planning it with the {meta.model_type.lower()!r} preset instead (set "
        f"tensor_parallel.preset_model: {meta.model_type.lower()!r} to choose it explicitly)",
        AutoTPWarning,
        stacklevel=4,
    )
    return resolve_specs(config.model_copy(update={"preset_model": meta.model_type}), meta)


def _apply_head_rules(
    model: torch.nn.Module, decided: dict[str, Decision], lm_heads: frozenset[str], training: bool
) -> None:
    """Refuses a row-parallel LM head in training; keeps tied weights whole, in place."""
    for name in lm_heads:
        decision = decided.get(name)
        if training and decision is not None and decision.style is Style.ROW:
            raise ConfigError(
                f"{decision.key}: {decision.source} makes the LM head {name} row-parallel, which "
                "training cannot use (its input, the last hidden state, is whole on every "
                "rank); make it column with gather_output, or skip it",
                [(decision.key, f"row-parallel LM head {name} in training")],
            )
    by_weight: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if name and isinstance(weight, torch.nn.Parameter):
            by_weight.setdefault(id(weight), []).append(name)
    for names in by_weight.values():
        split = [name for name in names if name in decided and decided[name].style in SPLIT_STYLES]
        if len(names) < 2 or not split:
            continue
        warnings.warn(
            f"AutoTP: {' and '.join(names)} share one weight (tied embeddings); splitting "
            f"{split[0]} would untie them, so they stay whole on every rank",
            AutoTPWarning,
            stacklevel=3,
        )
        for name in names:
            old = decided.get(name)
            source = f"{old.source} (tied: kept whole)" if old is not None else "tied: kept whole"
            decided[name] = Decision(Style.REPLICATE, source, "tensor_parallel")


def _layer_plan(
    name: str, module: torch.nn.Module, decision: Decision, tp_size: int, meta: AutoTPMeta
) -> LayerPlan:
    if decision.style not in SPLIT_STYLES:
        return LayerPlan(name, decision.style, source=decision.source)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    rows = int(weight.shape[1 if decision.style is Style.ROW else 0])
    parts = decision.parts
    if parts is None:
        parts = fused_parts(name, rows, meta) if decision.style is Style.COLUMN else (rows,)
    attention = decision.style is not Style.VOCAB and in_attention(name)
    groups = meta.num_kv_heads if attention else None
    sizes = sub_parameter_sizes(
        parts, tp_size, kv_groups=(groups,) * len(parts), grain=meta.tp_grain_size, name=name
    )
    return LayerPlan(name, decision.style, sizes, decision.gather_output, decision.source)


def make_plan(
    model: torch.nn.Module,
    tp_size: int,
    config: TensorParallelConfig | None = None,
    *,
    training: bool = True,
) -> TPPlan:
    """Chooses how tensor parallelism splits ``model`` over ``tp_size`` ranks.

    Args:
        model: A plain model (a Hugging Face model or any ``nn.Module``); only read.
        tp_size: Ranks in the tensor-parallel group.
        config: The ``tensor_parallel`` section; None uses its defaults.
        training: Planning for training (a row-parallel LM head is refused).

    Returns:
        The plan: one `LayerPlan` per module TP touches, in model order.

    Raises:
        ConfigError: For bad sizes, specs, tp_plan styles or LM heads; the message names the
            key to change.
    """
    config = config if config is not None else TensorParallelConfig()
    _check_sizes(tp_size, config)
    meta = AutoTPMeta.from_model_config(getattr(model, "config", None), config.tp.tp_grain_size)
    patterns = (config.partition_config.lm_head_patterns if config.partition_config is not None
                else ["lm_head", "embed_out"])  # fmt: skip
    lm_heads = _lm_heads(model, patterns)
    decided = _decide_all(model, config, meta, lm_heads)
    _apply_head_rules(model, decided, lm_heads, training)
    modules = dict(model.named_modules())
    layers = tuple(
        _layer_plan(name, modules[name], decision, tp_size, meta)
        for name, decision in decided.items()
    )
    _warn_empty_ranks(layers, tp_size, meta)
    return TPPlan(tp_size, layers)


def _warn_empty_ranks(layers: tuple[LayerPlan, ...], tp_size: int, meta: AutoTPMeta) -> None:
    kv = meta.num_kv_heads
    if kv is None or tp_size <= kv:
        return
    if any(in_attention(layer.module) and layer.sizes and layer.local_size(tp_size - 1) == 0
           for layer in layers):  # fmt: skip
        warnings.warn(
            f"AutoTP: {_TP_KEY}={tp_size} is more than the model's {kv} key/value heads: ranks "
            f"{kv}-{tp_size - 1} hold no attention rows, so attention does not scale past {kv} "
            "ranks (the results stay exact)",
            AutoTPWarning,
            stacklevel=3,
        )
