"""Two DistributedAttention instances with different KV head counts in one process.

DeepSpeed once kept the KV head count process-wide, so building a second model changed how the
first split its GQA queries (v0.19.7, #8316). Here instance A has 2 KV heads (given), instance B
4 KV heads (read from `k.shape`); their forwards and backwards are interleaved (A, B forward;
B, A backward) on 2 gloo ranks, and each must still equal its single-process reference.
"""

from __future__ import annotations

from typing import Any

import torch

from deepshard.sequence_parallel import DistributedAttention
from deepshard.testing import import_beside

_cases = import_beside(__file__, "_attention_cases.py")

A = (11, 8, 2, 0)  # (seed, query heads, KV heads, batch_dim_idx)
B = (12, 8, 4, 1)


def _rank_body(mesh: Any) -> list[dict[str, torch.Tensor]]:
    rank, group = mesh.get_rank(), mesh["dp"]
    attn_a = DistributedAttention(_cases.sdpa_local, group, num_kv_heads=2)
    attn_b = DistributedAttention(_cases.sdpa_local, group)
    xs = [_cases.shard_inputs(_cases.inputs(*case[:3]), case[3], rank, 2) for case in (A, B)]
    outs = [
        attn(x["q"], x["k"], x["v"], case[3], case[3])
        for attn, x, case in ((attn_a, xs[0], A), (attn_b, xs[1], B))
    ]
    outs[1].backward(xs[1]["go"])
    outs[0].backward(xs[0]["go"])
    return [
        {"out": o.detach(), "dq": x["q"].grad, "dk": x["k"].grad, "dv": x["v"].grad}
        for o, x in zip(outs, xs, strict=True)
    ]


def test_each_instance_matches_its_reference(run_on_mesh: Any) -> None:
    results = run_on_mesh(_rank_body, 2)
    for index, (seed, hq, hkv, bdi) in enumerate((A, B)):
        ref = _cases.reference(_cases.inputs(seed, hq, hkv), bdi)
        for rank in range(2):
            want = _cases.expected_shard(ref, bdi, rank, 2)
            for name, tensor in want.items():
                got = results[rank][index][name]
                torch.testing.assert_close(got, tensor, rtol=0.0, atol=1e-12, msg=f"{index} {name}")
