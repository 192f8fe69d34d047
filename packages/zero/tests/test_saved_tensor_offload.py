"""`offload_saved_tensors`: saved activations go to the host once per storage, gradients unchanged.

Every test runs one forward and backward in this process (the host is the device here, so the
same copies are made as on an accelerator). Gradients are compared bit for bit with the same
computation run without the context; the view rule is checked through the context's stats and
through what the saved tensors' storages are after the forward.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from deepshard.interface.errors import ConfigError
from deepshard.zero import OffloadStats, offload_saved_tensors


def _grads(model: torch.nn.Module, x: torch.Tensor, run: Callable[[], torch.Tensor]) -> list:
    model.zero_grad(set_to_none=True)
    x.grad = None
    run().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]


def _assert_bit_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


class _Attention(torch.nn.Module):
    """One self-attention block: fused qkv split into views, heads by transposed views."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
        y = scores.softmax(-1) @ v
        return x + self.out(y.transpose(1, 2).reshape(b, s, d))


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.Tanh()
    )


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_gradients_equal_those_without_the_context(name: str) -> None:
    torch.manual_seed(0)
    model, x = (
        (_mlp(), torch.randn(8, 16)) if name == "mlp" else (_Attention(), torch.randn(2, 6, 32))
    )
    x.requires_grad_(True)
    want = _grads(model, x, lambda: model(x).square().mean())
    offload = offload_saved_tensors(min_numel=0)

    def run() -> torch.Tensor:
        with offload:
            return model(x).square().mean()

    _assert_bit_equal(_grads(model, x, run), want)
    stats = offload.stats
    assert stats.host_copies > 0 and stats.offloaded > 0
    assert stats.restored_copies == stats.host_copies  # each copy came back once
    assert stats.restored_bytes == stats.host_bytes
    assert stats.saved == stats.offloaded + stats.kept_parameters  # nothing else was kept
    if name == "attention":
        assert stats.shared > 0  # q, k, v (and their head views) share the qkv storage


