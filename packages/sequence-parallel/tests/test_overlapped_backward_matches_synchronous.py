"""`overlap=True` gives the synchronous path's gradients, however q and k were produced.

The overlapped backward launches the q/k gradient exchanges asynchronously and finishes them in
tensor hooks (DeepSpeed's version permuted these gradients wrongly, v0.19.7 #8342). q/k/v come
from a transpose, a view, `unbind` of a packed QKV, or are leaf tensors, in both layouts; one
case also uses q outside the attention, so autograd sums two gradients into it. The gradients
of the source tensors must be identical with and without overlap (the synchronous path is
checked against one process in test_distributed_attention_matches_single_process.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.sequence_parallel import DistributedAttention
from deepshard.testing import import_beside

_cases = import_beside(__file__, "_attention_cases.py")

B, S, H, D = 2, 4, 4, 8  # per-rank sequence shard of 4 on 2 ranks
Sources = dict[str, torch.Tensor]
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _sources(kind: str, bdi: int, seed: int) -> Sources:
    gen = torch.Generator().manual_seed(seed)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

    local = (B, S) if bdi == 0 else (S, B)
    if kind == "transpose":  # stored [A, h, B', d] and transposed into the layout
        return {n: leaf(local[0], H, local[1], D) for n in "qkv"}
    if kind == "view":  # projected [A, B', h * d] and viewed as heads
        return {n: leaf(*local, H * D) for n in "qkv"}
    if kind == "unbind":  # one packed [A, B', 3, h, d] tensor
        return {"qkv": leaf(*local, 3, H, D)}
    return {n: leaf(*local, H, D) for n in "qkv"}


def _qkv(kind: str, src: Sources) -> QKV:
    if kind == "transpose":
        return src["q"].transpose(1, 2), src["k"].transpose(1, 2), src["v"].transpose(1, 2)
    if kind == "view":
        return tuple(src[n].view(*src[n].shape[:2], H, D) for n in "qkv")  # type: ignore[return-value]
    if kind == "unbind":
        q, k, v = src["qkv"].unbind(2)
        return q, k, v
    return src["q"], src["k"], src["v"]


def _grads(attn: DistributedAttention, kind: str, bdi: int, seed: int, extra_use: bool) -> Any:
    src = _sources(kind, bdi, seed)
    q, k, v = _qkv(kind, src)
    out = attn(q, k, v, bdi, bdi)
    gen = torch.Generator().manual_seed(seed + 1)
    loss = (out * torch.randn(out.shape, generator=gen, dtype=out.dtype)).sum()
    if extra_use:  # q also feeds another op: its two gradients are summed after the hook
        loss = loss + (q.sin() * 3.0).sum()
    loss.backward()
    return {n: t.grad for n, t in src.items()}, _has_async_node(out.grad_fn)


def _has_async_node(fn: Any) -> bool:
    seen, stack = set(), [fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "AsyncGrad" in type(node).__name__:
            return True
        stack.extend(next_fn for next_fn, _ in node.next_functions)
    return False


CASES = [
    ("transpose", 0, False),
    ("transpose", 1, True),
    ("view", 0, True),
    ("view", 1, False),
    ("unbind", 0, False),
    ("unbind", 1, True),
    ("leaf", 0, True),
    ("leaf", 1, False),
]


def _rank_body(mesh: Any) -> list[Any]:
    group = mesh["dp"]
    sync = DistributedAttention(_cases.sdpa_local, group)
    overlapped = DistributedAttention(_cases.sdpa_local, group, overlap=True)
    results = []
    for index, (kind, bdi, extra) in enumerate(CASES):
        seed = 100 * index + mesh.get_rank()
        pair = (_grads(sync, kind, bdi, seed, extra), _grads(overlapped, kind, bdi, seed, extra))
        results.append(pair)
    return results


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from deepshard.testing import run_on_mesh

    return run_on_mesh(_rank_body, 2, store_dir=tmp_path_factory.mktemp("overlap"))


@pytest.mark.parametrize(("index", "case"), list(enumerate(CASES)))
def test_overlap_gradients_equal_synchronous(results: list[Any], index: int, case: Any) -> None:
    for rank in range(2):
        (sync, sync_async), (over, over_async) = results[rank][index]
        assert not sync_async and over_async, "the overlapped path was not taken"
        assert sync.keys() == over.keys()
        for name in sync:
            assert sync[name].abs().sum() > 0
            torch.testing.assert_close(over[name], sync[name], rtol=0.0, atol=0.0, msg=name)
