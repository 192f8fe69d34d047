"""The Triton kernels of ``fused_weighted_sum`` equal the pure-torch twin, forward and backward.

Without a GPU they run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported, hence a fresh interpreter); with a CUDA device the registered op
itself is compared with the twin on the device.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton's interpreter runs the kernels with numpy, which deepshard-kernels does not declare.
HAS_NUMPY = importlib.util.find_spec("numpy") is not None

# Odd sizes on purpose: a hidden width that is not a power of two (masked column tails), a
# second column block in the forward, padding rows, and an index naming one row twice.
_SCRIPT = r"""
import torch
from deepshard.kernels import _weighted_sum as ws
from deepshard.kernels import _weighted_sum_triton as tk

torch.manual_seed(0)
for dtype, hidden in ((torch.float32, 40), (torch.bfloat16, 1100)):
    tokens, k = 6, 3
    rows = torch.randn(tokens * k + 2, hidden).to(dtype)
    scores = torch.rand(tokens, k)
    index = torch.randperm(tokens * k).view(tokens, k)
    index[5, 2] = index[0, 0]  # a repeated row: the backward must add, not overwrite
    grad_out = torch.randn(tokens, hidden).to(dtype)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    want_out = ws._twin_forward(rows, scores, index)
    torch.testing.assert_close(tk.forward(rows, scores, index), want_out, **tol)
    got = tk.backward(grad_out, rows, scores, index)
    want = ws._twin_backward(grad_out, rows, scores, index)
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], **tol)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-4)
    assert torch.count_nonzero(got[0][-2:]) == 0
print("ok")
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (it comes with CUDA wheels)")
@pytest.mark.skipif(not HAS_NUMPY, reason="Triton's interpreter needs numpy (not a kernels dep)")
def test_triton_kernels_equal_the_twin_in_the_interpreter() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.strip().endswith("ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_op_equals_the_twin_on_the_device() -> None:
    from deepshard.kernels import fused_weighted_sum, reference_fused_weighted_sum

    torch.manual_seed(1)
    rows = torch.randn(4096 * 2 + 8, 1536, device="cuda", dtype=torch.bfloat16)
    scores = torch.rand(4096, 2, device="cuda")
    index = torch.randperm(4096 * 2, device="cuda").view(4096, 2)
    grad_out = torch.randn(4096, 1536, device="cuda", dtype=torch.bfloat16)
    outs = []
    for fn in (fused_weighted_sum, reference_fused_weighted_sum):
        leaves = rows.clone().requires_grad_(), scores.clone().requires_grad_()
        out = fn(leaves[0], leaves[1], index)
        out.backward(grad_out)
        outs.append((out, leaves[0].grad, leaves[1].grad))
    for got, want in zip(outs[0], outs[1], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
