"""The MPS kernel of ``deepshard::fused_adam_step``: dispatch, fallback, and parity where MPS is.

No Mac is needed for the first tests: they check that the op has an MPS kernel, that CPU tensors
never reach it, that it falls back to the twin (same bits) when the Metal library cannot be
built, and that the source compiles or is refused with the reason. The parity test runs only
where ``torch.backends.mps.is_available()`` (the macOS workflow).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from deepshard.kernels import _extension, _mps_adam
from deepshard.kernels._fused_adam import fused_adam_step, reference_fused_adam_step

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05}
MPS = torch.backends.mps.is_available()


def _case(device: str, grad_dtype: torch.dtype, seed: int = 0) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(33,), (4, 5), (0,), (1000,)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen).to(grad_dtype) for s in shapes]
    moments = [torch.randn(s, generator=gen) * 0.1 for s in shapes]
    squares = [torch.rand(s, generator=gen) * 0.01 for s in shapes]
    return [[t.to(device) for t in ts] for ts in (params, grads, moments, squares)]


def _flat(lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [tensor for tensors in lists for tensor in tensors]


def test_the_op_has_an_mps_kernel() -> None:
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("deepshard::fused_adam_step", "MPS")


def test_cpu_tensors_do_not_reach_the_mps_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> None:
        raise AssertionError("the MPS shader was asked for on CPU tensors")

    monkeypatch.setattr(_mps_adam, "MPS_SHADERS", _extension.ExtensionLoader("x", importer=refuse))
    ours, twin = _case("cpu", torch.bfloat16), _case("cpu", torch.bfloat16)
    fused_adam_step(*ours, step=3, **HYPER)
    reference_fused_adam_step(*twin, step=3, **HYPER)
    for a, b in zip(_flat(ours), _flat(twin), strict=True):
        assert torch.equal(a, b)


def test_without_the_metal_library_the_kernel_runs_the_twin(monkeypatch) -> None:
    # Call the MPS kernel itself (CPU tensors stand in: no Mac here) with a library that fails.
    def broken() -> None:
        raise RuntimeError("Metal compiler refused the source (test)")

    missing = _extension.ExtensionLoader("metal (test)", hint="fix it", importer=broken)
    monkeypatch.setattr(_mps_adam, "MPS_SHADERS", missing)
    for adamw_mode in (True, False):
        ours, twin = _case("cpu", torch.float16, 1), _case("cpu", torch.float16, 1)
        _mps_adam.mps_fused_adam(*ours, 2, *HYPER.values(), adamw_mode, True)
        reference_fused_adam_step(*twin, step=2, adamw_mode=adamw_mode, **HYPER)
        for a, b in zip(_flat(ours), _flat(twin), strict=True):
            assert torch.equal(a, b)
    assert "Metal compiler refused the source (test)" in missing.failure_with_hint()


def test_the_shader_compiles_or_is_refused_with_the_reason() -> None:
    names = set(re.findall(r'DS_ADAM\(\w+, "(\w+)"', _mps_adam.MPS_ADAM_SOURCE))
    # Every entry point _launch can ask for is instantiated in the source.
    wanted = {f"adam_step_{g}_{k}" for g in ("float", "half") for k in ("adamw", "l2")}
    assert names == wanted
    if not MPS:
        with pytest.raises(RuntimeError, match="MPS is not available"):
            _mps_adam.compile_mps_adam()
        return
    library = _mps_adam.compile_mps_adam()
    for name in wanted:
        assert hasattr(library, name), name


@pytest.mark.skipif(not MPS, reason="needs an Apple-silicon GPU (torch.backends.mps)")
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_metal_kernel_matches_the_twin(grad_dtype: torch.dtype, adamw_mode: bool) -> None:
    got, want = _case("mps", grad_dtype, 2), _case("cpu", grad_dtype, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback here would be a failure
        for step in (1, 2, 3):
            fused_adam_step(*got, step=step, adamw_mode=adamw_mode, **HYPER)
            reference_fused_adam_step(*want, step=step, adamw_mode=adamw_mode, **HYPER)
    assert _mps_adam.MPS_SHADERS.load() is not None
    for a, b in zip(_flat(got), _flat(want), strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-6)
