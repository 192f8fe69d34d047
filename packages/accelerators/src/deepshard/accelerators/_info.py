"""Versions of torch and its device stack, tolerant of builds that lack parts of it."""

from __future__ import annotations

import torch

__all__ = ["torch_info"]

# What a torch build missing a component raises when asked for that component's version.
_LOOKUP_ERRORS = (AttributeError, ImportError, RuntimeError, TypeError, ValueError)


def _nccl_version() -> str | None:
    """NCCL's version as ``"major.minor.patch"``, or ``None`` if this torch build has no NCCL.

    ``torch.cuda.nccl.version()`` raises on CPU-only and some source builds, and returns a tuple
    of ints (an int in old releases); all are normalised here.
    """
    try:
        version = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except _LOOKUP_ERRORS:
        return None
    if isinstance(version, tuple):
        return ".".join(str(part) for part in version)
    return str(version)


def _version_attr(name: str) -> str | None:
    """``torch.version.<name>`` as a string, or ``None`` when the build lacks it or it is unset."""
    try:
        value = getattr(torch.version, name)
    except _LOOKUP_ERRORS:
        return None
    return None if value is None else str(value)


def torch_info() -> dict[str, str | None]:
    """Versions of torch, CUDA, HIP and NCCL.

    Returns:
        A dict with the keys ``"torch"``, ``"cuda"``, ``"hip"`` and ``"nccl"``. Every value but
        ``"torch"`` is ``None`` when this build lacks that component or cannot report its version.
    """
    return {
        "torch": str(torch.__version__),
        "cuda": _version_attr("cuda"),
        "hip": _version_attr("hip"),
        "nccl": _nccl_version(),
    }
