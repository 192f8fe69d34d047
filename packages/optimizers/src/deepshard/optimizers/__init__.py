"""Optimizers and LR schedules (scaffold)."""

__all__: list[str] = []
