"""Compiled DeepShard ops with a pure-torch twin for each (scaffold)."""

__all__: list[str] = []
