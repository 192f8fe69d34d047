"""The profile as data (a frozen module tree) and its text and JSON renderings.

`build_profile` turns the recorder's tallies into a `ModelProfile`. The text report has
DeepSpeed's three parts: a summary (parameters, MACs, FLOPs, latencies, FLOPS, MFU and, when the
profile was taken in training, the step's forward/backward/step latencies and samples/s), the
top modules per depth aggregated by class, and the module tree with each module's parameters,
MACs, latency and FLOPS and their shares of the total. ``as_json`` holds the same numbers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from deepshard.profiler._counting import ModuleTally

__all__ = [
    "ModelProfile",
    "ModuleProfile",
    "TrainingStep",
    "build_profile",
    "number_to_string",
]


def number_to_string(value: float, suffix: str = "", precision: int = 2) -> str:
    """``value`` with a metric prefix: ``number_to_string(1.5e9, "FLOPS")`` is ``1.5 GFLOPS``."""
    magnitude = abs(value)
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if magnitude >= scale:
            return f"{round(value / scale, precision):g} {prefix}{suffix}"
    if magnitude >= 1 or value == 0:
        return f"{round(value, precision):g} {suffix}"
    if magnitude >= 1e-3:
        return f"{round(value * 1e3, precision):g} m{suffix}"
    return f"{round(value * 1e6, precision):g} u{suffix}"


@dataclass(frozen=True)
class TrainingStep:
    """The training step a profile was taken in (what the engine knows, not the profiler).

    Attributes:
        world_size: Ranks in the job.
        dp_size: Ranks reading different samples.
        micro_batch_per_device: Samples per forward pass on one rank.
        micro_steps: Forward/backward passes in the step (gradient accumulation steps).
        forward_s: Forward seconds of the step (all its micro-steps).
        backward_s: Backward seconds of the step.
        step_s: Optimizer step seconds.
        recompute_fwd_factor: Forward passes recomputed in backward (0 none, 1 full); subtracted
            from the counted FLOPs for the model FLOPs utilisation.
    """

    world_size: int
    dp_size: int
    micro_batch_per_device: int
    micro_steps: int
    forward_s: float
    backward_s: float
    step_s: float
    recompute_fwd_factor: float = 0.0


@dataclass(frozen=True)
class ModuleProfile:
    """One module's numbers (totals over all of its calls while profiling).

    Attributes:
        name: Qualified name in the model (``""`` for the model itself).
        type_name: The module's class name.
        params: Parameters of the module and its children, each counted once.
        flops: Forward FLOPs.
        macs: Forward multiply-accumulates.
        backward_flops: Backward FLOPs (0 unless backward was counted).
        duration_s: Forward wall-clock seconds.
        calls: Forward calls.
        shared: Paths under which this module object appears (1 unless shared).
        children: The child modules' profiles.
    """

    name: str
    type_name: str
    params: int
    flops: int
    macs: int
    backward_flops: int
    duration_s: float
    calls: int
    shared: int = 1
    children: tuple[ModuleProfile, ...] = ()

    def walk(self, depth: int = 0) -> Iterator[tuple[int, ModuleProfile]]:
        """``(depth, profile)`` of this module and every descendant, depth first."""
        yield depth, self
        for child in self.children:
            yield from child.walk(depth + 1)


@dataclass(frozen=True)
class ModelProfile:
    """A whole profile.

    Attributes:
        root: The model's profile (its numbers are the totals).
        ops: Forward and backward FLOPs per aten operator, e.g. ``{"mm": (2048, 4096)}``.
        backward_counted: Whether backward operators were counted.
        peak_flops: The device's peak FLOP/s the utilisation is computed against, if known.
        training: The training step the profile was taken in, if any.
    """

    root: ModuleProfile
    ops: dict[str, tuple[int, int]] = field(default_factory=dict)
    backward_counted: bool = False
    peak_flops: float | None = None
    training: TrainingStep | None = None

    def as_json(self) -> dict[str, Any]:
        """The profile as JSON-ready data: summary, per-operator FLOPs and the module tree."""
        return {
            "summary": dict(_summary_items(self)),
            "ops": {name: {"forward": f, "backward": b} for name, (f, b) in self.ops.items()},
            "modules": asdict(self.root),
        }


def _params(module: torch.nn.Module, numel: Callable[[torch.nn.Parameter], int]) -> int:
    return sum(numel(p) for p in module.parameters())


def build_profile(
    model: torch.nn.Module,
    tallies: dict[int, ModuleTally],
    ops: dict[str, list[int]],
    *,
    backward_counted: bool,
    peak_flops: float | None,
    training: TrainingStep | None = None,
    param_numel: Callable[[torch.nn.Parameter], int] = torch.nn.Parameter.numel,
) -> ModelProfile:
    """Freeze the recorder's tallies into a module tree.

    Args:
        model: The profiled model.
        tallies: Per module object (by ``id``) accumulators.
        ops: Forward and backward FLOPs per operator name.
        backward_counted: Whether backward operators were counted.
        peak_flops: Peak FLOP/s of one device, for the utilisation.
        training: The training step, when the engine took the profile.
        param_numel: The elements a parameter stands for (a ZeRO stage-3 parameter is empty
            between uses; its owner gives the full count).
    """
    paths: dict[int, int] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        paths[id(module)] = paths.get(id(module), 0) + 1

    def node(name: str, module: torch.nn.Module) -> ModuleProfile:
        tally = tallies.get(id(module), ModuleTally())
        children = tuple(node(f"{name}.{n}" if name else n, c) for n, c in module.named_children())
        return ModuleProfile(
            name=name,
            type_name=type(module).__name__,
            params=_params(module, param_numel),
            flops=tally.flops,
            macs=tally.macs,
            backward_flops=tally.backward_flops,
            duration_s=tally.duration_s,
            calls=tally.calls,
            shared=paths.get(id(module), 1),
            children=children,
        )

    return ModelProfile(
        root=node("", model),
        ops={name: (f, b) for name, (f, b) in sorted(ops.items())},
        backward_counted=backward_counted,
        peak_flops=peak_flops,
        training=training,
    )


# --- text --------------------------------------------------------------------------------


def _rate(flops: float, seconds: float) -> float:
    return flops / seconds if seconds > 0 else 0.0


def _summary_items(profile: ModelProfile) -> Iterator[tuple[str, Any]]:
    root, step = profile.root, profile.training
    yield "params per device", root.params
    yield "fwd MACs per device", root.macs
    yield "fwd flops per device", root.flops
    if profile.backward_counted:
        yield "bwd flops per device (counted)", root.backward_flops
    yield "fwd latency (module hooks) s", root.duration_s
    yield "fwd FLOPS per device (module hooks)", _rate(root.flops, root.duration_s)
    if step is None:
        achieved = _rate(root.flops, root.duration_s)
    else:
        yield from _training_items(profile, step)
        iter_s = step.forward_s + step.backward_s + step.step_s
        achieved = _rate(_model_flops(profile, step), iter_s)
    if profile.peak_flops:
        yield "peak FLOPS per device", profile.peak_flops
        yield "MFU", achieved / profile.peak_flops


def _model_flops(profile: ModelProfile, step: TrainingStep) -> float:
    """The step's FLOPs without recomputation: counted backward when it was, else 2 × fwd."""
    fwd = profile.root.flops
    bwd = profile.root.backward_flops if profile.backward_counted else 2 * fwd
    return fwd + bwd - (step.recompute_fwd_factor * fwd if profile.backward_counted else 0)


