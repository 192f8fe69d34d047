"""The warning category AutoTP's planning decisions are reported under."""

from __future__ import annotations

__all__ = ["AutoTPWarning"]


class AutoTPWarning(UserWarning):
    """A plan decision the user should know about (overlapping specs, a tied LM head kept
    whole, more TP ranks than KV heads); filter it with ``warnings.filterwarnings``."""
