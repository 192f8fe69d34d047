"""``engine.generation_context()`` gives back the modes and random streams it found.

One rank (a process of its own through `run_on_mesh`, so the process group ``initialize``
joins never leaks into the test process), a small MLP through ``initialize`` (ZeRO-0): inside
the block every submodule is in eval mode and draws from torch's generator; after it the
generator is where it was (the next draw equals the draw of a copy of the state taken before),
a submodule the caller had put in eval is still in eval while the others train again, and bad
knobs or a destroyed engine are refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.interface.errors import ConfigError
from deepshard.testing import run_on_mesh


def _engine() -> Any:
    import deepshard.engine as ds

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 2))
    config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    return ds.initialize(model, config).engine


def _modes_and_rng_are_restored(mesh: Any) -> bool:
    engine = _engine()
    module = engine.module
    module[1].eval()  # the caller's choice survives the block
    before = torch.get_rng_state()
    with engine.generation_context(gather_units=2) as view:
        assert view.module is module and view.kv_heads is None
        assert not any(m.training for m in module.modules())
        torch.rand(5)  # a draw inside moves the stream
    assert [m.training for m in module] == [True, False, True] and module.training
    assert torch.equal(torch.get_rng_state(), before)
    with (
        pytest.raises(ConfigError, match="gather_units"),
        engine.generation_context(gather_units=0),
    ):
        pass
    engine.destroy()
    with pytest.raises(ConfigError, match="destroy"), engine.generation_context():
        pass
    return True


def test_modes_and_rng_are_restored() -> None:
    assert run_on_mesh(_modes_and_rng_are_restored, 1, timeout_s=120) == [True]