def _training_items(profile: ModelProfile, step: TrainingStep) -> Iterator[tuple[str, Any]]:
    root = profile.root
    bwd = (
        root.backward_flops
        if profile.backward_counted
        else (2 + step.recompute_fwd_factor) * root.flops
    )
    iter_s = step.forward_s + step.backward_s + step.step_s
    samples = step.micro_batch_per_device * step.micro_steps * step.dp_size
    yield "world size", step.world_size
    yield "data parallel size", step.dp_size
    yield "batch size per device", step.micro_batch_per_device
    yield "fwd latency s", step.forward_s
    yield "fwd TFLOPS per device", _rate(root.flops, step.forward_s) / 1e12
    yield "bwd latency s", step.backward_s
    yield "bwd TFLOPS per device", _rate(bwd, step.backward_s) / 1e12
    yield "step latency s", step.step_s
    yield "iter latency s", iter_s
    yield "TFLOPS per device (fwd+bwd / iter latency)", _rate(root.flops + bwd, iter_s) / 1e12
    yield "samples/s", _rate(samples, iter_s)


def _format_value(key: str, value: Any) -> str:
    if key == "MFU":
        return f"{100 * value:.2f} %"
    if key.endswith(" s"):
        return number_to_string(value, "s")
    if "TFLOPS" in key or key == "samples/s":
        return f"{value:.2f}"
    if "FLOPS" in key:
        return number_to_string(value, "FLOPS")
    if "MACs" in key:
        return number_to_string(value, "MACs")
    if "flops" in key or "params" in key:
        return number_to_string(value).strip()
    return str(value)


