"""`Decision`: one plan source's verdict on one module, before shard sizes are computed."""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.autotp._plan_types import Style

__all__ = ["SPLIT_STYLES", "Decision"]

SPLIT_STYLES = frozenset({Style.COLUMN, Style.ROW, Style.VOCAB})
"""The styles that cut a weight (the others keep it whole)."""


@dataclass(frozen=True)
class Decision:
    """How a plan source wants one module treated."""

    style: Style
    """The style chosen."""

    source: str
    """Where it came from, as `LayerPlan.source` prints it."""

    key: str = "tensor_parallel"
    """The config key a user changes to override it (named in errors)."""

    gather_output: bool = False
    """COLUMN only: all-gather the output."""

    parts: tuple[int, ...] | None = None
    """Rows of each sub-parameter along the split dimension; None lets the architecture's
    fused layout decide (`deepshard.autotp._layout.fused_parts`)."""
