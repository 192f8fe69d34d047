"""Launcher edges: bad input is refused with a message naming the flag, before any rank starts;
CPU slot filters agree with counts; the free-port probe ignores TIME-WAIT; ``--launcher_args``
values that start with a dash parse as one value."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deepshard.interface.errors import LaunchError
from deepshard.launcher import LaunchOptions, RunOptions, plan_launch
from deepshard.launcher._ports import check_master_addr, port_is_free, resolve_master_port
from deepshard.launcher.cli import main, parse_args
from deepshard.testing import import_beside

_probes = import_beside(__file__, "_probes.py")
_TCP_TIME_WAIT = "06"  # the state column of /proc/net/tcp


def _plan(tmp_path: Path, **options: Any) -> Any:
    return plan_launch(
        LaunchOptions(run=RunOptions(script="train.py"), **options),
        environ=_probes.launcher_env(),
        cwd=str(tmp_path),
        home=str(tmp_path),
        python=sys.executable,
    )


@pytest.mark.parametrize(
    ("addr", "words"),
    [
        ("999.1.1.1", "is neither an IP address nor a host name"),
        ("not_a_host..x", "is neither an IP address nor a host name"),
        ("two words", "is neither an IP address nor a host name"),
        ("no-such-host.invalid", "does not resolve on this machine"),  # .invalid never does
    ],
)
def test_a_bad_master_addr_is_refused_when_planning(tmp_path: Path, addr: str, words: str) -> None:
    with pytest.raises(LaunchError, match=f"--master_addr '{addr}' {words}"):
        _plan(tmp_path, master_addr=addr, nproc_per_node=2)


def test_good_master_addrs_pass() -> None:
    for addr in ("127.0.0.1", "::1", "localhost", "10.0.0.1"):
        check_master_addr(addr)
    check_master_addr("worker-0.cluster", resolve=False)  # well formed; not looked up


@pytest.mark.parametrize("flag", ["nproc_per_node", "num_gpus", "num_nodes"])
@pytest.mark.parametrize("count", [0, -2])
def test_counts_below_one_name_the_flag(tmp_path: Path, flag: str, count: int) -> None:
    with pytest.raises(LaunchError, match=f"--{flag} must be at least 1, got {count}"):
        _plan(tmp_path, **{flag: count})


def test_cpu_include_slots_agree_with_num_gpus(tmp_path: Path) -> None:
    by_count = _plan(tmp_path, num_gpus=2)
    by_filter = _plan(tmp_path, include="localhost:0,1")
    assert by_count.layout == by_filter.layout
    assert [node.slots for node in by_filter.layout.nodes] == [(0, 1)]
    ranks = [[dict(spec.shown_env) for spec in plan.specs] for plan in (by_count, by_filter)]
    assert ranks[0] == ranks[1] and [env["LOCAL_RANK"] for env in ranks[1]] == ["0", "1"]


def test_a_count_with_a_filter_is_refused_without_a_hostfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(["--num_gpus", "1", "-i", "localhost", "x.py"]) == 1
    assert capsys.readouterr().err == (
        "ds-launch: error: --include cannot be combined with --num_nodes/--num_gpus/"
        "--nproc_per_node; name the slots in --include instead\n"
    )


def test_a_missing_script_is_refused_before_the_ranks_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["--nproc_per_node", "2", "nested/missing.py"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ds-launch: error: the script 'nested/missing.py' does not exist")
    assert str(tmp_path / "nested" / "missing.py") in err and "rank" not in err


def test_bind_core_list_out_of_order_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    assert main(["--bind_core_list", "8,2-6", "x.py"]) == 1
    assert "--bind_core_list '8,2-6': '2-6' does not come after CPU 8" in capsys.readouterr().err


def test_launcher_args_starting_with_a_dash_are_one_value() -> None:
    args = parse_args(
        ["-H", "hf", "--launcher_args", "-mca btl_tcp_if_include eth1", "-m", "train", "-x"]
    )
    assert args.launcher_args == "-mca btl_tcp_if_include eth1"
    assert (args.hostfile, args.module, args.user_script, args.user_args) == (
        "hf",
        True,
        "train",
        ["-x"],
    )
    # After the script every word is the script's, --launcher_args included.
    args = parse_args(["train.py", "--launcher_args", "-v"])
    assert (args.launcher_args, args.user_args) == ("", ["--launcher_args", "-v"])


def _tcp_states(port: int) -> set[str]:
    states = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as handle:
            for line in handle.readlines()[1:]:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    states.add(fields[3])
    return states


def _port_in_time_wait() -> int:
    """A loopback port whose only socket is a closed connection in TIME-WAIT.

    What a finished job leaves on its rendezvous port: torch's store server (which sets
    ``SO_REUSEADDR``, as does every libuv server) closed its accepted connections first.
    """
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port: int = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # the server's end closes first, so it is the one left in TIME-WAIT
        time.sleep(0.05)
        client.close()
    deadline = time.monotonic() + 5
    while _tcp_states(port) != {_TCP_TIME_WAIT} and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _tcp_states(port) == {_TCP_TIME_WAIT}
    return port


def test_a_port_in_time_wait_is_free_and_a_listening_one_is_busy() -> None:
    port = _port_in_time_wait()
    with socket.socket() as plain, pytest.raises(OSError):  # the old check's bind: refused
        plain.bind(("127.0.0.1", port))
    assert port_is_free("127.0.0.1", port)
    assert resolve_master_port("127.0.0.1", port) == (port, None)  # no "port is in use" note
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a store server
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        busy = listener.getsockname()[1]
        assert not port_is_free("127.0.0.1", busy)
        chosen, note = resolve_master_port("127.0.0.1", busy)
        assert chosen != busy and note is not None and f"port {busy} on 127.0.0.1 is in use" in note


def test_ds_launch_prints_a_bad_master_addr_once_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "probe.py").write_text("open('started', 'w').close()\n")
    done = _probes.ds_launch(
        "--nproc_per_node", "2", "--master_addr", "999.1.1.1", "probe.py", cwd=tmp_path
    )
    assert done.returncode == 1
    assert done.stderr == (
        "ds-launch: error: --master_addr '999.1.1.1' is neither an IP address nor a host name; "
        "pass the address or name of the host that runs rank 0, e.g. 10.0.0.1 or worker-0\n"
    )
    assert not (tmp_path / "started").exists()
