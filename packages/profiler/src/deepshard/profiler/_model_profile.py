"""`get_model_profile`: DeepSpeed's one-call profile of a forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from deepshard.profiler._profiler import (
    CountMode,
    FlopsProfiler,
    ProfilerError,
    ProfilerReplayError,
    check_view,
)

__all__ = ["get_model_profile"]


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
    *,
    count_mode: CountMode = "auto",
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
        count_mode: How `FlopsProfiler` counts; under ``"auto"`` a forward whose replay fails
            (shapes that depend on values) is profiled once more, counted eagerly.

    Returns:
        ``(flops, macs, params)`` of the forward pass.

    Raises:
        ProfilerError: No inputs, a bad ``input_shape``, or a bad view argument.
        ProfilerReplayError: ``count_mode="replay"`` and the forward cannot be replayed.
    """
    check_view(module_depth, top_modules)
    inputs, named = _model_inputs(model, input_shape, args, kwargs or {}), kwargs or {}
    model.eval()
    for _ in range(warm_up):
        model(*inputs, **named)
    prof = FlopsProfiler(model, count_mode=count_mode)
    try:
        _profile_forward(prof, inputs, named, ignore_modules, again=count_mode == "auto")
        if print_profile:
            prof.print_model_profile(warm_up, module_depth, top_modules, detailed, output_file)
        return (
            prof.get_total_flops(as_string),
            prof.get_total_macs(as_string),
            prof.get_total_params(as_string),
        )
    finally:
        prof.end_profile()


def _profile_forward(
    prof: FlopsProfiler,
    inputs: tuple[Any, ...],
    named: dict[str, Any],
    ignore_modules: Sequence[type] | None,
    *,
    again: bool,
) -> None:
    """Profile one forward and count it; with ``again``, a failed replay profiles once more
    (the profiler then counts eagerly)."""
    for attempt in (1, 2):
        prof.start_profile(ignore_list=ignore_modules)
        prof.model(*inputs, **named)
        prof.stop_profile()
        try:
            prof.profile()  # counts now, before anything is printed
            return
        except ProfilerReplayError:
            if not again or attempt == 2:
                raise
