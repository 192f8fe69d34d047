"""DeepSpeed spellings of floating-point types, normalised to ``fp32``, ``fp16``, ``bf16``."""

from __future__ import annotations

from typing import Any, Literal

__all__ = ["DtypeName", "normalize_dtype"]

DtypeName = Literal["fp32", "fp16", "bf16"]
"""The canonical names DeepShard stores; consumers map them to ``torch`` dtypes."""

_SYNONYMS = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
}


def normalize_dtype(value: Any) -> Any:
    """Maps any DeepSpeed spelling of a float type (any case) to its canonical name.

    Args:
        value: The raw config value.

    Returns:
        ``"fp32"``, ``"fp16"`` or ``"bf16"`` for a known spelling; anything else unchanged, so
        that validation reports it with the accepted values.
    """
    if isinstance(value, str):
        return _SYNONYMS.get(value.strip().lower(), value)
    return value
