"""`deepshard.engine.checkpointing` gives the gradients of the plain forward and keeps less.

Every test builds the same small stack of blocks twice (one seed) and compares a checkpointed
run with a plain one in the same process: gradients equal bit for bit (dropout on the default
generator and on an `RNGTracker` state included), and the bytes autograd keeps for backward,
counted by a ``saved_tensors_hooks`` context, fall to the blocks' inputs, as their shapes say.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from deepshard.engine.checkpointing import (
    Checkpointer,
    CheckpointWrapper,
    RNGTracker,
    checkpoint,
    checkpoint_wrapper,
)
from deepshard.interface.config import ActivationCheckpointingConfig
from deepshard.interface.errors import ConfigError

BATCH, HIDDEN, BLOCKS = 8, 16, 4


class _Block(torch.nn.Module):
    """Linear → GELU → dropout (default generator) → dropout (tracker state) → Linear."""

    def __init__(self, tracker: RNGTracker | None) -> None:
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = torch.nn.Linear(4 * HIDDEN, HIDDEN)
        self.tracker = tracker

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.up(x))
        if self.tracker is not None:
            h = torch.nn.functional.dropout(h, 0.3)
            with self.tracker.fork():
                h = torch.nn.functional.dropout(h, 0.3)
        return x + self.down(h)


def _blocks(tracker: RNGTracker | None) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(_Block(tracker) for _ in range(BLOCKS))


def _run(blocks: torch.nn.ModuleList, checkpointer: Checkpointer | None) -> list[torch.Tensor]:
    torch.manual_seed(1)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    h = x * 1.0
    for block in blocks:
        h = block(h) if checkpointer is None else checkpointer.checkpoint(block, h)
    h.square().sum().backward()
    assert x.grad is not None
    return [x.grad, *(p.grad for p in blocks.parameters() if p.grad is not None)]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_gradients_equal_without_checkpointing_dropout_included() -> None:
    plain_tracker = RNGTracker.for_tensor_parallel(5, tp_rank=0)
    plain = _run(_blocks(plain_tracker), None)
    tracker = RNGTracker.for_tensor_parallel(5, tp_rank=0)
    grads = _run(_blocks(tracker), Checkpointer(rng_tracker=tracker))
    assert _equal(grads, plain)
    # after backward the tracker is where the plain forward left it (recomputation undone)
    after, expected = tracker.get_states(), plain_tracker.get_states()
    assert all(torch.equal(after[name], expected[name]) for name in expected)


def test_without_the_tracker_the_recomputed_dropout_differs() -> None:
    # Control: a checkpointer that does not know the tracker recomputes the tracker's dropout
    # from the advanced state, so the masks and gradients differ from the plain run's.
    plain = _run(_blocks(RNGTracker.for_tensor_parallel(5, tp_rank=0)), None)
    tracker = RNGTracker.for_tensor_parallel(5, tp_rank=0)
    assert not _equal(_run(_blocks(tracker), Checkpointer()), plain)


def _saved_activation_bytes(blocks: torch.nn.ModuleList, wrap: bool) -> int:
    """Bytes of distinct non-parameter storages autograd keeps for backward."""
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.numel():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(BATCH, HIDDEN)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in blocks:
            h = checkpoint(block, h) if wrap else block(h)
    h.sum().backward()
    return sum(storages.values())


def test_saved_bytes_fall_to_the_block_inputs() -> None:
    blocks = _blocks(None)
    plain = _saved_activation_bytes(blocks, wrap=False)
    kept = _saved_activation_bytes(blocks, wrap=True)
    # plain: each block keeps its input (B×H) and the up-projection and GELU outputs (B×4H
    # each) for the two linears and GELU; checkpointed: only its input
    assert plain == BLOCKS * (BATCH * HIDDEN + 2 * BATCH * 4 * HIDDEN) * 4
    assert kept == BLOCKS * BATCH * HIDDEN * 4


def test_cpu_and_contiguous_keep_inputs_in_one_host_buffer() -> None:
    plain = _run(_blocks(None), None)
    config = ActivationCheckpointingConfig(
        cpu_checkpointing=True, contiguous_memory_optimization=True, number_checkpoints=BLOCKS
    )
    checkpointer = Checkpointer(config)
    for _ in range(2):  # the slots are free again after each backward
        assert _equal(_run(_blocks(None), checkpointer), plain)
    assert checkpointer.stats.kept_input_bytes == 2 * BLOCKS * BATCH * HIDDEN * 4
    assert checkpointer.buffer_bytes == BLOCKS * BATCH * HIDDEN * 4


def test_more_checkpoints_than_slots_is_refused() -> None:
    config = ActivationCheckpointingConfig(
        contiguous_memory_optimization=True, number_checkpoints=BLOCKS - 1
    )
    with pytest.raises(ConfigError, match=r"activation_checkpointing\.number_checkpoints"):
        _run(_blocks(None), Checkpointer(config))
    with pytest.raises(ConfigError, match="number_checkpoints: required"):
        Checkpointer(ActivationCheckpointingConfig(contiguous_memory_optimization=True))


def test_boundaries_synchronise_and_profile_times_both_passes() -> None:
    calls: list[Any] = []
    config = ActivationCheckpointingConfig(synchronize_checkpoint_boundary=True, profile=True)
    checkpointer = Checkpointer(config, synchronize=lambda: calls.append(1))
    _run(_blocks(None), checkpointer)
    stats = checkpointer.stats
    assert (stats.checkpoints, stats.recomputations) == (BLOCKS, BLOCKS)
    assert len(calls) == stats.synchronizations == 4 * BLOCKS  # before and after each pass
    assert stats.forward_s > 0 and stats.recompute_s > 0


def test_wrapper_trains_like_the_module_and_keeps_its_state_dict() -> None:
    plain_blocks = _blocks(None)
    plain = _run(plain_blocks, None)
    wrapped = torch.nn.ModuleList(checkpoint_wrapper(b) for b in _blocks(None))
    assert all(isinstance(w, CheckpointWrapper) for w in wrapped)
    assert _equal(_run(wrapped, None), plain)
    state = wrapped.state_dict()
    assert list(state) == list(plain_blocks.state_dict())
    wrapped.load_state_dict(plain_blocks.state_dict())
