"""What `zero.py` prints from the ranks' reports: the table, the ratios, the exit status.

Functions of plain data (no torch), so the integration tests check them on made-up rows. A row
is either measured (``best_s``, ``median_s``, ``rss_delta``, ``losses``, ``params``,
``tensor_bytes``) or ``{"refused": "<first line of DeepShard's ConfigError>"}``: a refused row
is printed as refused, every ratio that needs it says so instead of a number, and the run
exits `EXIT_REFUSED`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import _bench_json
from _zero_lineup import PAIRINGS, Pairing

Row = dict[str, Any]
EXIT_OK, EXIT_FAILED, EXIT_REFUSED = 0, 1, 2
LOSS_AGREEMENT = {"fp32": 1e-3, "bf16": 2e-2}  # bf16 losses are rounded to 8 mantissa bits
_MEASURES = {"best_s": "step time", "rss_delta": "peak RSS growth"}


def summarise(reports: list[list[dict[str, Any]]]) -> Row:
    """One row from every round's per-rank reports (``reports[round][rank]``).

    Step times are rank 0's; memory is the larger rank's peak RSS growth over all rounds.
    """
    refusals = [r["refused"] for ranks in reports for r in ranks if "refused" in r]
    if refusals:
        return {"refused": refusals[0]}
    times = [t for ranks in reports for t in ranks[0]["times"]]
    rss = [r["rss_delta"] for ranks in reports for r in ranks if r["rss_delta"] is not None]
    return {
        "best_s": min(times),
        "median_s": statistics.median(times),
        "rss_delta": max(rss) if rss else None,
        "losses": reports[-1][0]["losses"],
        "params": reports[-1][0]["params"],
        "tensor_bytes": reports[-1][0]["tensor_bytes"],
    }


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def table(rows: dict[str, Row]) -> list[str]:
    """The markdown table, refusal lines and DeepShard's tensor-byte lines."""
    lines = [
        "| competitor | best s/step | median s/step | peak RSS growth MiB/rank | first loss "
        "| last loss |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        if "refused" in row:
            lines.append(f"| {name} | REFUSED | - | - | - | - |")
            continue
        first, last = row["losses"][0], row["losses"][-1]
        lines.append(
            f"| {name} | {row['best_s']:.4f} | {row['median_s']:.4f} | "
            f"{_mib(row['rss_delta'])} | {first:.5f} | {last:.5f} |"
        )
    lines += [f"{name} refused: {row['refused']}" for name, row in rows.items() if "refused" in row]
    for name, row in rows.items():
        if row.get("tensor_bytes"):
            parts = ", ".join(
                f"{k.replace('_', ' ')} {_mib(v)}" for k, v in row["tensor_bytes"].items()
            )
            lines.append(f"{name} tensor bytes per rank (MiB): {parts}")
    return lines


def _ratio_line(pairing: Pairing, ours: Row, theirs: Row) -> str:
    label = _MEASURES[pairing.measure]
    head = f"{pairing.ours} / {pairing.theirs}: {label} ratio"
    if "refused" in ours:
        return f"{head}: REFUSED (DeepShard refused {pairing.ours}'s config, see above)"
    if not ours[pairing.measure] or not theirs[pairing.measure]:
        return f"{head}: n/a (not measured on this machine)"
    ratio = ours[pairing.measure] / theirs[pairing.measure]
    if pairing.target is None:
        text = f"{head} {ratio:.3f} (no target)"
    else:
        met = ratio <= pairing.target
        verdict = "MET" if met else f"MISSED by {ratio - pairing.target:.3f}"
        text = f"{head} {ratio:.3f} (target <= {pairing.target}): {verdict}"
    if pairing.measure == "best_s":
        text += f", median ratio {ours['median_s'] / theirs['median_s']:.3f}"
        if ours["rss_delta"] and theirs["rss_delta"]:
            text += f", memory ratio {ours['rss_delta'] / theirs['rss_delta']:.2f}"
    return text


def verdicts(rows: dict[str, Row], pairings: Iterable[Pairing] = PAIRINGS) -> list[str]:
    """A line per pairing whose two rows both raced (one of them may have been refused)."""
    return [
        _ratio_line(p, rows[p.ours], rows[p.theirs])
        for p in pairings
        if p.ours in rows and p.theirs in rows and "refused" not in rows[p.theirs]
    ]


def loss_disagreements(rows: dict[str, Row], dtype: str) -> list[str]:
    """Rows whose last loss is off the reference's (DDP, else FSDP2, else the first row)."""
    measured = {n: r for n, r in rows.items() if "refused" not in r}
    if not measured:
        return []
    name = next((n for n in ("ddp", "fsdp2") if n in measured), next(iter(measured)))
    last = measured[name]["losses"][-1]
    tolerance = LOSS_AGREEMENT[dtype]
    return [
        f"{n}: last loss {r['losses'][-1]:.6f} differs from {name}'s {last:.6f}"
        for n, r in measured.items()
        if abs(r["losses"][-1] - last) > tolerance * abs(last)
    ]


def exit_status(rows: dict[str, Row], disagreements: list[str]) -> int:
    """`EXIT_FAILED` on disagreeing losses, else `EXIT_REFUSED` when a row was refused."""
    if disagreements:
        return EXIT_FAILED
    return EXIT_REFUSED if any("refused" in r for r in rows.values()) else EXIT_OK


def write_json(
    path: Path | None,
    reports: dict[str, list[list[dict[str, Any]]]],
    rows: dict[str, Row],
    missing: dict[str, str],
) -> None:
    """The `run.py` report: each pairing's ratios (per round for step time) and the figures.

    Every pair the report compares gets both measures: a round's step time is its fastest step,
    as in the verdicts (one ratio per round); memory is one figure per row.
    """
    out = []
    for ours, theirs in dict.fromkeys((p.ours, p.theirs) for p in PAIRINGS):
        a, b = rows.get(ours), rows.get(theirs)
        if a is None or b is None or "refused" in a or "refused" in b:
            continue
        best = [[min(ranks[0]["times"]) for ranks in reports[n]] for n in (ours, theirs)]
        ratios = _bench_json.paired_ratios(best[0], best[1])
        out.append(_bench_json.ratio_row(ours, theirs, _MEASURES["best_s"], ratios))
        if a["rss_delta"] and b["rss_delta"]:
            memory = [a["rss_delta"] / b["rss_delta"]]
            out.append(_bench_json.ratio_row(ours, theirs, _MEASURES["rss_delta"], memory))
    figures = {
        name: {
            "time_s": [t for ranks in reports[name] for t in ranks[0]["times"]],
            "peak_mib": None if row["rss_delta"] is None else row["rss_delta"] / 2**20,
            "stage": _stage(name),
        }
        for name, row in rows.items()
        if "refused" not in row
    }
    missing = {
        **missing,
        **{n: f"refused: {r['refused']}" for n, r in rows.items() if "refused" in r},
    }
    _bench_json.write(path, "zero", out, figures, missing)


def _stage(name: str) -> str:
    """The ZeRO stage a row runs (``ddp`` is stage 0's baseline, ``fsdp2*`` stage 3's)."""
    if name == "ddp":
        return "0"
    if name.startswith("fsdp2"):
        return "3" + name.removeprefix("fsdp2")
    return name.split("-", 1)[1]
