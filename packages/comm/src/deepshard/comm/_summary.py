"""Aggregation and text formatting of the comms logger's summary table."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CallStats", "format_bytes", "format_table"]

_HEADER = (
    "op",
    "log name",
    "size",
    "ranks",
    "count",
    "total ms",
    "avg ms",
    "algbw GB/s",
    "busbw GB/s",
)


@dataclass
class CallStats:
    """Running totals of the calls sharing one (op, log name, message size, group size)."""

    count: int = 0
    total_latency_s: float = 0.0
    total_algbw: float = 0.0
    total_busbw: float = 0.0
    note: str | None = None

    def add(self, latency_s: float, algbw: float, busbw: float, note: str | None) -> None:
        """Count one more call."""
        self.count += 1
        self.total_latency_s += latency_s
        self.total_algbw += algbw
        self.total_busbw += busbw
        self.note = note or self.note


def format_bytes(n: int) -> str:
    """`n` bytes in binary units, e.g. `"4.00 KiB"`; exact below 1 KiB (`"12 B"`)."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"


def format_table(stats: dict[tuple[str, str, int, int], CallStats]) -> str:
    """The summary as a text table, one row per (op, log name, size, group size), sorted.

    Notes of rows that used a fallback bandwidth factor follow the table.
    """
    if not stats:
        return "comms logger: no calls logged"
    rows = []
    notes = []
    for (op, log_name, msg_bytes, world_size), s in sorted(stats.items()):
        rows.append(
            (
                op,
                log_name,
                format_bytes(msg_bytes),
                str(world_size),
                str(s.count),
                f"{s.total_latency_s * 1e3:.3f}",
                f"{s.total_latency_s * 1e3 / s.count:.3f}",
                f"{s.total_algbw / s.count / 1e9:.4g}",
                f"{s.total_busbw / s.count / 1e9:.4g}",
            )
        )
        if s.note and s.note not in notes:
            notes.append(s.note)
    widths = [max(len(r[i]) for r in [_HEADER, *rows]) for i in range(len(_HEADER))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [_HEADER, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.extend(f"note: {note}" for note in notes)
    return "\n".join(lines)
