"""Launch latency: ``ds-launch`` against ``torchrun``, until every rank is past init_distributed.

Both launchers start the same 2-rank script on this machine. Each rank calls
``deepshard.comm.init_distributed(backend="gloo")`` and, as soon as it returns, writes
``time.time()`` to a file of its own. The latency of one launch is
``max(rank timestamps) - the time just before the launcher's process was created``: it covers
the launcher's own start-up, starting the ranks, their imports (torch dominates) and the
rendezvous, which is what a user waits for. The total (until the launcher exits) is shown too.

The launchers run alternately (ds-launch, torchrun, ds-launch, ...) so that a slow phase of a
shared machine hits both alike; medians over ``--runs`` launches each are compared. The target
is met when ds-launch's median is no larger than torchrun's.

Run from the repository root::

    uv run --no-sync python tools/bench/launch.py --runs 5

The same file is also the rank script (``--as-rank DIR``), so both launchers run identical code.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import _bench_json
import _ranks

LAUNCHERS = ("ds-launch", "torchrun")


def _rank_main(out_dir: Path) -> None:
    """Body of every rank: join the world, stamp the time, leave."""
    import torch.distributed as dist

    from deepshard.comm import init_distributed

    info = init_distributed(backend="gloo")
    stamp = time.time()
    (out_dir / f"rank{info.rank}.time").write_text(repr(stamp))
    dist.destroy_process_group()


@dataclass(frozen=True)
class Launch:
    """One timed launch.

    Attributes:
        launcher: ``"ds-launch"`` or ``"torchrun"``.
        to_init_s: Seconds from the launcher's start until the last rank left init_distributed.
        total_s: Seconds until the launcher exited.
    """

    launcher: str
    to_init_s: float
    total_s: float


def _program(name: str) -> str:
    """The console script ``name`` beside this interpreter (the venv), else on ``PATH``."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise SystemExit(f"launch bench: {name} not found beside {sys.executable} or on PATH")
    return found


def _command(launcher: str, nproc: int, out_dir: Path) -> list[str]:
    rank_args = [str(Path(__file__).resolve()), "--as-rank", str(out_dir)]
    if launcher == "ds-launch":
        return [
            _program("ds-launch"),
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(_ranks.free_port()),
            *rank_args,
        ]
    return [_program("torchrun"), "--standalone", "--nproc_per_node", str(nproc), *rank_args]


def _launch_once(launcher: str, nproc: int, timeout_s: float) -> Launch:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="ds-launch-bench-") as tmp:
        out_dir = Path(tmp)
        command = _command(launcher, nproc, out_dir)
        start = time.time()
        try:
            done = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired as error:
            raise SystemExit(f"launch bench: {launcher} ran past {timeout_s:.0f} s") from error
        total = time.time() - start
        stamps = sorted(out_dir.glob("rank*.time"))
        if done.returncode != 0 or len(stamps) != nproc:
            tail = (done.stdout + done.stderr)[-3000:]
            raise SystemExit(
                f"launch bench: {' '.join(command)} exited {done.returncode} with "
                f"{len(stamps)} of {nproc} ranks past init_distributed:\n{tail}"
            )
        last = max(float(path.read_text()) for path in stamps)
    return Launch(launcher, last - start, total)


def run_bench(runs: int, nproc: int, timeout_s: float) -> list[Launch]:
    """``runs`` launches per launcher, alternating, each printed as it finishes."""
    print(f"{'run':>3}  {'launcher':<9}  {'to init [s]':>11}  {'total [s]':>9}", flush=True)
    launches = []
    for index in range(runs):
        for launcher in LAUNCHERS:
            launch = _launch_once(launcher, nproc, timeout_s)
            launches.append(launch)
            print(
                f"{index + 1:>3}  {launcher:<9}  {launch.to_init_s:>11.3f}  {launch.total_s:>9.3f}",
                flush=True,
            )
    return launches


def summarise(launches: list[Launch]) -> str:
    """The medians per launcher, their ratio and the verdict on the target."""
    medians = {}
    lines = ["", f"{'launcher':<9}  {'median to init [s]':>18}  {'median total [s]':>16}"]
    for launcher in LAUNCHERS:
        mine = [launch for launch in launches if launch.launcher == launcher]
        medians[launcher] = statistics.median(launch.to_init_s for launch in mine)
        total = statistics.median(launch.total_s for launch in mine)
        lines.append(f"{launcher:<9}  {medians[launcher]:>18.3f}  {total:>16.3f}")
    ratio = round(medians["ds-launch"] / medians["torchrun"], 3)  # judge what is printed
    verdict = "MET" if ratio <= 1.0 else "MISSED"
    lines.append(f"ratio ds-launch / torchrun (median to init): {ratio:.3f}")
    lines.append(f"target: ds-launch no slower than torchrun: {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the bench (or one rank with ``--as-rank``), print the result."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="launches per launcher (default 5)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks per launch (default 2)")
    parser.add_argument(
        "--timeout", type=float, default=180.0, help="seconds one launch may take (default 180)"
    )
    parser.add_argument("--json", type=Path, help="also write the ratios as JSON (for run.py)")
    parser.add_argument("--as-rank", type=Path, help=argparse.SUPPRESS)
    # Launchers may append their own flags to the rank's arguments (e.g. --local_rank=N).
    args, _ = parser.parse_known_args(argv)
    if args.as_rank is not None:
        _rank_main(args.as_rank)
        return 0
    if args.runs < 1 or args.nproc < 1:
        parser.error("--runs and --nproc must be at least 1")
    print(
        f"launch bench: {args.nproc} ranks on this machine, {args.runs} launch(es) per launcher, "
        "alternating; latency = launcher start -> last rank past init_distributed (gloo)"
    )
    launches = run_bench(args.runs, args.nproc, args.timeout)
    print(summarise(launches))
    _write_json(args.json, launches)
    return 0


def _write_json(path: Path | None, launches: list[Launch]) -> None:
    """The per-launcher latencies and the run-by-run ratios (launches alternate in pairs)."""
    by = {name: [x.to_init_s for x in launches if x.launcher == name] for name in LAUNCHERS}
    ratios = _bench_json.paired_ratios(by["ds-launch"], by["torchrun"])
    rows = [_bench_json.ratio_row("ds-launch", "torchrun", "time to init", ratios)]
    figures = {name: {"time_s": times, "peak_mib": None} for name, times in by.items()}
    _bench_json.write(path, "launch", rows, figures)


if __name__ == "__main__":
    raise SystemExit(main())
