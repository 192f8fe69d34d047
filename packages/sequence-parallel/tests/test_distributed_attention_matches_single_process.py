"""DistributedAttention on 2 and 4 gloo ranks equals one process on the full sequence.

fp64, q `[2, 8, 8, 16]` with k/v `[2, 8, 2, 16]` (GQA, 8 query / 2 KV heads), causal SDPA as
the local attention, batch-first and seq-first; each rank feeds its sequence shard and must
reproduce its slice of the output and of dq/dk/dv under a random upstream gradient to 1e-12.
On 4 ranks the 2 KV heads are replicated. Uneven heads: 6 query / 3 KV heads on 2 ranks.
Each world size is one run of ranks that computes every case (processes are the slow part).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.sequence_parallel import DistributedAttention
from deepshard.testing import import_beside, run_on_mesh

_cases = import_beside(__file__, "_attention_cases.py")

# (seed, query heads, KV heads, batch_dim_idx)
CASES_2 = [(1, 8, 2, 0), (2, 8, 2, 1), (3, 6, 3, 0), (4, 6, 3, 1)]
CASES_4 = [(5, 8, 2, 0), (6, 8, 2, 1)]
TOL = {"rtol": 0.0, "atol": 1e-12}


def _run_case(attn: DistributedAttention, case: tuple[int, int, int, int], rank: int) -> Any:
    seed, hq, hkv, bdi = case
    x = _cases.shard_inputs(_cases.inputs(seed, hq, hkv), bdi, rank, attn.world_size)
    out = attn(x["q"], x["k"], x["v"], bdi, bdi)
    out.backward(x["go"])
    return {"out": out.detach(), "dq": x["q"].grad, "dk": x["k"].grad, "dv": x["v"].grad}


def _rank_body(mesh: Any, cases: list[tuple[int, int, int, int]]) -> list[Any]:
    attn = DistributedAttention(_cases.sdpa_local, mesh["dp"])
    return [_run_case(attn, case, mesh.get_rank()) for case in cases]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Any]]:
    runs: dict[int, list[Any]] = {}
    for world, cases in ((2, CASES_2), (4, CASES_4)):
        store: Path = tmp_path_factory.mktemp(f"world{world}")
        runs[world] = run_on_mesh(_rank_body, world, args=(cases,), store_dir=store)
    return runs


def _check(results: dict[int, list[Any]], world: int, index: int, case: Any) -> None:
    seed, hq, hkv, bdi = case
    ref = _cases.reference(_cases.inputs(seed, hq, hkv), bdi)
    for rank in range(world):
        got = results[world][rank][index]
        want = _cases.expected_shard(ref, bdi, rank, world)
        for name in ("out", "dq", "dk", "dv"):
            assert got[name].shape == want[name].shape, (rank, name)
            torch.testing.assert_close(got[name], want[name], **TOL, msg=f"rank {rank} {name}")
        assert got["dq"].abs().sum() > 0 and got["dk"].abs().sum() > 0


@pytest.mark.parametrize(("index", "case"), list(enumerate(CASES_2)))
def test_two_ranks_exact(results: dict[int, list[Any]], index: int, case: Any) -> None:
    _check(results, 2, index, case)


@pytest.mark.parametrize(("index", "case"), list(enumerate(CASES_4)))
def test_four_ranks_replicated_kv_exact(
    results: dict[int, list[Any]], index: int, case: Any
) -> None:
    _check(results, 4, index, case)


def test_seq_first_output_keeps_seq_first_shape(results: dict[int, list[Any]]) -> None:
    # The v0.19.7 bug #8317 returned the seq-first result in the batch-first layout.
    for rank in range(2):
        assert tuple(results[2][rank][1]["out"].shape) == (4, 2, 8, 16)
        assert tuple(results[2][rank][0]["out"].shape) == (2, 4, 8, 16)
