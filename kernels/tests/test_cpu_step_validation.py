"""Bad arguments to the CPU ops raise TypeError/ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

import deepshard.kernels as kernels
from deepshard.kernels import _extension

N = 32


def _adam_kwargs(**changes: object) -> dict[str, object]:
    kwargs: dict[str, object] = {
        "param": torch.zeros(N), "grad": torch.zeros(N), "exp_avg": torch.zeros(N),
        "exp_avg_sq": torch.zeros(N), "step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999,
        "eps": 1e-8, "weight_decay": 0.0,
    }  # fmt: skip
    kwargs.update(changes)
    return kwargs


F16, BF16, F64, I32 = torch.float16, torch.bfloat16, torch.float64, torch.int32


def _moments(dtype: torch.dtype) -> dict[str, object]:
    return {"exp_avg": torch.zeros(N, dtype=dtype), "exp_avg_sq": torch.zeros(N, dtype=dtype)}


CASES = [
    (
        {"param": torch.zeros(N, dtype=F64)},
        TypeError,
        "`param` must have dtype float32, bfloat16, float16, got float64",
    ),
    ({"param": [0.0] * N}, TypeError, "`param` must be a torch.Tensor, got list"),
    ({"grad": torch.zeros(N, dtype=I32)}, TypeError, "`grad` must have dtype float32, bfloat16"),
    ({"exp_avg_sq": torch.zeros(N + 1)}, ValueError, "`exp_avg_sq` has 33 elements but `param`"),
    ({"grad": torch.zeros(2 * N)[::2]}, ValueError, "`grad` must be contiguous"),
    ({"exp_avg": torch.zeros(N, device="meta")}, ValueError, "`exp_avg` must be on the CPU"),
    ({"exp_avg": torch.zeros(N, dtype=BF16)}, TypeError, "`exp_avg` and `exp_avg_sq` must have"),
    (
        _moments(F16),
        TypeError,
        "`exp_avg` must have dtype float32, bfloat16 for a float32 `param`, got float16",
    ),
    (
        {"param": torch.zeros(N, dtype=BF16), **_moments(F16)},
        TypeError,
        "`exp_avg` must have dtype float32, bfloat16 for a bfloat16 `param`, got float16",
    ),
    (
        {"param": torch.zeros(N, dtype=F16), **_moments(BF16)},
        TypeError,
        "`exp_avg` must have dtype float32, float16 for a float16 `param`, got bfloat16",
    ),
    (
        {"param": torch.zeros(N, dtype=BF16), "param_out": torch.zeros(N, dtype=F16)},
        TypeError,
        "a bfloat16 `param` is updated in place, so pass param_out=None",
    ),
    ({"param_out": torch.zeros(N)}, TypeError, "`param_out` must have dtype bfloat16, float16"),
    ({"step": 0}, ValueError, "`step` counts from 1"),
    ({"step": 1.0}, TypeError, "`step` must be an int"),
    ({"beta1": 1.0}, ValueError, r"`beta1` must be finite and in \[0.0, 1.0\)"),
    ({"lr": float("nan")}, ValueError, "`lr` must be finite"),
    ({"weight_decay": -0.1}, ValueError, "`weight_decay` must be finite and >= 0.0"),
    ({"num_threads": 0}, ValueError, "`num_threads` must be >= 1"),
]


@pytest.mark.parametrize(("changes", "error", "message"), CASES)
@pytest.mark.parametrize("step_fn", [kernels.cpu_adam_step, kernels.reference_adam_step])
def test_adam_refuses_bad_arguments(step_fn, changes, error, message):
    kwargs = _adam_kwargs(**changes)
    args = [kwargs.pop(name) for name in ("param", "grad", "exp_avg", "exp_avg_sq")]
    with pytest.raises(error, match=message):
        step_fn(*args, **kwargs)


def test_the_extension_refuses_type_combinations_no_path_implements():
    # Called directly (past the Python checks), the module must refuse rather than do nothing.
    extension = _extension.CPU_EXTENSION.get()
    if extension is None:
        pytest.skip(f"the compiled extension is unavailable: {_extension.CPU_EXTENSION.failure()}")
    p, m = torch.zeros(N, dtype=F16), torch.zeros(N, dtype=BF16)
    with pytest.raises(ValueError, match="param float16, grad float16, state bfloat16"):
        extension.lion_step(p.data_ptr(), 2, p.data_ptr(), 2, m.data_ptr(), 1, 0, 3, N, 1e-4,
                            0.9, 0.99, 0.0, 1)  # fmt: skip
    with pytest.raises(ValueError, match="unknown dtype code 7 for param"):
        extension.lion_step(p.data_ptr(), 7, p.data_ptr(), 2, m.data_ptr(), 1, 0, 3, N, 1e-4,
                            0.9, 0.99, 0.0, 1)  # fmt: skip


def test_lion_refuses_bad_arguments():
    p, g = torch.zeros(N), torch.zeros(N)
    with pytest.raises(ValueError, match="cpu_lion_step: `exp_avg` has 31 elements"):
        kernels.cpu_lion_step(p, g, torch.zeros(N - 1), lr=1e-4, beta1=0.9, beta2=0.99,
                              weight_decay=0.0)  # fmt: skip
    with pytest.raises(ValueError, match=r"cpu_lion_step: `beta2` must be finite and in"):
        kernels.reference_lion_step(p, g, torch.zeros(N), lr=1e-4, beta1=0.9, beta2=2.0,
                                    weight_decay=0.0)  # fmt: skip
