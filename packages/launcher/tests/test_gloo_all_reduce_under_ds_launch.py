"""A real 2-rank job: deepshard.comm.init_distributed() joins the world ds-launch describes."""

from __future__ import annotations

import json
from pathlib import Path

from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")

RANK_SCRIPT = """\
import argparse, json
from pathlib import Path

import torch
import torch.distributed as dist
from deepshard.comm import init_distributed

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--local_rank", type=int, required=True)  # passed by ds-launch
args = parser.parse_args()
info = init_distributed(backend="gloo")
value = torch.tensor([float(info.rank + 1)], dtype=torch.float64)
dist.all_reduce(value)
record = {"rank": info.rank, "world": info.world_size, "local_rank": info.local_rank,
          "arg_local_rank": args.local_rank, "sum": value.item(), "backend": info.backend}
(args.out / f"rank{info.rank}.json").write_text(json.dumps(record))
dist.destroy_process_group()
"""


def test_two_ranks_all_reduce_over_gloo(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "rank.py").write_text(RANK_SCRIPT)
    done = _probes.ds_launch(
        "--nproc_per_node", "2", "--master_port", "0", "rank.py", "out", cwd=tmp_path, timeout=240
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    expected = float(sum(rank + 1 for rank in range(2)))
    for rank, record in enumerate(records):
        assert record == {
            "rank": rank,
            "world": 2,
            "local_rank": rank,
            "arg_local_rank": rank,
            "sum": expected,
            "backend": "gloo",
        }
