"""pin_memory / pin_empty / pin_empty_like: shapes, dtypes, and when memory is really pinned."""

from __future__ import annotations

import pytest
import torch

from deepshard.accelerators import AcceleratorError, CpuAccelerator, CudaAccelerator

SHAPES = [(), (0,), (7,), (2, 3), (4, 1, 5)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool]


@pytest.fixture
def empty_calls(monkeypatch):
    """Record torch.empty's pin_memory flag, then allocate unpinned (no driver on CI)."""
    calls: list[bool] = []
    real_empty = torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        calls.append(pin_memory)
        return real_empty(*args, pin_memory=False, **kwargs)

    monkeypatch.setattr(torch, "empty", recording_empty)
    return calls


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pin_empty_has_the_shape_and_dtype_asked_for(shape, dtype):
    tensor = CpuAccelerator().pin_empty(*shape, dtype=dtype)
    assert tensor.shape == torch.Size(shape)
    assert tensor.dtype == dtype
    assert tensor.device == torch.device("cpu")
    assert tensor.is_contiguous()


@pytest.mark.parametrize("shape", [(2, 3), [2, 3], torch.Size([2, 3])])
def test_pin_empty_takes_the_shape_as_one_sequence_too(shape):
    assert CpuAccelerator().pin_empty(shape).shape == torch.Size([2, 3])


def test_pin_empty_uses_the_default_dtype():
    assert CpuAccelerator().pin_empty(3).dtype == torch.get_default_dtype()


@pytest.mark.parametrize("bad", [(-1,), (2, 1.5), (True,), ("3",)])
def test_pin_empty_rejects_bad_sizes(bad):
    with pytest.raises(AcceleratorError, match="non-negative ints"):
        CpuAccelerator().pin_empty(*bad)


def test_cpu_accelerator_returns_ordinary_memory(empty_calls):
    tensor = CpuAccelerator().pin_empty(4, dtype=torch.float16)
    assert empty_calls == [False]
    assert not tensor.is_pinned()


def test_device_accelerator_allocates_pinned_directly(empty_calls):
    CudaAccelerator().pin_empty(4, 2, dtype=torch.bfloat16)
    assert empty_calls == [True]


@pytest.mark.parametrize(
    "source",
    [
        torch.arange(6, dtype=torch.float64).reshape(2, 3),
        torch.ones(3, 4, dtype=torch.bfloat16).t(),  # non-contiguous source
        torch.zeros(0, 5, dtype=torch.int32),
    ],
)
def test_pin_empty_like_copies_shape_and_dtype(source):
    tensor = CpuAccelerator().pin_empty_like(source)
    assert tensor.shape == source.shape
    assert tensor.dtype == source.dtype
    assert tensor.is_contiguous()
    assert tensor.data_ptr() != source.data_ptr() or source.numel() == 0


def test_pin_empty_like_on_a_device_accelerator_asks_for_pinned(empty_calls):
    CudaAccelerator().pin_empty_like(torch.ones(2, 2))
    assert empty_calls == [True]


@pytest.mark.parametrize("method", ["pin_empty_like", "pin_memory"])
def test_non_cpu_tensor_is_rejected(method):
    on_meta = torch.empty(2, 2, device="meta")
    with pytest.raises(AcceleratorError, match=r"needs a CPU tensor, got one on meta") as caught:
        getattr(CpuAccelerator(), method)(on_meta)
    assert isinstance(caught.value, ValueError)


def test_sparse_tensor_is_rejected():
    with pytest.raises(AcceleratorError, match="dense"):
        CpuAccelerator().pin_empty_like(torch.eye(3).to_sparse())


def test_cpu_pin_memory_returns_the_tensor_itself():
    tensor = torch.ones(3)
    assert CpuAccelerator().pin_memory(tensor) is tensor


def test_device_pin_memory_copies_only_unpinned_tensors(monkeypatch):
    pinned_copy = torch.zeros(3)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: pinned_copy)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self is pinned_copy)
    source = torch.ones(3)
    accelerator = CudaAccelerator()
    assert accelerator.pin_memory(source) is pinned_copy
    assert accelerator.pin_memory(pinned_copy) is pinned_copy
