"""The CPU ops are torch.library custom ops that compose with torch.compile."""

from __future__ import annotations

import torch

import deepshard.kernels as kernels

ADAM = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _buffers(numel: int = 1000) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    p, g, m, v = (torch.randn(numel, generator=gen) for _ in range(4))
    return [p, g.to(torch.bfloat16), m, v.abs()]


def _adam_steps(p, g, m, v, out):
    for step in (1, 2, 3):
        kernels.cpu_adam_step(p, g, m, v, step=step, param_out=out, **ADAM)
    return p * 2  # something for the graph to return that depends on the updated param


def _lion_step(p, g, m):
    kernels.cpu_lion_step(p, g, m, lr=1e-4, beta1=0.9, beta2=0.99, weight_decay=0.1)
    return p + 1


def test_compiled_adam_equals_eager():
    eager, compiled = _buffers(), _buffers()
    out_eager, out_compiled = (
        torch.empty(1000, dtype=torch.float16),
        torch.empty(1000, dtype=torch.float16),
    )
    want = _adam_steps(*eager, out_eager)
    got = torch.compile(_adam_steps, backend="aot_eager", fullgraph=True)(*compiled, out_compiled)
    assert torch.equal(got, want)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(out_compiled, out_eager)


def test_compiled_lion_equals_eager():
    eager, compiled = _buffers()[:3], _buffers()[:3]
    want = _lion_step(*eager)
    got = torch.compile(_lion_step, backend="eager", fullgraph=True)(*compiled)
    assert torch.equal(got, want)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)


def test_ops_pass_torch_library_opcheck():
    p, g, m, v = _buffers(64)
    out = torch.empty(64, dtype=torch.bfloat16)
    adam_args = (p, g, m, v, out, 1, 1e-3, 0.9, 0.999, 1e-8, 0.01, True, True, None)
    torch.library.opcheck(torch.ops.deepshard.cpu_adam_step.default, adam_args)
    lion_args = (p, g, m, None, 1e-4, 0.9, 0.99, 0.1, 2)
    torch.library.opcheck(torch.ops.deepshard.cpu_lion_step.default, lion_args)
