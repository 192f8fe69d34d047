"""The ``ds-checkpoint`` command line: inspect, verify, export, reshard, import-deepspeed.

Only the standard library is imported until the arguments are parsed, so ``--help`` and a bad
argument answer at once without torch; each command imports what it needs when it runs.
Failures are one line on stderr, ``ds-checkpoint: error: ...`` (exit status 1; 2 for usage).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

__all__ = ["build_parser", "main"]

_EPILOG = """\
examples:
  ds-checkpoint inspect ckpt/                       the latest tag: topology, tensors, sizes
  ds-checkpoint verify ckpt/global_step100          checksums and shard-map coverage
  ds-checkpoint export ckpt/ hf/ --dtype bf16 --config config.json
  ds-checkpoint reshard ckpt/ ckpt-dp8/ --dp 8 --stage 3
  ds-checkpoint import-deepspeed ds_ckpt/ ckpt/     ZeRO 0-3 or universal, never unpickles
"""


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    parser = argparse.ArgumentParser(
        prog="ds-checkpoint",
        description="Inspect, verify, export, reshard and import DeepShard checkpoints.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    tag_help = "the tag to read (default: the one 'latest' names, or DIR itself)"

    inspect = sub.add_parser("inspect", help="tag, topology, tensors, sizes and dtypes")
    inspect.add_argument("dir", metavar="DIR")
    inspect.add_argument("--tag", help=tag_help)
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")

    verify = sub.add_parser("verify", help="check every file's digests and each map's coverage")
    verify.add_argument("dir", metavar="DIR")
    verify.add_argument("--tag", help=tag_help)

    export = sub.add_parser("export", help="consolidated Hugging Face-style safetensors")
    export.add_argument("dir", metavar="DIR")
    export.add_argument("out", metavar="OUT")
    export.add_argument("--tag", help=tag_help)
    export.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    export.add_argument("--max-shard-size", default="5GB", help="split above this (default 5GB)")
    export.add_argument("--config", help="a config.json to copy beside the weights")

    reshard = sub.add_parser("reshard", help="rewrite for another data-parallel size offline")
    reshard.add_argument("dir", metavar="DIR")
    reshard.add_argument("out", metavar="OUT")
    reshard.add_argument("--tag", help=tag_help)
    reshard.add_argument("--dp", type=_positive, required=True, help="data-parallel ranks")
    reshard.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2, help="ZeRO stage")

    imported = sub.add_parser("import-deepspeed", help="convert a DeepSpeed checkpoint")
    imported.add_argument("ds_dir", metavar="DS_DIR")
    imported.add_argument("out", metavar="OUT")
    imported.add_argument("--tag", help="the DeepSpeed tag (default: its 'latest')")
    imported.add_argument("--out-tag", help="the DeepShard tag (default: the DeepSpeed tag)")
    return parser


@contextmanager
def _progress(description: str) -> Iterator[Callable[[str], None]]:
    """A rich progress line on a terminal; each call names the item being worked on."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def step(item: str) -> None:
            bar.update(task, description=f"{description}: {item}", advance=1)

        yield step


def _human(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{size:.1f} TiB"


def _summary(path: str, tag: str | None) -> dict[str, Any]:
    import math

    from deepshard.checkpoint._layout import read_metadata, tag_dir_of

    tag_dir = tag_dir_of(path, tag)
    meta = read_metadata(tag_dir)
    sizes = {"float64": 8, "float32": 4, "int64": 8, "int32": 4, "bool": 1, "uint8": 1}
    tensors = []
    for name, entry in sorted(meta["tensors"].items()):
        smap = entry["shard_map"]
        numel = math.prod(smap["global_shape"])
        ranks = sorted({int(h) for p in smap["pieces"] for h in p.get("holders", [p["rank"]])})
        tensors.append(
            {
                "name": name,
                "shape": smap["global_shape"],
                "dtype": smap["dtype"],
                "bytes": numel * sizes.get(smap["dtype"], 2),
                "pieces": len(smap["pieces"]),
                "ranks": ranks,
            }
        )
    engine = meta["metadata"].get("engine", {}) if isinstance(meta["metadata"], dict) else {}
    return {
        "path": str(tag_dir),
        "tag": meta["tag"],
        "format_version": meta["format_version"],
        "world_size": meta["world_size"],
        "topology": engine.get("topology") if isinstance(engine, dict) else None,
        "versions": meta.get("versions", {}),
        "files": {f: e["size"] for f, e in sorted(meta["files"].items())},
        "tensors": tensors,
        "total_bytes": sum(t["bytes"] for t in tensors),
    }


def _inspect(args: argparse.Namespace) -> int:
    summary = _summary(args.dir, args.tag)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    topology = summary["topology"] or f"{summary['world_size']} rank(s)"
    console.print(
        f"[bold]{summary['tag']}[/bold]  {summary['path']}\n"
        f"format {summary['format_version']}, world size {summary['world_size']}, topology "
        f"{topology}, {len(summary['files'])} file(s), {len(summary['tensors'])} tensors, "
        f"{_human(summary['total_bytes'])}"
    )
    table = Table("tensor", "shape", "dtype", "size", "pieces", "ranks")
    for t in summary["tensors"]:
        ranks = ",".join(map(str, t["ranks"])) if len(t["ranks"]) <= 8 else f"{len(t['ranks'])}"
        table.add_row(
            t["name"],
            "x".join(map(str, t["shape"])) or "scalar",
            t["dtype"],
            _human(t["bytes"]),
            str(t["pieces"]),
            ranks,
        )
    console.print(table)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from deepshard.checkpoint._verify import verify

    report = verify(args.dir, args.tag)
    if report.ok:
        print(
            f"OK {report.path}: {report.files_checked} file(s) match their digests, "
            f"{report.tensors_checked} tensors fully covered"
        )
        return 0
    for problem in report.problems:
        print(f"FAILED {problem}", file=sys.stderr)
    print(f"ds-checkpoint: {report.path}: {len(report.problems)} problem(s)", file=sys.stderr)
    return 1


def _export(args: argparse.Namespace) -> int:
    from deepshard.checkpoint._export import export_weights

    with _progress("exporting") as step:
        files = export_weights(
            args.dir,
            args.out,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            tag=args.tag,
            config=args.config,
            progress=step,
        )
    print(f"wrote {len(files)} file(s) to {args.out} ({args.dtype})")
    return 0


def _reshard(args: argparse.Namespace) -> int:
    from deepshard.checkpoint._convert import reshard

    with _progress("resharding") as step:
        path = reshard(
            args.dir, args.out, dp=args.dp, stage=args.stage, tag=args.tag, progress=step
        )
    print(f"wrote {path} for {args.dp} rank(s) at ZeRO stage {args.stage}")
    return 0


def _import_deepspeed(args: argparse.Namespace) -> int:
    from deepshard.checkpoint._convert import import_deepspeed

    with _progress("reading DeepSpeed files") as step:
        path = import_deepspeed(
            args.ds_dir, args.out, tag=args.tag, out_tag=args.out_tag, progress=step
        )
    print(f"wrote {path}")
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "inspect": _inspect,
    "verify": _verify,
    "export": _export,
    "reshard": _reshard,
    "import-deepspeed": _import_deepspeed,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``ds-checkpoint``; returns the exit status."""
    args = build_parser().parse_args(argv)
    from deepshard.interface.errors import DeepShardError

    try:
        return _COMMANDS[args.command](args)
    except DeepShardError as exc:
        print(f"ds-checkpoint: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
