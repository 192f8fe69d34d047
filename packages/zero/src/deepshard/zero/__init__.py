"""ZeRO (scaffold)."""

__all__: list[str] = []
