"""The machine-readable report every suite writes with ``--json PATH`` for `run.py`.

One shape for all suites, so `run.py` needs no knowledge of any suite's table:

- ``rows``: the ratios, each ``{"ours", "theirs", "measure", "ratios"}``; ``ratios`` holds one
  value per interleaved round where the suite pairs rounds (so min/median/max show how much the
  machine's noise moved it), else the single ratio the suite printed.
- ``figures``: each competitor's own numbers, ``{"time_s": [...], "peak_mib": float | None}``
  plus optional labels (``stage``), so DeepShard's figures survive a missing competitor.
- ``missing``: competitors that could not run here, each with the reason.

Plain data and the standard library only: the suites import it before torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def ratio_row(ours: str, theirs: str, measure: str, ratios: list[float]) -> dict[str, Any]:
    """One ratio of the table: ``ours`` / ``theirs`` in ``measure`` (lower is better)."""
    return {"ours": ours, "theirs": theirs, "measure": measure, "ratios": list(ratios)}


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """Round-by-round ratios of two equally long series of one measure."""
    if len(ours) != len(theirs):
        raise ValueError(f"paired_ratios: {len(ours)} rounds against {len(theirs)}")
    return [a / b for a, b in zip(ours, theirs, strict=True) if b]


def write(
    path: Path | None,
    suite: str,
    rows: list[dict[str, Any]],
    figures: dict[str, dict[str, Any]],
    missing: dict[str, str] | None = None,
) -> None:
    """Writes the report to ``path`` (nothing when the suite was run without ``--json``)."""
    if path is None:
        return
    report = {"suite": suite, "rows": rows, "figures": figures, "missing": missing or {}}
    Path(path).write_text(json.dumps(report, indent=1))
