"""``ds-launch --elastic_training``: the torchrun agents' arguments and the refusals, as data.

The real 2 -> 1 node relaunch is `test_elastic_training_relaunches_on_fewer_nodes.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher._elastic import ElasticNodes
from deepshard.launcher._plan import LaunchOptions, plan_launch
from deepshard.launcher._ranks import RunOptions
from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")


def _plan(tmp_path: Path, **options: object) -> object:
    return plan_launch(
        LaunchOptions(run=RunOptions(script="train.py"), **options),  # type: ignore[arg-type]
        environ={"PATH": "/usr/bin", "DEEPSHARD_NUM_ACCELERATORS": "0"},
        cwd=str(tmp_path),
        home=str(tmp_path / "home"),
        python="/py",
    )


def test_the_agents_meet_in_a_c10d_rendezvous(tmp_path: Path) -> None:
    plan = _plan(
        tmp_path,
        elastic=ElasticNodes(1, 2),
        master_port=29999,
        max_restarts=3,
        launcher_args="--monitor_interval=1",
    )
    (agent,) = plan.specs  # type: ignore[attr-defined]
    argv = list(agent.argv)
    assert argv[:3] == ["/py", "-m", "torch.distributed.run"]
    tail = argv[argv.index("--master_port=29999") + 1 :]
    assert tail == [
        "--nnodes=1:2",  # after the fixed --nnodes=1, so torchrun takes this one
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=127.0.0.1:29999",
        "--rdzv_id=deepshard-127-0-0-1-29999",
        "--max_restarts=3",
        "--monitor_interval=1",
        "train.py",
    ]


def test_elastic_refusals(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match="--elastic_training runs PyTorch's elastic agent"):
        _plan(tmp_path, elastic=ElasticNodes(1, 2), launcher="openmpi")
    with pytest.raises(LaunchError, match="below --min_elastic_nodes"):
        ElasticNodes(3, 2)
    with pytest.raises(LaunchError, match="--min_elastic_nodes must be at least 1"):
        ElasticNodes(0, 2)
    done = _probes.ds_launch("--min_elastic_nodes", "1", "x.py", cwd=tmp_path, timeout=30)
    assert done.returncode == 2 and "need --elastic_training" in done.stderr
