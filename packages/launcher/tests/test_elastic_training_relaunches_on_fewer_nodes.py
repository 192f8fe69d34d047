"""``ds-launch --elastic_training``: torchrun agents re-form the job when a node goes away.

For real (the plan as data is `test_elastic_training_plan.py`): two local "nodes", each its own
``ds-launch`` with the same rendezvous, start a 2-rank gloo job; node b is SIGKILLed (agent and
worker, as a lost machine), and node a's agent re-forms the job alone: its worker starts again
with ``WORLD_SIZE=1`` and the launch succeeds. About 40 s on an idle 2-core box.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")

WORKER = """\
import json, os, sys, time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

out = Path(sys.argv[1])
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
world, restart = dist.get_world_size(), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
record = {"rank": dist.get_rank(), "world": world, "pid": os.getpid(), "agent": os.getppid()}
(out / f"{os.environ['NODE_TAG']}.restart{restart}.json").write_text(json.dumps(record))
while True:  # with a peer: reduce until it is gone (then gloo raises and the agent re-forms)
    value = torch.ones(1)
    dist.all_reduce(value)
    if world == 1:
        break
    time.sleep(0.1)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


def _node(tag: str, port: int, tmp_path: Path) -> subprocess.Popen[str]:
    args = [
        "--elastic_training",
        "--min_elastic_nodes",
        "1",
        "--max_elastic_nodes",
        "2",
        "--max_restarts",
        "2",
        "--master_port",
        str(port),
        "--launcher_args",
        "--monitor_interval=0.5 --rdzv_conf=last_call_timeout=10",
        "worker.py",
        "out",
    ]
    return subprocess.Popen(
        [*_probes.DS_LAUNCH, *args],
        cwd=tmp_path,
        env=_probes.launcher_env(NODE_TAG=tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _wait(path: Path, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path.name} did not appear in {timeout} s")
        time.sleep(0.1)
    time.sleep(0.1)  # written in one call; let it land
    return dict(json.loads(path.read_text()))


@pytest.mark.slow
def test_two_nodes_then_one(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "worker.py").write_text(WORKER)
    port = _free_port()
    first = _node("a", port, tmp_path)  # hosts the rendezvous store: it must survive
    nodes = [first]
    try:
        # generous bounds: on a loaded 2-core box importing torch in two agents and two workers
        # took 20-45 s; on an idle one the whole test takes about 30 s
        deadline = time.monotonic() + 180
        while not _listening(port):
            assert time.monotonic() < deadline, "node a's agent never opened the rendezvous"
            assert first.poll() is None, first.communicate()[0]
            time.sleep(0.1)
        nodes.append(_node("b", port, tmp_path))
        a0, b0 = _wait(out / "a.restart0.json", 240), _wait(out / "b.restart0.json", 240)
        assert (a0["world"], b0["world"]) == (2, 2)
        assert sorted((a0["rank"], b0["rank"])) == [0, 1]
        for pid in (b0["pid"], b0["agent"]):  # node b is lost: no goodbye to the rendezvous
            os.kill(pid, signal.SIGKILL)
        a1 = _wait(out / "a.restart1.json", 240)
        assert (a1["world"], a1["rank"]) == (1, 0)
        output, _ = first.communicate(timeout=120)
        assert first.returncode == 0, output
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
            node.communicate(timeout=30)
