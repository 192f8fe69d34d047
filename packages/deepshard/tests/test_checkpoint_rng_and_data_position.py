"""The pieces of exact resume that need no processes: the RNG rows and the loader's position.

* `capture_rng` / `restore_rng`: after a restore, Python's `random`, NumPy's global generator
  (when importable) and torch's CPU generator draw exactly what they drew after the capture; a
  stream of an accelerator this run does not have is refused by name.
* `ResumableSampler`: a sampler given another's state continues with the very next indices of
  the same epoch; at another world size (2 -> 1) it skips exactly the samples both ranks had
  consumed together, so no sample of the epoch is seen twice or skipped.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from deepshard.engine._dataloader import ResumableSampler
from deepshard.engine._rng_state import capture_rng, restore_rng, rng_map
from deepshard.interface.errors import CheckpointError


def _draws() -> list[float]:
    out = [random.random(), random.gauss(0.0, 1.0), float(torch.rand(()))]
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        out.append(float(np.random.rand()))
    return out


def test_rng_streams_come_back_exactly() -> None:
    random.gauss(0.0, 1.0)  # leaves a cached Gaussian in Python's state
    saved = capture_rng("cpu")
    expected = _draws()
    _draws()
    restore_rng(saved, "cpu")
    assert _draws() == expected
    assert rng_map(saved["torch_cpu"], 4).global_shape == (4, saved["torch_cpu"].numel())
    with pytest.raises(CheckpointError, match="torch_xpu"):
        restore_rng({"torch_xpu": torch.zeros(16, dtype=torch.uint8)}, "cpu")


def _take(sampler: ResumableSampler, n: int) -> list[int]:
    it = iter(sampler)
    return [next(it) for _ in range(n)]


def test_sampler_resumes_the_epoch_at_the_same_and_another_world_size() -> None:
    data = list(range(20))
    ranks = [ResumableSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0) for r in (0, 1)]
    for sampler in ranks:
        sampler.set_epoch(3)
    seen = [_take(sampler, 3) for sampler in ranks]
    states = [sampler.state_dict() for sampler in ranks]
    assert states[0] == {"epoch": 3, "consumed": 3}

    again = ResumableSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    again.load_state_dict(states[0])
    epoch = _epoch(data, 3, 2, 0)
    assert seen[0] == epoch[:3] and list(again) == epoch[3:]

    alone = ResumableSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    alone.load_state_dict(states[0], world_sizes=(2, 1))
    rest = list(alone)
    assert sorted(rest + seen[0] + seen[1]) == data, "a sample was skipped or seen twice"


def _epoch(data: list[int], epoch: int, replicas: int, rank: int) -> list[int]:
    sampler = ResumableSampler(data, num_replicas=replicas, rank=rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return list(sampler)
