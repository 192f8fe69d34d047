"""Activation checkpointing: recompute a block's forward in backward instead of keeping it.

DeepSpeed's ``deepspeed.checkpointing`` module keeps its settings, the model-parallel group
and the RNG tracker in module globals (``configure(mpu, config)``, ``get_cuda_rng_tracker()``)
and re-implements the reentrant checkpoint. Here the same features sit on PyTorch's
non-reentrant ``torch.utils.checkpoint`` and everything is an object the caller holds:

* `Checkpointer` is built from the ``activation_checkpointing`` section, the tensor-parallel
  group and an optional `RNGTracker`; ``checkpointer.checkpoint(fn, *args)`` and
  ``checkpointer.wrap(module)`` checkpoint with those settings, and ``engine.checkpointing``
  is the one `deepshard.engine.initialize` builds for its mesh and config.
* `checkpoint` and `checkpoint_wrapper` are the plain functions (a default `Checkpointer`
  when none is given: PyTorch's checkpoint, nothing else).

What each key does (the inputs' handling is `deepshard.engine._checkpoint_inputs`):

* ``partition_activations``: each tp rank keeps ``1/tp`` of every checkpointed input; backward
  all-gathers them over the tp group before recomputing.
* ``cpu_checkpointing``: the kept inputs wait for backward in host memory.
* ``contiguous_memory_optimization`` with ``number_checkpoints``: the kept inputs are copied
  into preallocated buffers with ``number_checkpoints`` slots per input position (DeepSpeed
  requires ``partition_activations`` for it; here it also works without).
* ``synchronize_checkpoint_boundary``: the device is synchronised before and after every
  checkpointed forward and recomputation.
* ``profile``: both are timed (after a synchronisation), logged and summed in `stats`.

Dropout recomputes identically: ``torch.utils.checkpoint`` restores the default generators, and
the checkpointer snapshots the `RNGTracker`'s named states at the forward and puts them back
around the recomputation (restoring the advanced states afterwards).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint

from deepshard.accelerators import get_accelerator
from deepshard.comm import Group, resolve_group
from deepshard.engine._checkpoint_inputs import InputHooks, SlotBuffers
from deepshard.engine._rng_tracker import MODEL_PARALLEL_RNG, TP_SEED_OFFSET, RNGTracker
from deepshard.interface.config import ActivationCheckpointingConfig
from deepshard.interface.errors import ConfigError

__all__ = [
    "MODEL_PARALLEL_RNG",
    "TP_SEED_OFFSET",
    "CheckpointStats",
    "CheckpointWrapper",
    "Checkpointer",
    "RNGTracker",
    "checkpoint",
    "checkpoint_wrapper",
]

_log = logging.getLogger("deepshard.engine.checkpointing")


@dataclass(frozen=True)
class CheckpointStats:
    """What one `Checkpointer` did, counted since it was built."""

    checkpoints: int = 0
    """Checkpointed forwards run with grad enabled (each will recompute in backward)."""

    recomputations: int = 0
    """Forwards recomputed during backward."""

    kept_input_bytes: int = 0
    """Bytes of activation inputs the checkpoints kept for backward (after partitioning);
    counted when the inputs are handled (partition, contiguous or cpu checkpointing), else 0
    (PyTorch keeps them as they are)."""

    synchronizations: int = 0
    """Device synchronisations at checkpoint boundaries."""

    forward_s: float = 0.0
    """Seconds in checkpointed forwards (only with ``profile``)."""

    recompute_s: float = 0.0
    """Seconds in recomputations (only with ``profile``)."""


def _synchronizer(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    accelerator = get_accelerator(device.type)
    return lambda: accelerator.synchronize(device)


class Checkpointer:
    """Activation checkpointing with the ``activation_checkpointing`` settings.

    Args:
        config: The section; the defaults when None (plain PyTorch checkpointing).
        tp: The tensor-parallel group (``mesh["tp"]`` or a process group) that
            ``partition_activations`` splits inputs over; None keeps inputs whole.
        rng_tracker: Named RNG states used inside the checkpointed code (tp dropout);
            restored for the recomputation.
        device: The training device (what ``synchronize_checkpoint_boundary`` synchronises).
        synchronize: Replaces the device synchronisation (tests count calls with it).

    Raises:
        ConfigError: ``contiguous_memory_optimization`` without ``number_checkpoints``.
    """

    def __init__(
        self,
        config: ActivationCheckpointingConfig | None = None,
        *,
        tp: Group | None = None,
        rng_tracker: RNGTracker | None = None,
        device: torch.device | str = "cpu",
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self.config = config if config is not None else ActivationCheckpointingConfig()
        self.rng_tracker = rng_tracker
        self._tp = resolve_group(tp) if tp is not None else None
        self._slots: SlotBuffers | None = None
        if self.config.contiguous_memory_optimization:
            if self.config.number_checkpoints is None:
                raise ConfigError.from_problems(
                    [
                        (
                            "activation_checkpointing.number_checkpoints",
                            "required by contiguous_memory_optimization (it sizes the buffer): "
                            "set it to the checkpoint calls per forward (e.g. the layer count)",
                        )
                    ]
                )
            self._slots = SlotBuffers(self.config.number_checkpoints)
        self._synchronize = synchronize or _synchronizer(torch.device(device))
        self._stats = CheckpointStats()

    @property
    def stats(self) -> CheckpointStats:
        """The counts so far (a frozen snapshot)."""
        return self._stats

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the contiguous buffers (0 without ``contiguous_memory_optimization``)."""
        return 0 if self._slots is None else self._slots.nbytes

    def _count(self, **increments: float) -> None:
        stats = self._stats
        changes = {name: getattr(stats, name) + value for name, value in increments.items()}
        self._stats = dataclasses.replace(stats, **changes)

    def _handles_inputs(self) -> bool:
        config = self.config
        partition = config.partition_activations and self._tp is not None
        return partition or config.cpu_checkpointing or self._slots is not None

    @contextlib.contextmanager
    def _boundary(self, what: str, seconds_field: str) -> Iterator[None]:
        """Synchronise and time one checkpointed forward or recomputation, as configured."""
        config = self.config
        timed = config.profile
        if config.synchronize_checkpoint_boundary or timed:
            self._synchronize()
            self._count(synchronizations=1)
        start = time.perf_counter()
        try:
            yield
        finally:
            if config.synchronize_checkpoint_boundary or timed:
                self._synchronize()
                self._count(synchronizations=1)
            if timed:
                seconds = time.perf_counter() - start
                self._count(**{seconds_field: seconds})
                _log.info("activation checkpoint %s: %.3f ms", what, seconds * 1e3)

    def _contexts(
        self,
    ) -> tuple[contextlib.AbstractContextManager[None], contextlib.AbstractContextManager[None]]:
        """``context_fn`` for torch: snapshot the tracker at the forward, restore it around
        the recomputation (put back the advanced states after)."""
        snapshot: list[dict[str, torch.Tensor]] = []

        @contextlib.contextmanager
        def forward() -> Iterator[None]:
            if self.rng_tracker is not None:
                snapshot.append(self.rng_tracker.get_states())
            yield

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            self._count(recomputations=1)
            tracker = self.rng_tracker
            current = tracker.get_states() if tracker is not None else None
            if tracker is not None and snapshot:
                tracker.set_states(snapshot[0])
            try:
                with self._boundary("recomputation", "recompute_s"):
                    yield
            finally:
                if tracker is not None and current is not None:
                    tracker.set_states(current)

        return forward(), recompute()

    def checkpoint(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, keeping only its inputs; backward recomputes the rest.

        Args:
            fn: The block to checkpoint (a module or any function of tensors).
            *args: Its positional arguments; the tensors among them are what is kept.
            **kwargs: Its keyword arguments (kept as they are).

        Returns:
            What ``fn`` returns.
        """
        inputs = None
        if self._handles_inputs():
            tp = self._tp if self.config.partition_activations else None
            inputs = InputHooks(tp=tp, slots=self._slots, to_host=self.config.cpu_checkpointing)
        with self._boundary("forward", "forward_s"), inputs.hooks if inputs else _no_hooks():
            output = torch.utils.checkpoint.checkpoint(
                fn, *args, use_reentrant=False, context_fn=self._contexts, **kwargs
            )
        if torch.is_grad_enabled():
            self._count(checkpoints=1, kept_input_bytes=inputs.kept_bytes if inputs else 0)
        return output

    def wrap(self, module: torch.nn.Module) -> CheckpointWrapper:
        """``module`` wrapped so every call of it is checkpointed with these settings."""
        return CheckpointWrapper(module, self)


def _no_hooks() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class CheckpointWrapper(torch.nn.Module):
    """A module whose forward is checkpointed; its state dict is the wrapped module's.

    Args:
        module: The block to checkpoint.
        checkpointer: The settings (a default `Checkpointer` when None).
    """

    def __init__(self, module: torch.nn.Module, checkpointer: Checkpointer | None = None) -> None:
        super().__init__()
        self.module = module
        self.checkpointer = checkpointer if checkpointer is not None else Checkpointer()
        # The wrapper adds no "module." level to parameter names, so a checkpoint written
        # with or without wrapping loads into either.
        self.register_state_dict_post_hook(_strip_prefix)  # type: ignore[no-untyped-call]
        self.register_load_state_dict_pre_hook(_add_prefix)  # type: ignore[no-untyped-call]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward, checkpointed."""
        return self.checkpointer.checkpoint(self.module, *args, **kwargs)


def _strip_prefix(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    inner = f"{prefix}module."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_prefix(
    module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    inner = f"{prefix}module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def checkpoint(
    fn: Callable[..., Any], *args: Any, checkpointer: Checkpointer | None = None, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` under activation checkpointing (non-reentrant).

    Args:
        fn: The block to checkpoint.
        *args: Its positional arguments.
        checkpointer: The settings (``engine.checkpointing``); PyTorch's plain checkpoint when
            None.
        **kwargs: Its keyword arguments.

    Returns:
        What ``fn`` returns.
    """
    return (checkpointer or Checkpointer()).checkpoint(fn, *args, **kwargs)


def checkpoint_wrapper(
    module: torch.nn.Module, checkpointer: Checkpointer | None = None
) -> CheckpointWrapper:
    """``module`` wrapped so each call is checkpointed (see `CheckpointWrapper`)."""
    return CheckpointWrapper(module, checkpointer)