def _plain_grad(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The gradient of ``fn`` at ``x`` computed without the context (the reference)."""
    (grad,) = torch.autograd.grad(fn(x), x)
    return grad


def test_two_saved_views_of_one_storage_make_one_host_copy() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        h = x * 2  # mul by a number saves nothing; h is a fresh 8x6 storage
        left, right = h[:, :3], h[:, 3:]  # two views of h's storage, saved by sin and cos
        return (left.sin() + right.cos()).sum()

    x = torch.randn(8, 6, requires_grad=True)
    with offload_saved_tensors(min_numel=0) as offload:
        y = fn(x)
    stats = offload.stats
    assert (stats.saved, stats.offloaded, stats.shared) == (2, 2, 1)
    assert stats.host_copies == 1
    assert stats.host_bytes == x.numel() * x.element_size()  # h's storage (x's shape), once
    (got,) = torch.autograd.grad(y, x)
    assert torch.equal(got, _plain_grad(fn, x))
    assert offload.stats.restored_copies == 1  # both views came back from one restored copy


def test_a_view_that_is_the_sole_holder_of_its_storage_is_offloaded() -> None:
    x = torch.randn(5, 7, requires_grad=True)
    with offload_saved_tensors(min_numel=0) as offload:
        h = x * 2
        view = h.t()  # after `del h` only this view (saved by sin) holds h's storage
        device_storage = StorageWeakRef(view.untyped_storage())
        y = view.sin().sum()
        del h, view
    stats = offload.stats
    assert (stats.saved, stats.offloaded, stats.shared, stats.host_copies) == (1, 1, 0, 1)
    assert stats.host_bytes == x.numel() * x.element_size()
    # The saved graph holds only the host copy: the original storage is freed.
    assert device_storage.expired()
    (got,) = torch.autograd.grad(y, x)
    assert torch.equal(got, _plain_grad(lambda t: (t * 2).t().sin().sum(), x))


def test_parameters_and_their_views_stay_where_they_are() -> None:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 4))
    frozen = torch.nn.Parameter(torch.randn(6, 3), requires_grad=False)
    x = torch.randn(2, 6, requires_grad=True)

    def fn(t: torch.Tensor) -> torch.Tensor:
        y = (t * 2) @ weight  # saves t * 2 (offloaded) and weight (kept)
        z = y @ weight.t()  # saves y (offloaded) and a view of weight (kept)
        return z @ frozen  # saves frozen (kept); z is not saved, frozen needs no grad

    with offload_saved_tensors(min_numel=0) as offload:
        out = fn(x)
    stats = offload.stats
    assert (stats.saved, stats.kept_parameters, stats.host_copies) == (5, 3, 2)
    grad_fn = out.grad_fn
    assert grad_fn is not None
    assert grad_fn._saved_mat2.data_ptr() == frozen.data_ptr()  # type: ignore[attr-defined]
    inner = grad_fn.next_functions[0][0]
    assert inner._saved_mat2.data_ptr() == weight.data_ptr()  # type: ignore[union-attr]
    assert inner._saved_self.data_ptr() != out.data_ptr()  # type: ignore[union-attr]
    got = torch.autograd.grad(out.sum(), (x, weight))
    want = torch.autograd.grad(fn(x).sum(), (x, weight))
    _assert_bit_equal(list(got), list(want))


def test_small_storages_stay_and_no_grad_saves_nothing() -> None:
    x = torch.randn(4, 4, requires_grad=True)
    with offload_saved_tensors(min_numel=17) as offload:
        y = (x * 2).sin().sum()  # 16 elements: below min_numel
    with offload_saved_tensors() as idle, torch.no_grad():
        (x * 2).sin()
    assert offload.stats == OffloadStats(saved=1, kept_small=1)
    assert idle.stats == OffloadStats()
    y.backward()
    assert torch.equal(x.grad, (2 * (x * 2).cos()).detach())


def test_a_storage_written_after_a_view_was_saved_is_copied_again() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with offload_saved_tensors(min_numel=0) as offload:
        buffer = torch.zeros(2, 4, 8)
        buffer[0] = x * 2
        first = buffer[0].sin()  # saves a view of buffer at version 1
        buffer[1] = x * 3  # in place: version 2, the first copy has zeros here
        second = buffer[1].sin()
        y = (first + second).sum()
    assert offload.stats.host_copies == 2
    y.backward()
    expected = 2 * (2 * x).cos() + 3 * (3 * x).cos()
    assert torch.equal(x.grad, expected.detach())


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_inside_the_context(reentrant: bool) -> None:
    torch.manual_seed(0)
    stem, block = torch.nn.Linear(16, 32), _mlp_block()
    model = torch.nn.ModuleList([stem, block])
    x = torch.randn(8, 16, requires_grad=True)

    def run() -> torch.Tensor:
        h = stem(x)
        return checkpoint(block, h, use_reentrant=reentrant).square().mean()

    want = _grads(model, x, run)
    offload = offload_saved_tensors(min_numel=0)

    def offloaded() -> torch.Tensor:
        with offload:
            return run()

    _assert_bit_equal(_grads(model, x, offloaded), want)
    _assert_bit_equal(want, _grads(model, x, lambda: block(stem(x)).square().mean()))
    if reentrant:
        assert offload.stats.host_copies >= 1  # the checkpoint's input h went to the host


def _mlp_block() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))


def test_nested_contexts_each_pack_and_unpack_their_own() -> None:
    x = torch.randn(6, 6, requires_grad=True)
    want = torch.autograd.grad(((x * 2).sin() * 3).exp().sum(), x)[0]
    with offload_saved_tensors(min_numel=0) as outer:
        h = (x * 2).sin()  # saves x * 2
        with offload_saved_tensors(min_numel=0) as inner:
            y = (h * 3).exp().sum()  # saves exp's result
    (got,) = torch.autograd.grad(y, x, retain_graph=True)
    assert torch.equal(got, want)
    assert (outer.stats.host_copies, inner.stats.host_copies) == (1, 1)
    assert (outer.stats.restored_copies, inner.stats.restored_copies) == (1, 1)
    (again,) = torch.autograd.grad(y, x)  # a retained graph restores from the host again
    assert torch.equal(again, want)
    assert inner.stats.restored_copies == 2


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"device": "meta"}, "device="),
        ({"device": "no-such-device"}, "device="),
        ({"pin_memory": "yes"}, "pin_memory="),
        ({"min_numel": -1}, "min_numel="),
        ({"min_numel": 1.5}, "min_numel="),
    ],
)
def test_bad_arguments_are_config_errors_naming_the_argument(kwargs: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        offload_saved_tensors(**kwargs)
