"""`FlopsProfiler` and `get_model_profile`: DeepSpeed's profiler API over aten-level counting.

The API and its defaults are DeepSpeed's (``start_profile`` / ``stop_profile`` /
``reset_profile`` / ``end_profile``, the ``get_total_*`` readers, ``print_model_profile``);
what is counted comes from `deepshard.profiler._counting`, so nothing in ``torch`` is replaced
and a second profiling run gives the same numbers as the first.

Deliberate differences: ``ignore_list`` really leaves the listed module types out (DeepSpeed
only drops their rows and still adds their functionals to the parent); each parent of a shared
module holds only what ran inside its own call; asking for numbers when nothing is profiled is
a `ProfilerError`, not an ``AttributeError`` or a silent return.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from deepshard.interface.errors import DeepShardError
from deepshard.profiler._counting import Recorder
from deepshard.profiler._peak import peak_flops_of
from deepshard.profiler._report import (
    ModelProfile,
    TrainingStep,
    aggregated_text,
    build_profile,
    number_to_string,
    profile_text,
)

__all__ = ["FlopsProfiler", "ProfilerError", "get_model_profile"]


class ProfilerError(DeepShardError, RuntimeError):
    """The profiler was asked for numbers it does not have, or given arguments it cannot use."""


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
    ) -> None:
        if peak_flops is not None and peak_flops <= 0:
            raise ProfilerError(f"peak_flops must be positive FLOP/s, got {peak_flops}")
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
        self._recorder = Recorder(
            self.model,
            ignore_types=ignored,
            count_backward=self.count_backward,
            synchronize=self._synchronize,
            clock=self._clock,
        )
        self._recorder.install()

    def stop_profile(self) -> None:
        """Stop counting; the numbers stay readable until ``end_profile``."""
        if self._recorder is not None:
            self._recorder.remove()

    def reset_profile(self) -> None:
        """Zero the numbers; counting goes on if it was on."""
        if self._recorder is not None:
            self._recorder.reset()

    def end_profile(self) -> None:
        """Stop counting and forget the numbers (every hook and the mode are gone)."""
        self.stop_profile()
        self._recorder = None

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
        """
        recorder = self._require()
        peak = self._peak if self._peak is not None else self._known_peak()
        return build_profile(
            self.model,
            recorder.tallies,
            recorder.ops,
            backward_counted=self.count_backward,
            peak_flops=peak,
            training=training,
            param_numel=self._param_numel,
        )

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
        _check_view(module_depth, top_modules)
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
        _check_view(module_depth, top_modules)
        print(aggregated_text(self.profile(), module_depth, top_modules))


def _check_view(module_depth: int, top_modules: int) -> None:
    if module_depth < -1:
        raise ProfilerError(f"module_depth must be -1 (all levels) or >= 0, got {module_depth}")
    if top_modules < 1:
        raise ProfilerError(f"top_modules must be >= 1, got {top_modules}")


def _write(path: str | Path, text: str) -> None:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)


def _model_inputs(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None,
    args: Sequence[Any],
    kwargs: dict[str, Any],
) -> tuple[Any, ...]:
    if input_shape is None:
        if not args and not kwargs:
            raise ProfilerError("get_model_profile needs input_shape, args or kwargs")
        return tuple(args)
    if not isinstance(input_shape, tuple) or not input_shape:
        raise ProfilerError(f"input_shape must be a non-empty tuple, got {input_shape!r}")
    param = next(model.parameters(), None)
    if param is None:
        return (torch.ones(input_shape),)
    return (torch.ones(input_shape, dtype=param.dtype, device=param.device),)


def get_model_profile(
    model: torch.nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = False,
    output_file: str | Path | None = None,
    ignore_modules: Sequence[type] | None = None,
) -> tuple[int | str, int | str, int | str]:
    """Profile one forward pass of ``model`` (in eval mode) after ``warm_up`` unprofiled ones.

    Args:
        model: The model.
        input_shape: When given, the model is called with one tensor of ones of this shape
            (the dtype and device of its parameters).
        args: Positional inputs (used when ``input_shape`` is None).
        kwargs: Keyword inputs.
        print_profile: Print (or write) the profile.
        detailed: Include the module tree in it.
        module_depth: Deepest level shown; -1 for all.
        top_modules: Classes per depth in the aggregated part.
        warm_up: Unprofiled forward passes first (latency after warm-up is representative).
        as_string: Return the numbers as strings with metric prefixes.
        output_file: Where the profile goes (``.json`` for JSON); standard output when None.
        ignore_modules: Module types left out.

    Returns:
        ``(flops, macs, params)`` of the forward pass.

    Raises:
        ProfilerError: No inputs, a bad ``input_shape``, or a bad view argument.
    """
    _check_view(module_depth, top_modules)
    inputs, named = _model_inputs(model, input_shape, args, kwargs or {}), kwargs or {}
    model.eval()
    for _ in range(warm_up):
        model(*inputs, **named)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        model(*inputs, **named)
        prof.stop_profile()
        if print_profile:
            prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
        results = (
            prof.get_total_flops(as_string),
            prof.get_total_macs(as_string),
            prof.get_total_params(as_string),
        )
    finally:
        prof.end_profile()
    return results
