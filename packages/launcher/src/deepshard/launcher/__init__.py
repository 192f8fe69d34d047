"""The ``ds-launch`` launcher (scaffold)."""

__all__: list[str] = []
