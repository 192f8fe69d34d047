"""Newton–Schulz orthogonalization, the core of Muon, in two equivalent forms.

Muon replaces an update matrix ``G = U S V^T`` by (approximately) ``U V^T``. Newton–Schulz gets
there without an SVD: scale ``X = G / ||G||_F`` so every singular value is at most 1, then apply
the odd quintic ``X <- a X + b (X X^T) X + c (X X^T)^2 X`` five times. The coefficients
``(a, b, c) = (3.4445, -4.7750, 2.0315)`` maximize the slope at zero, which drives small
singular values towards 1 fast; they end up spread over roughly ``[0.7, 1.2]`` rather than
exactly 1, which does not hurt training. A tall matrix is transposed first, so ``X X^T`` is the
smaller of the two Gram matrices.

**Standard** iterates on ``X`` (``n x m``, ``n <= m``) and runs in bf16.

**Gram** (DeepSpeed's default, ``ns_method="gram"``) notices that every iterate is
``X_k = Q_k X_0`` with ``Q_k`` a polynomial in ``R_0 = X_0 X_0^T``, so it iterates on the small
``n x n`` matrices instead: with ``Z = b R + c R^2`` and ``P = a I + Z``, ``Q <- P Q`` and
``R <- P R P`` (``P`` commutes with ``R``), and multiplies by the ``n x m`` matrix only at the
end. Half-precision error grows in ``Q``, so after two iterations the method folds ``Q`` back
into ``X`` and starts again from the fresh ``R = X X^T``. It runs in fp16 on CUDA (more mantissa
than bf16, and the normalized values stay small) and in fp32 elsewhere; a square matrix gains
nothing and takes the standard iteration. Reference: T. Dao, "Gram Newton–Schulz" (2026).
"""

from __future__ import annotations

import torch

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "newton_schulz", "ns_compute_dtype"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
_GRAM_RESTART = 2
_NORM_EPS = 1e-7


def ns_compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in: bf16 (standard); fp16 on CUDA, else fp32 (gram)."""
    if method == "standard":
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" else torch.float32


def _normalized(matrix: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    return x / (x.norm(dim=(-2, -1), keepdim=True) + _NORM_EPS), tall


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = NS_COEFFICIENTS
    r = x @ x.mT
    q: torch.Tensor | None = None
    for i in range(steps):
        if i == _GRAM_RESTART and q is not None:
            x = q @ x
            r = x @ x.mT
            q = None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != _GRAM_RESTART:
            pr = a * r + z @ r
            r = a * pr + z @ pr
    return x if q is None else q @ x


def newton_schulz(
    matrix: torch.Tensor, *, steps: int = 5, method: str = "gram", dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Approximately orthogonalizes ``matrix`` (or each matrix of a batch).

    Args:
        matrix: A 2-D tensor, or a batch ``(..., rows, cols)``.
        steps: Number of iterations.
        method: ``"gram"`` or ``"standard"``.
        dtype: Dtype of the iteration; ``None`` uses `ns_compute_dtype`.

    Returns:
        The orthogonalized matrix, of ``matrix``'s shape, in the iteration dtype.
    """
    dtype = dtype or ns_compute_dtype(method, matrix.device)
    x, tall = _normalized(matrix, dtype)
    square = x.size(-2) == x.size(-1)
    x = _standard(x, steps) if method == "standard" or square else _gram(x, steps)
    return x.mT if tall else x
