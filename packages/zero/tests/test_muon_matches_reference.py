"""Muon under ZeRO stages 0, 1 and 2 trains like plain Muon in one process on the whole batch, at
1, 2 and 4 ranks, with 1 and 4 accumulation steps, its matrices cut across ranks (see
`_muon_training`): Newton–Schulz must run on each matrix's full reduced gradient, once per step.

Tolerance, fp32: 1e-5 relative for parameters and norms. Only the summation order of the
gradient differs (ranks, micro-batches, buckets; a few ulps), and the Gram Newton–Schulz runs in
fp32 on CPU. Orthogonalizing a piece of a matrix instead of the whole, or once per micro-step,
or on an unreduced gradient, moves the parameters by O(lr) = 1e-2 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.testing import import_beside, run_on_mesh

_muon = import_beside(__file__, "_muon_training.py")

CONFIGS = [(stage, ga) for stage in (0, 1, 2) for ga in (1, 4)]


def _train_all(mesh: Any) -> dict[tuple[int, int], Any]:
    group = mesh["dp"]
    return {
        (stage, ga): _muon.train_zero(
            group,
            stage=stage,
            ga=ga,
            # one bucket holding all three matrices (ga 1), or one bucket each (ga 4, where
            # stage 2 also reduces asynchronously)
            reduce_bucket_size=2000 if ga == 1 else 600,
            allgather_bucket_size=500,
            overlap_comm=ga == 4,
        )
        for stage, ga in CONFIGS
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_muon_under_zero_matches_single_process_muon(world: int, tmp_path: Path) -> None:
    per_rank = run_on_mesh(_train_all, world, store_dir=tmp_path)
    ref = _muon.reference()
    assert min(ref["norms"]) > _muon.CLIP  # clipping is exercised at every step
    init = _muon._training.initial_params(torch.float32)
    for config in CONFIGS:
        results = [rank_results[config] for rank_results in per_rank]
        for other in results[1:]:  # every rank ends with the same model
            for a, b in zip(other["params"], results[0]["params"], strict=True):
                assert torch.equal(a, b), f"ranks disagree for {config}"
        got = results[0]
        norms = torch.tensor(got["norms"])
        assert _rel(norms, torch.tensor(ref["norms"])) < 1e-5, config
        for p, r, i in zip(got["params"], ref["params"], init, strict=True):
            assert _rel(p, r) < 1e-5, config
            assert _rel(r, i) > 1e-3  # every parameter moved
