"""`ZeroOptimizer.set_boundary` lets plain ``loss.backward()`` passes follow an accumulation cycle.

One ``run_on_mesh`` call on 2 ranks trains the MLP with 3 accumulation steps at stages 0, 1 and
2 in three ways that must end at identical parameters (same arithmetic, same reduction order):
``zero.backward(loss, is_boundary=...)``; plain ``loss.backward()`` after ``set_boundary`` with
the cycle's flag; and ``zero.backward(loss)`` without a flag, which follows ``set_boundary``
too. After a non-boundary pass ``step()`` is refused, and ``no_sync()`` wins over a standing
true flag. A fourth way ends every cycle after the fact: all passes non-boundary, then
``end_accumulation()`` (DeepSpeed's ``managed_gradient_accumulation: false``), which must give
the same parameters, with Muon's full groups too (they reduce only at a boundary pass, at
stage 2 as well); inside ``no_sync()`` it is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from deepshard.interface.errors import CommError
from deepshard.testing import import_beside, run_on_mesh

_training = import_beside(__file__, "_training.py")
_muon_training = import_beside(__file__, "_muon_training.py")
GA = 3
MODES = ("explicit", "plain", "standing", "ended")


def _train(group: Any, rank: int, world: int, stage: int, mode: str) -> torch.Tensor:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    inner = torch.optim.AdamW(_training.param_groups(list(model.parameters())), lr=_training.LR)
    zero = ZeroOptimizer(inner, group=group, config=ZeroConfig(stage=stage), gradient_clipping=1.0)
    mb = _training.GLOBAL_BATCH // (world * GA)
    for step in range(2):
        x, y = _training.batch(step)
        for m in range(GA):
            rows = slice((m * world + rank) * mb, (m * world + rank + 1) * mb)
            loss = _training.loss_fn(model, x[rows], y[rows]) / GA
            boundary = m == GA - 1
            if mode == "explicit":
                zero.backward(loss, is_boundary=boundary)
                continue
            if mode == "ended":
                zero.backward(loss, is_boundary=False)
                if boundary:
                    zero.end_accumulation()
                continue
            zero.set_boundary(boundary)
            if mode == "plain":
                loss.backward()
            else:
                zero.backward(loss)
            if not boundary:
                with pytest.raises(CommError, match="boundary"):
                    zero.step()
        zero.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _no_sync_wins(group: Any) -> bool:
    from deepshard.interface.config import ZeroConfig
    from deepshard.zero import ZeroOptimizer

    model = _training.make_model()
    zero = ZeroOptimizer(
        torch.optim.AdamW(model.parameters()), group=group, config=ZeroConfig(stage=1)
    )
    zero.set_boundary(True)
    x, y = _training.batch(0)
    with zero.no_sync():
        _training.loss_fn(model, x, y).backward()
        with pytest.raises(CommError, match="cannot end inside no_sync"):
            zero.end_accumulation()
    try:
        zero.step()
    except CommError:
        return True
    return False


def _run(mesh: Any) -> dict[Any, Any]:
    group, rank = mesh["dp"], mesh.get_rank()
    world = group.size()
    out: dict[Any, Any] = {"no_sync_wins": _no_sync_wins(group)}
    for stage in (0, 1, 2):
        for mode in MODES:
            out[(stage, mode)] = _train(group, rank, world, stage, mode)
        # Muon's full groups reduce only at a boundary pass, at stage 2 too: ending the cycle
        # must still run one for them.
        for ended in (False, True):
            out[(stage, "muon", ended)] = _muon_training.train_zero(
                group, stage=stage, ga=GA, steps=2, ended=ended
            )["params"]
    return out


@pytest.mark.slow
def test_plain_backward_follows_the_standing_flag(tmp_path: Path) -> None:
    for results in run_on_mesh(_run, 2, store_dir=tmp_path, timeout_s=180):
        assert results["no_sync_wins"]
        for stage in (0, 1, 2):
            explicit = results[(stage, "explicit")]
            for mode in MODES[1:]:
                assert torch.equal(results[(stage, mode)], explicit), (stage, mode)
            muon = zip(results[(stage, "muon", False)], results[(stage, "muon", True)], strict=True)
            assert all(torch.equal(a, b) for a, b in muon), stage
