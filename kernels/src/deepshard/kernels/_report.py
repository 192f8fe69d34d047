"""What each DeepShard kernel runs on here: compiled or pure-torch twin, and why.

``python -m deepshard.kernels`` prints `kernel_report()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepshard.kernels import _extension
from deepshard.kernels._fused_adam import fused_adam_status
from deepshard.kernels._simd import REFERENCE
from deepshard.kernels._weighted_sum import fused_weighted_sum_status

__all__ = ["KernelReport", "OpReport", "kernel_report"]


@dataclass(frozen=True)
class OpReport:
    """The state of one op.

    Attributes:
        name: The op, e.g. ``"cpu_adam_step"``.
        compiled: Whether the compiled implementation runs (else the pure-torch twin).
        backend: The SIMD path (``"avx512"``, ``"neon"``...), the device (``"cuda"``), or
            ``"reference"`` for the twin.
        fallback_reason: Why the twin runs; ``None`` when compiled.
        detail: Anything else worth knowing (usable SIMD paths, build description).
    """

    name: str
    compiled: bool
    backend: str
    fallback_reason: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class KernelReport:
    """One `OpReport` per op."""

    ops: tuple[OpReport, ...]

    def op(self, name: str) -> OpReport:
        """Returns the report of op ``name``; KeyError when there is none."""
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op named {name!r}; ops: {', '.join(o.name for o in self.ops)}")

    def format(self) -> str:
        """A human-readable table, one line per op."""
        width = max(len(op.name) for op in self.ops)
        backend_width = max(len(op.backend) for op in self.ops)
        lines = ["deepshard-kernels"]
        for op in self.ops:
            state = "compiled" if op.compiled else "fallback"
            line = f"  {op.name:<{width}}  {state:<8}  {op.backend:<{backend_width}}"
            if op.fallback_reason is not None:
                line += f"  ({op.fallback_reason})"
            if op.detail:
                line += f"  [{op.detail}]"
            lines.append(line)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _cpu_reports() -> list[OpReport]:
    extension = _extension.CPU_EXTENSION.get()
    if extension is None:
        reason = _extension.CPU_EXTENSION.failure()
        return [
            OpReport(name, False, REFERENCE, reason) for name in ("cpu_adam_step", "cpu_lion_step")
        ]
    detail = "usable SIMD paths: " + ", ".join(extension.supported_paths())
    return [
        OpReport(name, True, extension.active_path(), None, detail)
        for name in ("cpu_adam_step", "cpu_lion_step")
    ]


def kernel_report() -> KernelReport:
    """Loads the extensions (if not yet loaded) and reports what each op runs on."""
    compiled, description = fused_adam_status()
    fused = OpReport(
        "fused_adam_step",
        compiled,
        "cuda" if compiled else REFERENCE,
        None if compiled else description,
        description if compiled else "",
    )
    weighted, why = fused_weighted_sum_status()
    combine = OpReport(
        "fused_weighted_sum",
        weighted,
        "triton" if weighted else REFERENCE,
        None if weighted else why,
        why if weighted else "",
    )
    return KernelReport((*_cpu_reports(), fused, combine))
