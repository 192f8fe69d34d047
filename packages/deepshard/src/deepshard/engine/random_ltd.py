"""Random layerwise token dropping (random-LTD): chosen middle layers see a random subset of tokens.

Config ``data_efficiency.data_routing.random_ltd`` (DeepSpeed's keys; the method of
https://arxiv.org/abs/2211.11586). Early in training the layers in ``random_ltd_layer_id``
process only ``r`` of the sequence's ``S`` tokens, ``r`` growing to the full length; the other
tokens skip the layer unchanged. The first and last layers always see every token.

1. **Schedule** (`kept_tokens`, ``fixed_linear``): at global step ``t``,
   ``r = floor(min + (max - min) * t / require_steps)``, rounded down to a multiple of
   ``seq_per_step``, capped at ``max`` (DeepSpeed's formula). Each step also adds
   ``global_batch * (r * n_ltd + max * (total - n_ltd))`` to the consumed layer-tokens (the
   work actually done, for logging and checkpoints).
2. **Which tokens** (`kept_indices`): for each dropping layer and each row of the micro-batch,
   ``r`` distinct positions drawn uniformly and sorted (so a causal mask stays causal). They
   come from a generator seeded by (``data_efficiency.seed``, micro-step, layer, data-parallel
   rank) instead of torch's default one: tensor-parallel peers drop the same tokens whatever
   their default generators hold, dropout's stream is untouched, and a resumed run draws what
   the uninterrupted one would have without restoring any generator.
3. **The layer** (hooks, not a wrapper module, so parameter names, ZeRO-3 units and
   checkpoints are those of the plain model): a forward pre-hook gathers the kept rows of the
   hidden states and of the layer's sequence-aligned keyword inputs (the attention mask named
   ``model_mask_name``, else ``attention_mask``, gathered along both of its sequence dimensions,
   so padding stays exact; ``position_ids``; ``position_embeddings``); a forward hook scatters
   the layer's output back into a copy of the full hidden states. The gradient is exactly that
   of ``out = h; out[kept] = layer(h[kept])``: dropped tokens pass their gradient through,
   kept ones receive the layer's. In eval mode, or when ``r >= S``, the layer runs on all.

DeepSpeed wraps each layer in a ``RandomLayerTokenDrop`` module (which renames every parameter
under ``.random_ltd_layer``, hence its ``remove_random_ltd_state_dict``), picks the dropping
layers by a substring test of the layer id against module names (id 1 also matches
``layers.10``), truncates a decoder's mask to its first ``r`` rows and columns (wrong when
padding is present), and draws from the global generator (shifting dropout's stream).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from deepshard.interface.config import DeepShardConfig, RandomLtdConfig
from deepshard.interface.errors import ConfigError

__all__ = [
    "RandomLtdScheduler",
    "attach_random_ltd",
    "convert_to_random_ltd",
    "draw_seed",
    "find_layers",
    "gather_tokens",
    "kept_indices",
    "kept_tokens",
    "random_ltd_problems",
    "scatter_tokens",
]

_KEY = "data_efficiency.data_routing.random_ltd"
_SEQUENCE_KWARGS = ("position_ids", "position_embeddings")


def random_ltd_problems(config: DeepShardConfig) -> list[tuple[str, str]]:
    """``(key, problem)`` for random-LTD settings the engine cannot run as asked."""
    section = config.data_efficiency.data_routing.random_ltd
    if not section.enabled:
        return []
    problems = []
    schedule = section.random_ltd_schedule
    if schedule.min_value > schedule.max_value:
        problems.append(
            (
                f"{_KEY}.random_ltd_schedule.min_value",
                f"{schedule.min_value} is above max_value {schedule.max_value}",
            )
        )
    if config.sequence_parallel_size > 1:
        problems.append(
            (
                f"{_KEY}.enabled",
                "cannot drop tokens of a sequence split over sequence_parallel_size "
                f"{config.sequence_parallel_size} ranks; use one or the other",
            )
        )
    return problems


def kept_tokens(section: RandomLtdConfig, step: int) -> int:
    """``r``, the tokens a dropping layer keeps at global step ``step`` (``fixed_linear``)."""
    schedule = section.random_ltd_schedule
    low, high = schedule.min_value, schedule.max_value
    steps = schedule.schedule_config
    value = math.floor(step / steps.require_steps * (high - low) + low)
    value -= value % steps.seq_per_step
    return min(value, high)


class RandomLtdScheduler:
    """The kept-token count and the consumed layer-tokens (DeepSpeed's ``RandomLTDScheduler``).

    Args:
        section: The ``random_ltd`` config section.
        global_batch_size: Samples per optimizer step (``global_batch_size``, else the
            engine's ``train_batch_size``).
    """

    def __init__(self, section: RandomLtdConfig, global_batch_size: int) -> None:
        self.section = section
        self.global_batch_size = global_batch_size
        self.current = section.random_ltd_schedule.min_value
        self.consumed_layer_tokens = 0
        self.step = -1

    def update_seq(self, global_steps: int) -> int:
        """Move to ``global_steps`` (counting its layer-tokens once); return ``r``."""
        high = self.section.random_ltd_schedule.max_value
        if self.current < high:
            self.current = kept_tokens(self.section, global_steps)
        if global_steps != self.step:
            dropping = len(self.section.random_ltd_layer_id)
            total = self.section.total_layer_num or dropping
            per_sample = self.current * dropping + high * (total - dropping)
            self.consumed_layer_tokens += self.global_batch_size * per_sample
            self.step = global_steps
        return self.current

    def get_current_seq(self) -> int:
        """``r`` now."""
        return self.current

    def state_dict(self) -> dict[str, int]:
        """JSON state for the checkpoint."""
        return {
            "current_value": self.current,
            "consumed_layer_tokens": self.consumed_layer_tokens,
            "current_steps": self.step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore `state_dict`'s state."""
        self.current = int(state["current_value"])
        self.consumed_layer_tokens = int(state["consumed_layer_tokens"])
        self.step = int(state["current_steps"])


def draw_seed(seed: int, micro_step: int, rank: int) -> int:
    """The seed of micro-step ``micro_step`` on data-parallel rank ``rank`` (each layer adds
    its id to it): the same on a rank's tensor- and sequence-parallel peers, and in a
    recompute."""
    return (((seed * 1_000_003 + micro_step) * 4099 + rank) * 1_000_003) % (1 << 62)


def kept_indices(
    batch: int, seq: int, keep: int, *, seed: int, device: torch.device | None = None
) -> torch.Tensor:
    """``[batch, keep]`` sorted distinct positions in ``[0, seq)``, uniform per row, drawn
    from a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed % (1 << 63))
    order = torch.rand(batch, seq, generator=generator).argsort(dim=1)
    return order[:, :keep].sort(dim=1).values.to(device)


def _rows(tensor: torch.Tensor, batch: int) -> torch.Tensor:
    return tensor.expand(batch, *tensor.shape[1:]) if tensor.shape[0] == 1 < batch else tensor


def _take(tensor: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` gathered along ``dim`` at ``index`` (``[batch, keep]``), row by row."""
    tensor = _rows(tensor, index.shape[0])
    shape = [index.shape[0]] + [1] * (tensor.dim() - 1)
    shape[dim] = index.shape[1]
    expanded = index.view(shape).expand(
        *tensor.shape[:dim], index.shape[1], *tensor.shape[dim + 1 :]
    )
    return tensor.gather(dim, expanded)


def gather_tokens(hidden: torch.Tensor, index: torch.Tensor, *, batch_first: bool) -> torch.Tensor:
    """The kept tokens of ``hidden`` (``[B, S, H]``, or ``[S, B, H]`` when not batch-first)."""
    if batch_first:
        return _take(hidden, index, 1)
    return _take(hidden.transpose(0, 1), index, 1).transpose(0, 1)


def scatter_tokens(
    hidden: torch.Tensor, part: torch.Tensor, index: torch.Tensor, *, batch_first: bool
) -> torch.Tensor:
    """A copy of ``hidden`` whose kept tokens are ``part`` (differentiable in both)."""
    if not batch_first:
        full = scatter_tokens(hidden.transpose(0, 1), part.transpose(0, 1), index, batch_first=True)
        return full.transpose(0, 1)
    expanded = index.unsqueeze(-1).expand(*index.shape, hidden.shape[-1])
    return hidden.scatter(1, expanded, part.to(hidden.dtype))


def _gather_mask(mask: torch.Tensor, index: torch.Tensor, seq: int) -> torch.Tensor:
    """A mask's kept rows and columns: every dimension after the batch one of length ``seq``
    (``[B, S]``, ``[B, S, S]``, ``[B, heads, S, S]``, ``[B, 1, 1, S]``)."""
    for dim in range(1, mask.dim()):
        if mask.shape[dim] == seq and not (mask.dim() == 4 and dim == 1):
            mask = _take(mask, index, dim)
    return mask


def _gather_kwarg(value: Any, index: torch.Tensor, seq: int) -> Any:
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq:
        return _take(value, index, 1)
    if isinstance(value, tuple):
        return tuple(_gather_kwarg(v, index, seq) for v in value)
    return value


@dataclass
class _LayerHooks:
    """The pre- and post-forward hooks of one dropping layer."""

    layer: int
    section: RandomLtdConfig
    draw_seed: Any  # () -> int: the seed of this micro-step on this rank (`draw_seed`)
    kept: Any  # () -> int | None: r now, None when not dropping (eval)
    saved: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def batch_first(self) -> bool:
        return self.section.hidden_state_order == "batch_seq_dim"

    def before(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        keep = self.kept() if module.training else None
        if not isinstance(hidden, torch.Tensor) or keep is None:
            return None
        batch, seq = (hidden.shape[0], hidden.shape[1]) if self.batch_first else hidden.shape[1::-1]
        if keep >= seq:
            return None
        seed = self.draw_seed() + self.layer
        index = kept_indices(batch, seq, keep, seed=seed, device=hidden.device)
        self.saved.append((hidden, index))
        part = gather_tokens(hidden, index, batch_first=self.batch_first)
        mask_name = self.section.model_mask_name or "attention_mask"
        new_kwargs = dict(kwargs)
        if isinstance(kwargs.get(mask_name), torch.Tensor):
            new_kwargs[mask_name] = _gather_mask(kwargs[mask_name], index, seq)
        for name in _SEQUENCE_KWARGS:
            if name in kwargs:
                new_kwargs[name] = _gather_kwarg(kwargs[name], index, seq)
        if args:
            return (part, *args[1:]), new_kwargs
        new_kwargs["hidden_states"] = part
        return args, new_kwargs

    def after(
        self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        del module, args, kwargs
        if not self.saved:
            return None
        hidden, index = self.saved.pop()
        first = output[0] if isinstance(output, tuple) else output
        if not isinstance(first, torch.Tensor):
            raise ConfigError(
                f"{_KEY}: layer {self.layer} returned {type(output).__name__}; random-LTD needs "
                "the hidden states as its output or the first element of a tuple"
            )
        full = scatter_tokens(hidden, first, index, batch_first=self.batch_first)
        return (full, *output[1:]) if isinstance(output, tuple) else full


def find_layers(model: torch.nn.Module, layer_type: type | None = None) -> list[torch.nn.Module]:
    """The model's transformer layers, in order.

    With ``layer_type``: every instance of it. Without: the entries of the one
    ``torch.nn.ModuleList`` holding the most modules of a single type (Hugging Face's
    ``model.layers``, GPT-2's ``h``).

    Raises:
        ConfigError: No such layers, or several lists of equal length compete.
    """
    if layer_type is not None:
        found = [m for m in model.modules() if isinstance(m, layer_type)]
        if not found:
            raise ConfigError(f"{_KEY}: the model has no {layer_type.__name__} layers")
        return found
    lists = [
        list(m)
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) and len({type(x) for x in m}) == 1
    ]
    longest = max((len(x) for x in lists), default=0)
    best = [x for x in lists if len(x) == longest]
    if len(best) != 1:
        raise ConfigError(
            f"{_KEY}: cannot tell which modules are the transformer layers ({len(best)} "
            "candidate lists); name them: deepshard.engine.random_ltd.convert_to_random_ltd("
            "engine, LayerClass)"
        )
    return best[0]


def attach_random_ltd(
    layers: Sequence[torch.nn.Module],
    section: RandomLtdConfig,
    *,
    draw_seed: Any,
    kept: Any,
) -> list[RemovableHandle]:
    """Register the hooks on the layers ``section.random_ltd_layer_id`` names.

    Args:
        layers: All transformer layers, in order (`find_layers`).
        section: The ``random_ltd`` section.
        draw_seed: ``() -> int``, the seed of the current micro-step on this rank
            (`draw_seed`); layer ``i`` draws with that seed plus ``i``.
        kept: ``() -> int | None``, ``r`` now (None: do not drop).

    Raises:
        ConfigError: The layer ids or counts do not fit the model.
    """
    ids = list(section.random_ltd_layer_id)
    problems = []
    if section.random_ltd_layer_num is not None and section.random_ltd_layer_num != len(ids):
        problems.append(
            (
                "random_ltd_layer_num",
                f"{section.random_ltd_layer_num} but random_ltd_layer_id lists {len(ids)} layers",
            )
        )
    if section.total_layer_num is not None and section.total_layer_num != len(layers):
        problems.append(
            ("total_layer_num", f"{section.total_layer_num} but the model has {len(layers)}")
        )
    bad = [i for i in ids if not 0 <= i < len(layers)]
    if bad or len(set(ids)) != len(ids) or not ids:
        problems.append(
            ("random_ltd_layer_id", f"{ids} must be distinct layer indices in [0, {len(layers)})")
        )
    if problems:
        raise ConfigError.from_problems([(f"{_KEY}.{k}", v) for k, v in problems])
    handles = []
    for layer_id in sorted(ids):
        hooks = _LayerHooks(layer_id, section, draw_seed, kept)
        module = layers[layer_id]
        handles.append(module.register_forward_pre_hook(hooks.before, with_kwargs=True))
        handles.append(module.register_forward_hook(hooks.after, with_kwargs=True))
    return handles


def convert_to_random_ltd(engine: Any, layer_type: type) -> Any:
    """DeepSpeed's entry point: make ``engine``'s ``layer_type`` layers (those the config's
    ``random_ltd_layer_id`` names) drop tokens; returns ``engine``.

    Raises:
        ConfigError: ``engine`` is not a DeepShard engine, or `attach_random_ltd` refuses.
    """
    initialize = getattr(engine, "random_ltd_initialize", None)
    if initialize is None:
        raise ConfigError(
            "convert_to_random_ltd takes the engine deepshard.engine.initialize returned "
            f"(the config holds the schedule), not a {type(engine).__name__}"
        )
    initialize(layer_type)
    return engine
