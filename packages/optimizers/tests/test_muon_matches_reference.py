"""A plain (stage-0) Muon step equals a reference written here from the formulas.

Reference, per hidden matrix (a 4-D weight viewed as ``(out, rest)``, a 3-D one as a batch):
``m = b*m + (1-b)*g``; ``u = (1-b)*g + b*m``; ``X = u/||u||_F`` (transposed when tall), five
times ``A = X X^T; X = 3.4445 X + (-4.7750 A + 2.0315 A A) X``; ``p = p*(1-lr*wd) -
lr*sqrt(max(1, rows/cols))*X``. Every other parameter: Adam with betas (0.9, 0.95), eps 1e-10,
bias correction and decoupled decay. The Gram variant must reach the same matrix as the
standard iteration, so the fp64 standard iteration is its reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepshard.optimizers import Muon

A, B, C = 3.4445, -4.7750, 2.0315
SHAPES = {
    "layers.0.attn.weight": (16, 48),
    "layers.0.mlp.weight": (48, 16),
    "layers.0.conv.weight": (8, 3, 3, 3),
    "layers.0.experts.weight": (2, 8, 12),
    "embed_tokens.weight": (50, 16),
    "lm_head.weight": (50, 16),
    "layers.0.norm.weight": (16,),
    "layers.0.mlp.bias": (48,),
}
MUON_NAMES = {
    n for n, s in SHAPES.items() if len(s) >= 2 and "embed" not in n and "lm_head" not in n
}


def _ns_reference(update: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = update.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) + 1e-7)
    for _ in range(5):
        gram = x @ x.mT
        x = A * x + (B * gram + C * (gram @ gram)) @ x
    return x.mT if tall else x


def _muon_reference(p, g, m, *, lr, wd, beta, dtype):
    m = beta * m + (1 - beta) * g
    u = (1 - beta) * g + beta * m
    matrix = u.reshape(u.shape[0], -1) if u.ndim == 4 else u
    rows, cols = matrix.shape[-2:]
    ortho = _ns_reference(matrix, dtype).to(p.dtype) * math.sqrt(max(1.0, rows / cols))
    return p * (1 - lr * wd) - lr * ortho.reshape(p.shape), m


def _adam_reference(p, g, m, v, t, *, lr, wd, betas=(0.9, 0.95), eps=1e-10):
    m = betas[0] * m + (1 - betas[0]) * g
    v = betas[1] * v + (1 - betas[1]) * g * g
    m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
    return p * (1 - lr * wd) - lr * m_hat / (v_hat.sqrt() + eps), m, v


def _model(seed: int) -> dict[str, torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.nn.Parameter(torch.randn(s, generator=generator)) for n, s in SHAPES.items()}


# (method, reference dtype, max error, mean error). Gram runs in fp32 on the CPU, so the fp64
# reference bounds it tightly. Standard runs in bf16, where the reference's own rounding (its
# bf16 norm and products) differs from ours by ~1% of an update entry: three steps at lr 0.05
# drift ~6e-4 on average. A wrong formula (no Nesterov blend, no sqrt(rows/cols) scale) drifts
# ~3e-3 on average per step, so the bounds still tell them apart.
TOLERANCES = [("gram", torch.float64, 2e-5, 2e-6), ("standard", torch.bfloat16, 1e-2, 1.5e-3)]


@pytest.mark.parametrize(("ns_method", "ref_dtype", "atol", "mean_tol"), TOLERANCES)
def test_three_steps_equal_the_reference(ns_method, ref_dtype, atol, mean_tol) -> None:
    params = _model(0)
    start = {n: p.detach().clone() for n, p in params.items()}
    lrs = {"muon": 0.05, "adam": 0.01}
    optimizer = Muon(list(params.items()), muon_lr=lrs["muon"], adam_lr=lrs["adam"],
                     weight_decay=0.1, momentum=0.9, ns_method=ns_method)  # fmt: skip
    ref = {n: (start[n].clone(), torch.zeros(s), torch.zeros(s)) for n, s in SHAPES.items()}
    generator = torch.Generator().manual_seed(1)
    for t in range(1, 4):
        for name, param in params.items():
            grad = torch.randn(SHAPES[name], generator=generator)
            param.grad = grad
            p, m, v = ref[name]
            if name in MUON_NAMES:
                p, m = _muon_reference(p, grad, m, lr=0.05, wd=0.1, beta=0.9, dtype=ref_dtype)
            else:
                p, m, v = _adam_reference(p, grad, m, v, t, lr=0.01, wd=0.1)
            ref[name] = (p, m, v)
        optimizer.step()
    for name, param in params.items():
        tol = atol if name in MUON_NAMES else 1e-6
        torch.testing.assert_close(param.detach(), ref[name][0].float(), rtol=0, atol=tol)
        if name in MUON_NAMES:
            assert (param.detach() - ref[name][0]).abs().mean() < mean_tol
            momentum = optimizer.state[param]["momentum_buffer"]
            torch.testing.assert_close(momentum, ref[name][1], rtol=1e-6, atol=1e-6)


def test_step_is_orthogonalized_and_differs_from_sgd() -> None:
    generator = torch.Generator().manual_seed(2)
    left, _ = torch.linalg.qr(torch.randn(16, 16, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(48, 16, generator=generator))
    spectrum = torch.logspace(0, -2, 16)  # singular values from 1 down to 0.01
    grad = left @ torch.diag(spectrum) @ right.T
    weight = torch.nn.Parameter(torch.zeros(16, 48))
    weight.grad = grad.clone()
    Muon([("block.weight", weight)], lr=1.0, ns_method="gram").step()
    update = -weight.detach()
    sgd_like = (1 - 0.95) * grad + 0.95 * ((1 - 0.95) * grad)  # SGD with Nesterov momentum
    assert (update - sgd_like).abs().max() > 0.1
    singular = torch.linalg.svdvals(update.double())
    # Newton-Schulz with these coefficients lifts every singular value into about [0.6, 1.2]
    # (the smallest ones here start 100x below the largest and are still on their way up).
    assert singular.max() < 1.25 and singular.max() / singular.min() < 10, singular
    # ...while keeping the singular vectors: the update is left @ diag(s') @ right.T.
    in_basis = left.T.double() @ update.double() @ right.double()
    off_diagonal = in_basis - torch.diag(torch.diagonal(in_basis))
    assert off_diagonal.abs().max() < 1e-4


def test_gram_iteration_equals_standard_in_fp64() -> None:
    from deepshard.optimizers._newton_schulz import newton_schulz

    generator = torch.Generator().manual_seed(3)
    for shape in [(8, 100), (100, 8), (3, 16, 40), (24, 24)]:
        matrix = torch.randn(shape, generator=generator, dtype=torch.float64)
        gram = newton_schulz(matrix, method="gram", dtype=torch.float64)
        torch.testing.assert_close(gram, _ns_reference(matrix, torch.float64), rtol=0, atol=1e-12)
