"""The inner optimizer steps masters in bounded views, bit for bit as it would step them whole;
an unpartitioned fp32 model is its own master.

* `master_views` cuts a partition into consecutive views of at most ``max_numel`` elements that
  share its storage and cover it exactly once (the partition itself when it fits).
* One ``run_on_mesh`` call on 2 ranks trains a 0.63M-parameter MLP (partitions of 0.32M elements,
  above `MASTER_VIEW_NUMEL`) for 3 steps at stages 0, 1 and 2 twice: with ``torch.optim.AdamW``,
  which ZeRO knows to be element-wise and hands views, and with an unmarked subclass allowed by
  ``zero_allow_untested_optimizer``, which ZeRO hands whole partitions. AdamW is element-wise,
  so the final parameters must be *equal*, bit for bit, and the views must be bounded.
* At stage 0 an fp32 model's master *is* its flat parameter buffer (no second copy:
  ``master_bytes() == 0``), while a bf16 model keeps an fp32 master.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.testing import run_on_mesh
from deepshard.zero._flat_params import MASTER_VIEW_NUMEL, master_views

WORLD = 2
STEPS = 3


class _UntestedAdamW(torch.optim.AdamW):
    """AdamW under another class: not known to ZeRO as element-wise."""


def test_master_views_cover_the_partition_once() -> None:
    master = torch.arange(10.0)
    assert master_views(master, 16) == [(master, 0, 10)]
    assert master_views(master, None) == [(master, 0, 10)]
    views = master_views(master, 4)
    assert [(lo, hi) for _, lo, hi in views] == [(0, 4), (4, 8), (8, 10)]
    for view, lo, hi in views:
        assert view.data_ptr() == master[lo:].data_ptr() and view.numel() == hi - lo


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(600, 700), torch.nn.Tanh(), torch.nn.Linear(700, 300)
    ).to(dtype)


def _train(group: Any, rank: int, stage: int, optimizer_cls: type) -> dict[str, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _model()
    zero = ZeroOptimizer(
        optimizer_cls(model.parameters(), lr=1e-3, weight_decay=0.1),
        group=group,
        config=ZeroConfig(stage=stage),
        gradient_clipping=1.0,
        zero_allow_untested_optimizer=True,
    )
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 600, generator=gen), torch.randn(8, 300, generator=gen)
        zero.backward(torch.nn.functional.mse_loss(model(x), y))
        zero.step()
    inner = [p for g in zero.param_groups for p in g["params"]]
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "inner_numels": [p.numel() for p in inner],
        "partition": zero.master_partitions[0].numel(),
        "state_bytes": zero.optimizer_state_bytes(),
    }


def _shared_master(group: Any) -> dict[str, Any]:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = _model(dtype)
        zero = ZeroOptimizer(
            torch.optim.AdamW(model.parameters()), group=group, config=ZeroConfig(stage=0)
        )
        master = zero.master_partitions[0]
        first = next(model.parameters())
        out[dtype] = {
            "shares": master.data_ptr() == first.data_ptr(),
            "master_bytes": zero.master_bytes(),
            "master_dtype": master.dtype,
        }
    return out


def _run(mesh: Any) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    results: dict[Any, Any] = {"shared": _shared_master(group)}
    for stage in (0, 1, 2):
        for cls in (torch.optim.AdamW, _UntestedAdamW):
            results[(stage, cls.__name__)] = _train(group, rank, stage, cls)
    return results


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return run_on_mesh(_run, WORLD, store_dir=tmp_path_factory.mktemp("views"), timeout_s=240)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_views_step_exactly_like_whole_partitions(
    per_rank: list[dict[Any, Any]], stage: int
) -> None:
    for results in per_rank:
        viewed, whole = results[(stage, "AdamW")], results[(stage, "_UntestedAdamW")]
        assert viewed["partition"] > MASTER_VIEW_NUMEL, "the partition must need several views"
        assert max(viewed["inner_numels"]) <= MASTER_VIEW_NUMEL
        assert sum(viewed["inner_numels"]) == viewed["partition"]
        assert whole["inner_numels"] == [whole["partition"]]
        assert viewed["state_bytes"] > whole["state_bytes"]  # one `step` scalar per view
        assert viewed["state_bytes"] - whole["state_bytes"] < 4 * len(viewed["inner_numels"]) + 1
        for a, b in zip(viewed["params"], whole["params"], strict=True):
            assert torch.equal(a, b)


def test_an_unpartitioned_fp32_model_is_its_own_master(per_rank: list[dict[Any, Any]]) -> None:
    for results in per_rank:
        fp32, bf16 = results["shared"][torch.float32], results["shared"][torch.bfloat16]
        assert fp32["shares"] and fp32["master_bytes"] == 0
        assert not bf16["shares"] and bf16["master_bytes"] > 0
        assert fp32["master_dtype"] == bf16["master_dtype"] == torch.float32
