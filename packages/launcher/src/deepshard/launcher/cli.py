"""The ``ds-launch`` command line (scaffold)."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``ds-launch``."""
    raise SystemExit("ds-launch: not built yet")
