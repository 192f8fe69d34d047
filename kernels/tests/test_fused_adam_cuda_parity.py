"""On a GPU, the CUDA fused Adam kernel matches its torch twin (`reference_fused_adam_step`).

Skipped without a CUDA device, or when the package was built without the CUDA module. Every
case runs the kernel and the twin from the same start on the same device for 10 steps and
compares parameters and moments. They differ only in rounding: the kernel writes the first
moment as ``b1*m + (1-b1)*g`` where torch uses ``lerp`` and nvcc contracts to FMA. Moments are
compared tightly. Parameters are compared tightly for all but a handful of elements and loosely
(a fraction of one step, lr) for all: where ``g + wd*p`` nearly cancels (L2 mode), a one-ulp
difference in that sum meets ``m / (sqrt(v) + eps)`` with ``|g| ~ eps`` and legitimately moves
one element by part of a step. A wrong formula moves every element, by whole steps.

The cases cover what the launch tables must get right: empty tensors, sizes around the 64Ki
chunk, more tensors than one launch holds (48), a tensor longer than one launch (320 chunks)
surrounded by small ones, unaligned views (the kernel's scalar path), mixed gradient dtypes in
one call, a side stream, and a device other than the current one.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from deepshard.kernels import _fused_adam
from deepshard.kernels._fused_adam import (
    fused_adam_status,
    fused_adam_step,
    reference_fused_adam_step,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 10
LR = 1e-3
CHUNK = 65536  # kChunkElements in csrc/cuda/fused_adam.cu
LAUNCH_CHUNKS = 320  # kMaxBlocksPerLaunch
LAUNCH_TENSORS = 48  # kMaxTensorsPerLaunch

Lists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]
# Start params, per-step grads, start exp_avgs, start exp_avg_sqs.
Case = tuple[list[torch.Tensor], list[list[torch.Tensor]], list[torch.Tensor], list[torch.Tensor]]
HYPER = {"lr": LR, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


@pytest.fixture
def device() -> torch.device:
    """cuda:0, after checking that the compiled kernel (not the twin) will serve it."""
    compiled, reason = fused_adam_status()
    if not compiled:
        pytest.skip(f"the CUDA module is not built: {reason}")
    dev = torch.device("cuda", 0)
    module = _fused_adam.CUDA_EXTENSION.load()
    assert module is not None
    major, minor = torch.cuda.get_device_capability(dev)
    assert _fused_adam._architectures_cover(module.cuda_architectures, 10 * major + minor), (
        f"the module was built for {module.cuda_architectures}, which cannot run on this "
        f"sm_{major}{minor} GPU; rebuild with DEEPSHARD_CUDA_ARCHS={major}{minor}"
    )
    return dev


def _buffer(values: torch.Tensor, device: torch.device, offset: int) -> torch.Tensor:
    """`values` copied into fresh `device` storage that starts `offset` elements in.

    The caching allocator aligns storage to far more than 16 bytes, so offset 1 makes the
    tensor misaligned for the kernel's 16-byte (fp32) and 8-byte (bf16/fp16) vector loads.
    """
    storage = torch.empty(values.numel() + offset, dtype=values.dtype, device=device)
    return storage[offset:].copy_(values)


def _make_case(
    sizes: list[int],
    grad_dtypes: list[torch.dtype],
    device: torch.device,
    *,
    unaligned: bool = False,
    seed: int = 0,
) -> Case:
    """Tensor i gets grads of grad_dtypes[i % len]; `unaligned` misaligns a buffer of each."""
    gen = torch.Generator().manual_seed(seed)

    def offset(i: int) -> int:
        return i % 2 if unaligned else 0

    params = [
        _buffer(torch.randn(n, generator=gen), device, offset(i)) for i, n in enumerate(sizes)
    ]
    grads = [
        [
            _buffer(torch.randn(n, generator=gen).to(grad_dtypes[i % len(grad_dtypes)]), device,
                    offset(i + 1))
            for i, n in enumerate(sizes)
        ]
        for _ in range(STEPS)
    ]  # fmt: skip
    exp_avgs = [_buffer(torch.zeros(n), device, offset(i)) for i, n in enumerate(sizes)]
    exp_avg_sqs = [_buffer(torch.zeros(n), device, 1 if unaligned else 0) for n in sizes]
    return params, grads, exp_avgs, exp_avg_sqs


def _copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies that keep each tensor's alignment (storage offset)."""
    return [_buffer(t, t.device, t.storage_offset() % 4) for t in tensors]


def _run(step_fn: Callable[..., None], case: Case, steps: int = STEPS, **options: object) -> Lists:
    start_params, grads, start_avgs, start_sqs = case
    params, exp_avgs, exp_avg_sqs = _copy(start_params), _copy(start_avgs), _copy(start_sqs)
    for step, step_grads in enumerate(grads[:steps], start=1):
        step_fn(params, step_grads, exp_avgs, exp_avg_sqs, step=step, **HYPER, **options)
    return params, exp_avgs, exp_avg_sqs


