"""The second plan source: the Hugging Face ``tp_plan`` a model carries.

Three places hold it, read by duck typing: the config's ``base_model_tp_plan`` (keys relative
to the base model, ``"layers.*.self_attn.q_proj"``), the model class's ``_tp_plan`` (keys of
the top model, ``"lm_head"``), and the instance's own ``_tp_plan`` (set by ``post_init``, or by
the user). A later place overrides an earlier one for the same key. A key's ``*`` stands for
one name component (a layer index); a key matches a module whose name ends with it, or the
module's ``.weight``.

Styles map onto `Style`; a style AutoTP does not know (or cannot honour, such as
``rowwise_split_input``, whose input arrives whole) refuses the plan as a whole, naming the
style: applying the rest could split one half of a column/row pair.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from deepshard.autotp._decision import Decision
from deepshard.autotp._plan_types import Style
from deepshard.interface.errors import ConfigError

__all__ = ["TP_PLAN_STYLES", "TpPlanSource", "hf_tp_plan"]

_KEY = "tensor_parallel.partition_config"

TP_PLAN_STYLES: dict[str, tuple[Style, bool]] = {
    "colwise": (Style.COLUMN, False),
    "local_colwise": (Style.COLUMN, False),
    "packed_colwise": (Style.COLUMN, False),
    "colwise_rep": (Style.COLUMN, True),
    "colwise_gather_output": (Style.COLUMN, True),
    "rowwise": (Style.ROW, False),
    "local_rowwise": (Style.ROW, False),
    "embedding_rowwise": (Style.VOCAB, False),
    "replicated_with_grad_allreduce": (Style.REPLICATE_GRAD_ALLREDUCE, False),
    "replicate": (Style.REPLICATE, False),
    "local": (Style.REPLICATE, False),
    "local_params": (Style.REPLICATE, False),
    "moe_tp_experts": (Style.REPLICATE, False),
}
"""The Hugging Face styles AutoTP honours: each one's style and whether it gathers the output.
(``local_*``: the same split without DTensor. ``rowwise_rep`` and ``rowwise_split_input`` are
not here: their input arrives whole, while a row-parallel layer takes the column shards.
``moe_tp_experts`` names a MoE block's experts container: AutoTP leaves the experts whole on
every TP rank (their input, the block's input, is whole there, so each rank computes the same
experts and gradients); splitting or spreading them is AutoEP's job (``expert_parallel``).)"""


def hf_tp_plan(model: torch.nn.Module) -> dict[str, str]:
    """The model's merged ``tp_plan``: config ``base_model_tp_plan``, class, then instance.

    Returns:
        Key → style, empty when the model carries none.
    """
    config = getattr(model, "config", None)
    merged: dict[str, str] = {}
    places: tuple[Any, ...] = (
        getattr(config, "base_model_tp_plan", None),
        getattr(type(model), "_tp_plan", None),
        vars(model).get("_tp_plan"),
    )
    for plan in places:
        if isinstance(plan, dict):
            merged.update({str(key): str(style) for key, style in plan.items()})
    return merged


def _key_regex(key: str) -> re.Pattern[str]:
    body = r"[^.]+".join(re.escape(piece) for piece in key.split("*"))
    return re.compile(rf"(?:.*\.)?{body}(?:\.weight)?")


@dataclass(frozen=True)
class _Entry:
    key: str
    style: Style
    gather_output: bool
    packed: bool
    regex: re.Pattern[str]


class TpPlanSource:
    """Decides modules from a Hugging Face ``tp_plan``.

    Raises:
        ConfigError: At construction, for a style AutoTP cannot apply.
    """

    def __init__(self, plan: dict[str, str]) -> None:
        unknown = sorted({style for style in plan.values() if style.lower() not in TP_PLAN_STYLES})
        if unknown:
            keys = [key for key, style in plan.items() if style in unknown]
            raise ConfigError(
                f"{_KEY}: the model's Hugging Face tp_plan uses style(s) {unknown} (for "
                f"{keys[:3]}) that AutoTP cannot apply, so the plan is refused whole; give "
                "tensor_parallel.partition_config.layer_specs or tensor_parallel.preset_model "
                "for this model",
                [(_KEY, f"tp_plan styles {unknown} are not supported")],
            )
        # Later keys override earlier ones (instance over class over config): match them first.
        self._entries = [
            _Entry(key, *TP_PLAN_STYLES[style.lower()], style.lower() == "packed_colwise",
                   _key_regex(key))
            for key, style in reversed(plan.items())
        ]  # fmt: skip

    def decide(self, name: str, module: torch.nn.Module) -> Decision | None:
        """The plan's decision for ``module``, or None when no key names it."""
        entry = next((e for e in self._entries if e.regex.fullmatch(name)), None)
        if entry is None:
            return None
        split = entry.style in (Style.COLUMN, Style.ROW)
        if split and not isinstance(module, torch.nn.Linear):
            return None  # tp_plan keys also name parameters of fused modules AutoEP owns
        if entry.style is Style.VOCAB and not isinstance(module, torch.nn.Embedding):
            return None
        parts = None
        weight = getattr(module, "weight", None)
        if entry.packed and isinstance(weight, torch.Tensor):
            rows = int(weight.shape[0])
            if rows % 2:
                raise ConfigError(
                    f"{_KEY}: tp_plan key {entry.key!r} packs gate and up in {name}, whose "
                    f"{rows} rows do not halve; give a layer spec for it",
                    [(_KEY, f"{name} cannot be packed_colwise")],
                )
            parts = (rows // 2, rows // 2)
        return Decision(entry.style, "tp_plan", _KEY, entry.gather_output, parts)
