"""`describe_plan`: a plan as text, one line per module (what the tests and users read)."""

from __future__ import annotations

import torch

from deepshard.autotp._plan import make_plan
from deepshard.autotp._plan_types import LayerPlan, TPPlan
from deepshard.interface.config import TensorParallelConfig

__all__ = ["PLAN_ATTRIBUTE", "describe_plan", "plan_of"]

PLAN_ATTRIBUTE = "_deepshard_tp_plan"
"""Where ``parallelize`` keeps the plan it applied, on the model itself (per model, so two
parallelized models never share one)."""


def plan_of(model: torch.nn.Module) -> TPPlan | None:
    """The plan ``parallelize`` applied to ``model``, or None for a plain model."""
    plan = vars(model).get(PLAN_ATTRIBUTE)
    return plan if isinstance(plan, TPPlan) else None


def _sizes_text(layer: LayerPlan) -> str:
    if not layer.sizes:
        return "-"
    if len(layer.sizes) == 1:
        return str(list(layer.sizes[0]))
    return "[" + ", ".join(str(list(part)) for part in layer.sizes) + "]"


def describe_plan(
    model_or_plan: torch.nn.Module | TPPlan,
    tp_size: int | None = None,
    config: TensorParallelConfig | None = None,
) -> str:
    """One line per module: its name, style, per-rank rows and where the decision came from.

    Args:
        model_or_plan: A plan; or a model, whose applied plan (`plan_of`) is described, or,
            for a plain model, the plan `make_plan` chooses for ``tp_size`` ranks.
        tp_size: Ranks to plan a plain model for.
        config: The ``tensor_parallel`` section to plan a plain model with.

    Returns:
        The text: a header line, then ``module  style  sizes  source`` columns; fused weights
        show one list of per-rank rows per sub-parameter.

    Raises:
        TypeError: For a plain model without ``tp_size``.
    """
    plan = model_or_plan if isinstance(model_or_plan, TPPlan) else plan_of(model_or_plan)
    if plan is None:
        if tp_size is None:
            raise TypeError(
                "describe_plan: this model was not parallelized; pass tp_size (and the "
                "tensor_parallel config) to describe the plan AutoTP would choose"
            )
        assert isinstance(model_or_plan, torch.nn.Module)
        plan = make_plan(model_or_plan, tp_size, config)
    rows = [
        (layer.module, layer.style.value + (" +gather" if layer.gather_output else ""),
         _sizes_text(layer), layer.source)
        for layer in plan.layers
    ]  # fmt: skip
    widths = [max((len(row[column]) for row in rows), default=0) for column in range(3)]
    lines = [f"AutoTP plan: tp_size={plan.tp_size}, {len(plan.layers)} modules"]
    lines += [
        "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
        + "  "
        + row[3]
        for row in rows
    ]
    return "\n".join(lines)