def _assert_close(got: Lists, want: Lists) -> None:
    params, avgs, sqs = got
    torch.cuda.synchronize(params[0].device)
    for i, (g, w) in enumerate(zip(avgs + sqs, want[1] + want[2], strict=True)):
        torch.testing.assert_close(
            g, w, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"moment {i}: {m}"
        )
    for i, (g, w) in enumerate(zip(params, want[0], strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=LR / 20, msg=lambda m, i=i: f"param {i}: {m}")
        far = int((~torch.isclose(g, w, rtol=1e-5, atol=1e-6)).sum().item())
        assert far <= max(2, g.numel() // 100_000), f"param {i}: {far} of {g.numel()} differ"


def _assert_kernel_matches_twin(case: Case, **options: object) -> None:
    with warnings.catch_warnings():
        # A fallback to the twin warns; make that a failure, since this test is about the kernel.
        warnings.filterwarnings("error", message="fused_adam_step", category=RuntimeWarning)
        got = _run(fused_adam_step, case, **options)
    _assert_close(got, _run(reference_fused_adam_step, case, **options))


@pytest.mark.parametrize("adamw_mode", [True, False], ids=["adamw", "adam_l2"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.05], ids=["no_wd", "wd"])
@pytest.mark.parametrize("bias_correction", [True, False], ids=["bias_corr", "no_bias_corr"])
def test_kernel_matches_twin_across_sizes_and_grad_dtypes(
    device: torch.device, adamw_mode: bool, weight_decay: float, bias_correction: bool
) -> None:
    sizes = [7, 64, 0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 1_000_003, 3]
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    case = _make_case(sizes, dtypes, device)
    _assert_kernel_matches_twin(
        case, weight_decay=weight_decay, adamw_mode=adamw_mode, bias_correction=bias_correction
    )


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_handles_unaligned_views(device: torch.device, grad_dtype: torch.dtype) -> None:
    case = _make_case([5, 4099, 70_001, 12], [grad_dtype], device, unaligned=True, seed=1)
    assert any(p.data_ptr() % 16 != 0 for p in case[0])
    _assert_kernel_matches_twin(case, weight_decay=0.01, adamw_mode=True)


def test_kernel_spreads_many_tensors_over_launches(device: torch.device) -> None:
    gen = torch.Generator().manual_seed(2)
    sizes = torch.randint(1, 300, (5 * LAUNCH_TENSORS,), generator=gen).tolist()
    case = _make_case(sizes, [torch.bfloat16, torch.float32], device, seed=2)
    _assert_kernel_matches_twin(case, weight_decay=0.01, adamw_mode=False)


def test_kernel_splits_a_tensor_longer_than_one_launch(device: torch.device) -> None:
    long = LAUNCH_CHUNKS * CHUNK + CHUNK // 2 + 3
    sizes = [*([17] * (LAUNCH_TENSORS - 1)), long, 9, 2 * CHUNK + 5]
    case = _make_case(sizes, [torch.float16], device, seed=3)
    _assert_kernel_matches_twin(case, weight_decay=0.01, adamw_mode=True)


def test_kernel_runs_on_the_callers_stream(device: torch.device) -> None:
    case = _make_case([1_000_003, 33], [torch.bfloat16], device, seed=4)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        _assert_kernel_matches_twin(case, weight_decay=0.01, adamw_mode=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_kernel_runs_on_a_device_other_than_the_current_one(device: torch.device) -> None:
    other = torch.device("cuda", 1)
    case = _make_case([1_000_003, 70_000], [torch.float32], other, seed=5)
    with torch.cuda.device(0):
        _assert_kernel_matches_twin(case, weight_decay=0.01, adamw_mode=True)
        assert torch.cuda.current_device() == 0  # the kernel's device guard restored it


def test_kernel_step_replays_in_a_cuda_graph(device: torch.device) -> None:
    # Capture fails if the kernel launched anywhere but the capturing stream, so this also
    # proves the caller's stream is used. The step's scalars are baked into the graph.
    case = _make_case([1_000_003, 64, 7], [torch.bfloat16, torch.float32], device, seed=6)
    options = {"weight_decay": 0.01, "adamw_mode": True}
    _run(fused_adam_step, case, steps=1, **options)  # warm-up: loads the kernel outside capture
    params, exp_avgs, exp_avg_sqs = _copy(case[0]), _copy(case[2]), _copy(case[3])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_adam_step(params, case[1][0], exp_avgs, exp_avg_sqs, step=1, **HYPER, **options)
    torch.testing.assert_close(params, case[0], rtol=0, atol=0)  # capturing ran nothing
    graph.replay()
    _assert_close(
        (params, exp_avgs, exp_avg_sqs), _run(reference_fused_adam_step, case, 1, **options)
    )
