"""Named random-number states, so dropout inside a checkpoint recomputes the same mask.

Tensor-parallel layers need two kinds of randomness: dropout on activations that every tp rank
holds whole must draw the *same* mask on every tp rank (the default generator, seeded alike on
all ranks), while dropout on a tp-sharded activation must draw a *different* mask on each rank
(a second state, seeded per tp rank). Megatron and DeepSpeed keep that second state in a
process-global tracker (``get_cuda_rng_tracker()``); here it is an `RNGTracker` object the
caller owns and hands to the `deepshard.engine.checkpointing.Checkpointer`.

``tracker.fork(name)`` swaps the named state into the device's default generator for the
block (``F.dropout`` only reads the default generator), then stores the advanced state back
under its name and restores the default generator as it was. A checkpoint recomputing its
forward in backward has to draw the same numbers again: the checkpointer snapshots
``get_states()`` when the forward runs and puts the snapshot back around the recomputation
(the default generator itself is restored by ``torch.utils.checkpoint``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from deepshard.interface.errors import ConfigError

__all__ = ["MODEL_PARALLEL_RNG", "TP_SEED_OFFSET", "RNGTracker"]

MODEL_PARALLEL_RNG = "model-parallel-rng"
"""The state name Megatron and DeepSpeed use for per-tp-rank randomness."""

TP_SEED_OFFSET = 2718
"""Added to the seed (plus the tp rank) for the model-parallel state, as Megatron does, so it
never coincides with the data-parallel seed."""


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    state: torch.Tensor = torch.get_device_module(device.type).get_rng_state(device)
    return state


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


class RNGTracker:
    """Named generator states for one device (the tensor-parallel dropout states).

    Args:
        device: Whose default generator ``fork`` swaps (``"cpu"``, ``"cuda:0"`` ...).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, torch.Tensor] = {}

    @classmethod
    def for_tensor_parallel(
        cls, seed: int, *, tp_rank: int, device: torch.device | str = "cpu"
    ) -> RNGTracker:
        """A tracker whose `MODEL_PARALLEL_RNG` state is seeded ``seed + 2718 + tp_rank``.

        The default generator is left alone: seed it with ``seed`` on every rank (what
        DeepSpeed's ``model_parallel_cuda_manual_seed`` does for it), so replicated dropout
        agrees across tp ranks while ``fork()`` draws differ.

        Args:
            seed: The run's seed.
            tp_rank: This rank's index in its tensor-parallel group.
            device: The training device.
        """
        tracker = cls(device)
        tracker.add(MODEL_PARALLEL_RNG, seed + TP_SEED_OFFSET + tp_rank)
        return tracker

    @property
    def names(self) -> tuple[str, ...]:
        """The state names, in the order they were added."""
        return tuple(self._states)

    def add(self, name: str, seed: int) -> None:
        """Add a state named ``name`` seeded with ``seed`` (the default generator is untouched).

        Raises:
            ConfigError: ``name`` exists already.
        """
        if name in self._states:
            raise ConfigError(
                f"RNGTracker.add({name!r}): a state of that name exists; pick another name "
                "or build a new tracker"
            )
        self._states[name] = torch.Generator(device=self.device).manual_seed(seed).get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every named state (to restore with `set_states`)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, torch.Tensor]) -> None:
        """Replace the named states with ``states`` (from `get_states`)."""
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from the named state inside the block, then put the default generator back.

        Raises:
            ConfigError: No state ``name`` was added.
        """
        if name not in self._states:
            known = ", ".join(repr(n) for n in self._states) or "none"
            raise ConfigError(
                f"RNGTracker.fork({name!r}): no such state (known: {known}); add it with "
                "tracker.add(name, seed) or RNGTracker.for_tensor_parallel(seed, tp_rank=...)"
            )
        outside = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, outside)
