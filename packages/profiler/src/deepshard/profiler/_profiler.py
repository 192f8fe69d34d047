"""`FlopsProfiler` and `get_model_profile`: DeepSpeed's profiler API over aten-level counting.

The API and its defaults are DeepSpeed's (``start_profile`` / ``stop_profile`` /
``reset_profile`` / ``end_profile``, the ``get_total_*`` readers, ``print_model_profile``);
what is counted comes from `deepshard.profiler._counting`, so nothing in ``torch`` is replaced
and a second profiling run gives the same numbers as the first.

``count_mode`` says when the operators are counted: ``"eager"`` while the profiled step runs
(a dispatch mode on the timed path), ``"replay"`` after it, from a replay of the recorded calls
on fake tensors (`deepshard.profiler._replay`; the timed step has the module hooks only), and
``"auto"`` (the default) replays until a replay fails, then logs one line saying why and counts
eagerly from the next ``start_profile()``. A profile whose replay failed has no numbers: reading
them is a `ProfilerReplayError` (`get_model_profile` profiles once more, eagerly).

Deliberate differences: ``ignore_list`` really leaves the listed module types out (DeepSpeed
only drops their rows and still adds their functionals to the parent); each parent of a shared
module holds only what ran inside its own call; asking for numbers when nothing is profiled is
a `ProfilerError`, not an ``AttributeError`` or a silent return.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from deepshard.interface.errors import DeepShardError
from deepshard.profiler._counting import ModuleTally, Recorder
from deepshard.profiler._peak import peak_flops_of
from deepshard.profiler._replay import CallReplay, ReplayFailed, foreign_hooks
from deepshard.profiler._report import (
    ModelProfile,
    TrainingStep,
    aggregated_text,
    build_profile,
    number_to_string,
    profile_text,
)

__all__ = ["CountMode", "FlopsProfiler", "ProfilerError", "ProfilerReplayError"]

CountMode = Literal["auto", "replay", "eager"]
"""When operators are counted: during the step, from a replay after it, or replay-then-eager."""

_COUNT_MODES = ("auto", "replay", "eager")
_log = logging.getLogger("deepshard.profiler")


class ProfilerError(DeepShardError, RuntimeError):
    """The profiler was asked for numbers it does not have, or given arguments it cannot use."""


class ProfilerReplayError(ProfilerError):
    """The recorded calls of a profile could not be replayed on fake tensors to count them."""


def _device_synchronizer(model: torch.nn.Module) -> Callable[[], None]:
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    if device.type in ("cpu", "meta"):  # nothing is queued: no device to wait for
        return lambda: None
    from deepshard.accelerators import get_accelerator

    accelerator = get_accelerator(device.type)
    return lambda: accelerator.synchronize(device)


class FlopsProfiler:
    """Counts the FLOPs, MACs, parameters and latency of each module of ``model``.

    Args:
        model: The model to profile.
        count_backward: Also count the backward operators (attributed to the module whose
            forward recorded them). DeepSpeed counts the forward only, the default here too.
        peak_flops: Peak FLOP/s of one device, for the model FLOPs utilisation; None looks the
            device up (`deepshard.profiler.peak_flops_of`) and prints no MFU when it is unknown.
        recompute_fwd_factor: Forward passes recomputed in backward (activation checkpointing),
            used by the training summary.
        synchronize: Waits for queued device work around each module's clock readings; by
            default the accelerator of the model's parameters (nothing on CPU).
        clock: Monotonic seconds.
        param_numel: The elements a parameter stands for in the parameter counts; by default
            ``numel()``. Under ZeRO stage 3 a parameter is empty between uses, and the engine
            passes its owner's full count (DeepSpeed reads ``ds_numel`` for the same reason).
        count_mode: ``"replay"`` counts after the step from a fake-tensor replay of its calls
            (the timed step pays only the module hooks); ``"eager"`` counts while it runs (a
            dispatch mode, ~10 us per operator; for models whose shapes depend on values, or
            whose modules gather their parameters in hooks); ``"auto"`` replays and, after a
            replay fails, counts eagerly from the next ``start_profile()``.

    Raises:
        ProfilerError: ``peak_flops`` is not positive or ``count_mode`` is unknown.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        count_backward: bool = False,
        peak_flops: float | None = None,
        recompute_fwd_factor: float = 0.0,
        synchronize: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        param_numel: Callable[[torch.nn.Parameter], int] | None = None,
        count_mode: CountMode = "auto",
    ) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise ProfilerError(f"peak_flops must be positive FLOP/s, got {peak_flops}")
        if count_mode not in _COUNT_MODES:
            raise ProfilerError(f"count_mode must be one of {_COUNT_MODES}, got {count_mode!r}")
        self.count_mode: CountMode = count_mode
        self._fallback: str | None = None  # why "auto" counts eagerly now (a replay failed)
        self._replay: CallReplay | None = None
        self.model = model
        self.count_backward = count_backward
        self.recompute_fwd_factor = recompute_fwd_factor
        self._peak = peak_flops
        self._synchronize = synchronize if synchronize is not None else _device_synchronizer(model)
        self._clock = clock
        self._param_numel = param_numel if param_numel is not None else torch.nn.Parameter.numel
        self._recorder: Recorder | None = None

    # --- lifecycle -----------------------------------------------------------------------

    @property
    def started(self) -> bool:
        """Whether a profile exists (between ``start_profile`` and ``end_profile``)."""
        return self._recorder is not None

    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Start counting from zero.

        Args:
            ignore_list: Module types left out entirely (their forward and backward count
                nothing and they have no latency).

        Raises:
            ProfilerError: An entry of ``ignore_list`` is not a module class.
        """
        ignored = tuple(ignore_list or ())
        bad = [t for t in ignored if not (isinstance(t, type) and issubclass(t, torch.nn.Module))]
        if bad:
            raise ProfilerError(
                f"ignore_list takes torch.nn.Module classes (e.g. [torch.nn.Dropout]), got {bad}"
            )
        self.end_profile()
        if self.count_mode == "auto" and self._fallback is None:
            hooked = foreign_hooks(self.model)
            if hooked is not None:
                self._fallback = hooked
                _log.info("FLOPs profiler: counting eagerly: %s (a replay runs them again)", hooked)
        replay = None
        if self.count_mode == "replay" or (self.count_mode == "auto" and self._fallback is None):
            replay = CallReplay(
                self.model, ignore_types=ignored, count_backward=self.count_backward
            )
        self._replay = replay
        self._recorder = Recorder(
            self.model,
            ignore_types=ignored,
            count_backward=self.count_backward,
            synchronize=self._synchronize,
            clock=self._clock,
            counting=replay is None,
            on_call=None if replay is None else replay.record,
        )
        self._recorder.install()

    @property
    def replaying(self) -> bool:
        """Whether the current (or next) profile is counted from a replay, not eagerly."""
        if self._recorder is not None:
            return self._replay is not None
        return self.count_mode == "replay" or (self.count_mode == "auto" and not self._fallback)

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay readable until ``end_profile``."""
        if self._recorder is not None:
            self._recorder.remove()

    def reset_profile(self) -> None:
        """Zero the numbers; counting goes on if it was on."""
        if self._recorder is not None:
            self._recorder.reset()
        if self._replay is not None:
            self._replay.reset()

    def end_profile(self) -> None:
        """Stop counting and forget the numbers (every hook and the mode are gone)."""
        self.stop_profile()
        self._recorder, self._replay = None, None

    # --- numbers -------------------------------------------------------------------------

    def _require(self) -> Recorder:
        if self._recorder is None:
            raise ProfilerError(
                "no profile to read: call start_profile(), run the model, then read the numbers "
                "before end_profile()"
            )
        return self._recorder

    def profile(self, *, training: TrainingStep | None = None) -> ModelProfile:
        """The current numbers as a frozen module tree.

        Args:
            training: The training step the numbers were taken in (the engine passes it).

        Raises:
            ProfilerError: Nothing is being profiled.
            ProfilerReplayError: The profile's calls could not be replayed to count them.
        """
        tallies, ops = self._counts(self._require())
        peak = self._peak if self._peak is not None else self._known_peak()
        return build_profile(
            self.model,
            tallies,
            ops,
            backward_counted=self.count_backward,
            peak_flops=peak,
            training=training,
            param_numel=self._param_numel,
        )

    def _counts(self, recorder: Recorder) -> tuple[dict[int, ModuleTally], dict[str, list[int]]]:
        """Per-module tallies and per-operator FLOPs: the recorder's, or the replay's."""
        if self._replay is None:
            return recorder.tallies, recorder.ops
        try:
            with recorder.suspended():  # the replay's calls are not the profiled step's
                counted, ops = self._replay.counts()
        except ReplayFailed as error:
            if self.count_mode == "auto" and self._fallback is None:
                self._fallback = str(error)
                _log.warning(
                    "FLOPs profiler: the fake-tensor replay of the profiled calls failed (%s); "
                    "the next start_profile() counts eagerly",
                    error,
                )
            fix = (
                "profile again: the next start_profile() counts eagerly"
                if self.count_mode == "auto"
                else "use FlopsProfiler(..., count_mode='eager') or 'auto'"
            )
            raise ProfilerReplayError(
                f"the FLOPs of this profile could not be counted by replaying its calls on fake "
                f"tensors ({error}); {fix}"
            ) from error
        for mid, timing in recorder.tallies.items():
            tally = counted.setdefault(mid, ModuleTally())
            tally.duration_s, tally.calls = timing.duration_s, timing.calls
        return counted, ops

    def _known_peak(self) -> float | None:
        param = next(self.model.parameters(), None)
        return None if param is None else peak_flops_of(param.device, param.dtype)

    def set_peak_flops(self, peak_flops: float | None) -> None:
        """Set (or, with None, look up again) the peak FLOP/s the MFU is computed against."""
        if peak_flops is not None and peak_flops <= 0:
            raise ProfilerError(f"peak_flops must be positive FLOP/s, got {peak_flops}")
        self._peak = peak_flops

    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward FLOPs of the model (``as_string``: e.g. ``"866.08 M"``)."""
        flops = self.profile().root.flops
        return number_to_string(flops).strip() if as_string else flops

    def get_total_backward_flops(self, as_string: bool = False) -> int | str:
        """Backward FLOPs of the model (0 unless ``count_backward``)."""
        flops = self.profile().root.backward_flops
        return number_to_string(flops).strip() if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the model."""
        macs = self.profile().root.macs
        return number_to_string(macs, "MACs") if as_string else macs

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model, each counted once."""
        params = self.profile().root.params
        return number_to_string(params).strip() if as_string else params

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward wall-clock seconds of the model's calls."""
        seconds = self.profile().root.duration_s
        return number_to_string(seconds, "s") if as_string else seconds

    def get_flops_by_op(self) -> dict[str, tuple[int, int]]:
        """``{aten operator: (forward FLOPs, backward FLOPs)}`` of the model."""
        return dict(self.profile().ops)

    # --- reports -------------------------------------------------------------------------

    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | Path | None = None,
        *,
        training: TrainingStep | None = None,
    ) -> None:
        """Print (or write) the profile: summary, top modules per depth, module tree.

        Args:
            profile_step: The step named in the summary.
            module_depth: Deepest level shown; -1 shows every level.
            top_modules: Classes listed per depth in the aggregated part.
            detailed: Include the module tree.
            output_file: Write there instead of standard output; a name ending in ``.json``
                gets the profile as JSON. Missing directories are created.
            training: The training step, for its latencies, samples/s and TFLOPS.

        Raises:
            ProfilerError: Nothing is being profiled, or ``module_depth``/``top_modules`` is out
                of range.
        """
        check_view(module_depth, top_modules)
        profile = self.profile(training=training)
        if output_file is not None and str(output_file).endswith(".json"):
            data = {"profile_step": profile_step, **profile.as_json()}
            _write(output_file, json.dumps(data, indent=2) + "\n")
            return
        text = profile_text(
            profile,
            profile_step=profile_step,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
        )
        if output_file is None:
            sys.stdout.write(text)
        else:
            _write(output_file, text)

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print the ``top_modules`` classes per depth by parameters, MACs and latency.

        Raises:
            ProfilerError: Nothing is being profiled, or an argument is out of range.
        """
        check_view(module_depth, top_modules)
        print(aggregated_text(self.profile(), module_depth, top_modules))


def check_view(module_depth: int, top_modules: int) -> None:
    if module_depth < -1:
        raise ProfilerError(f"module_depth must be -1 (all levels) or >= 0, got {module_depth}")
    if top_modules < 1:
        raise ProfilerError(f"top_modules must be >= 1, got {top_modules}")


def _write(path: str | Path, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