def summary_text(profile: ModelProfile, profile_step: int) -> str:
    """The summary block."""
    lines = [f"Profile summary at step {profile_step}:"]
    for key, value in _summary_items(profile):
        label = key.removesuffix(" s")
        lines.append(f"{label + ':':<58}{_format_value(key, value)}")
    return "\n".join(lines)


def aggregated_text(profile: ModelProfile, module_depth: int, top_modules: int) -> str:
    """Per depth, the ``top_modules`` classes with the most params, MACs and latency."""
    per_depth: dict[int, dict[str, list[float]]] = {}
    for depth, module in profile.root.walk():
        entry = per_depth.setdefault(depth, {}).setdefault(module.type_name, [0, 0, 0.0])
        entry[0] += module.params
        entry[1] += module.macs
        entry[2] += module.duration_s
    last = max(per_depth) if module_depth == -1 else min(module_depth, max(per_depth))
    lines = [f"Top {top_modules} modules in params, MACs and fwd latency per depth:"]
    for depth in range(last + 1):
        rows = per_depth[depth]
        lines.append(f"depth {depth}:")
        for label, column, unit in (
            ("params", 0, ""),
            ("MACs", 1, "MACs"),
            ("fwd latency", 2, "s"),
        ):
            best = sorted(rows.items(), key=lambda item: item[1][column], reverse=True)
            shown = {k: number_to_string(v[column], unit).strip() for k, v in best[:top_modules]}
            lines.append(f"    {label:<12}- {shown}")
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.2f}%" if whole else "0%"


def detailed_text(profile: ModelProfile, module_depth: int) -> str:
    """The module tree with each module's numbers and shares of the model's totals."""
    root = profile.root
    lines = [
        "Each module: params, % of params, MACs, % of MACs, fwd latency, % of fwd latency, "
        "fwd FLOPS" + (", bwd flops" if profile.backward_counted else ""),
    ]
    for depth, module in root.walk():
        if module_depth != -1 and depth > module_depth:
            continue
        items = [
            f"{number_to_string(module.params).strip()} = "
            f"{_share(module.params, root.params)} Params",
            f"{number_to_string(module.macs, 'MACs')} = {_share(module.macs, root.macs)} MACs",
            f"{number_to_string(module.duration_s, 's')} = "
            f"{_share(module.duration_s, root.duration_s)} latency",
            number_to_string(_rate(module.flops, module.duration_s), "FLOPS"),
        ]
        if profile.backward_counted:
            items.append(f"{number_to_string(module.backward_flops).strip()} bwd flops")
        if module.shared > 1:
            items.append(f"shared by {module.shared} parents (totals over all calls)")
        name = module.name.rsplit(".", 1)[-1] or "(model)"
        lines.append(f"{'  ' * depth}({name}): {module.type_name}({', '.join(items)})")
    return "\n".join(lines)


def profile_text(
    profile: ModelProfile, *, profile_step: int, module_depth: int, top_modules: int, detailed: bool
) -> str:
    """The whole human-readable report."""
    rule = "-" * 30
    parts = [
        f"{rule} DeepShard FLOPs profiler {rule}",
        summary_text(profile, profile_step),
        f"\n{rule} Aggregated profile per device {rule}",
        aggregated_text(profile, module_depth, top_modules),
    ]
    if detailed:
        parts += [
            f"\n{rule} Detailed profile per device {rule}",
            detailed_text(profile, module_depth),
        ]
    if profile.ops:
        parts += [f"\n{rule} FLOPs per operator (fwd, bwd) {rule}"]
        parts += [f"{name:<48}{f:>16,}{b:>16,}" for name, (f, b) in profile.ops.items()]
    return "\n".join(parts) + "\n"
