"""Commands that start the node entry on other hosts: one ssh per node, or one pdsh for all.

Each node runs the shell command of `remote_command`: ``cd`` to the launch directory, ``exec
env`` with the exported variables (each value `shlex.quote`-d) and the launcher's Python
directory in front of the node's ``PATH``, then the node entry
(``<python> -u -m deepshard.launcher.node ...``) with the world layout as one base64 argument
and the user's script and arguments quoted word by word. The remote login shell must be a
POSIX shell (sh, bash, zsh, ...). Nothing that came from the user is ever interpreted by it.

ssh: ``ssh [-p PORT] <launcher_args> HOST '<command>'``; its stdin stays open to the launcher,
which writes ``stop N`` and closes it to stop the node (``--watch_stdin``), and whose death
closes the connection, which the node entry notices as EOF.

pdsh: ``pdsh -S -f 1024 -w HOST,... <launcher_args> '<command>'``; pdsh substitutes ``%h`` with
each host's name (so the node entry finds itself by ``--node_host``, whatever order pdsh sorts
hosts in), and every other ``%`` is doubled so that pdsh passes it unchanged. pdsh forwards no
stdin, so the launcher stops the nodes with a second pdsh that runs
``python -m deepshard.launcher.node --stop_job=<id> --signal=N`` everywhere.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence

from deepshard.launcher._env import shell_assignments
from deepshard.launcher._ranks import RunOptions
from deepshard.launcher._world import WorldLayout

__all__ = [
    "PDSH_FAN_OUT",
    "NodeEntry",
    "node_entry_argv",
    "pdsh_argv",
    "pdsh_stop_argv",
    "remote_command",
    "ssh_argv",
]

PDSH_FAN_OUT = 1024
"""How many hosts pdsh contacts at once (``-f``)."""


@dataclasses.dataclass(frozen=True)
class NodeEntry:
    """What every node entry of a job is told.

    Attributes:
        layout: The job's layout.
        master_addr: Rendezvous host.
        master_port: Rendezvous port.
        options: What the ranks run.
        python: The Python executable (the same path on every node).
        cwd: The launch directory, where every node starts.
        exports: The variables the nodes receive (see `exported_variables`).
        torchrun: Run PyTorch's elastic agent on each node instead of the ranks.
        torchrun_args: Extra torchrun arguments (the ``--launcher_args`` of that backend).
        venv_script: A script to source first (``--venv_script``), or ``None``.
        job_id: The id pdsh's stop command finds the node entries by, or ``None``.
    """

    layout: WorldLayout
    master_addr: str
    master_port: int
    options: RunOptions
    python: str
    cwd: str
    exports: Mapping[str, str]
    torchrun: bool = False
    torchrun_args: str = ""
    venv_script: str | None = None
    job_id: str | None = None


def node_entry_argv(entry: NodeEntry, node_flag: str, *, watch_stdin: bool) -> list[str]:
    """The node entry's command; ``node_flag`` is ``--node_rank=K`` or ``--node_host=%h``."""
    options = entry.options
    argv = [
        entry.python,
        "-u",
        "-m",
        "deepshard.launcher.node",
        f"--world={entry.layout.encode()}",
        node_flag,
        f"--master_addr={entry.master_addr}",
        f"--master_port={entry.master_port}",
    ]
    flags = {
        "--module": options.module,
        "--no_python": options.no_python,
        "--no_local_rank": options.no_local_rank,
        "--bind_cores_to_rank": options.bind_cores_to_rank,
        "--torchrun": entry.torchrun,
        "--watch_stdin": watch_stdin,
    }
    argv.extend(flag for flag, on in flags.items() if on)
    valued = {
        "--bind_core_list": options.bind_core_list,
        "--log_dir": options.log_dir,
        "--launcher_args": entry.torchrun_args or None,
        "--job_id": entry.job_id,
    }
    argv.extend(f"{flag}={value}" for flag, value in valued.items() if value is not None)
    return [*argv, options.script, *options.script_args]


def _prologue(entry: NodeEntry) -> list[str]:
    """Shell words before the node entry: venv script, cd, env assignments."""
    words = []
    if entry.venv_script is not None:
        words += [".", shlex.quote(entry.venv_script), "&&"]
    words += ["cd", shlex.quote(entry.cwd), "&&", "exec", "env"]
    words += shell_assignments(entry.exports)
    # The node's own PATH stays, behind the directory of the job's Python (its virtualenv).
    words.append(f'PATH={shlex.quote(os.path.dirname(entry.python))}:"$PATH"')
    return words


def remote_command(entry: NodeEntry, node_rank: int, *, watch_stdin: bool = True) -> str:
    """The shell command that starts node ``node_rank``'s entry (ssh and torchrun backends)."""
    argv = node_entry_argv(entry, f"--node_rank={node_rank}", watch_stdin=watch_stdin)
    return " ".join([*_prologue(entry), *(shlex.quote(word) for word in argv)])


def ssh_argv(
    entry: NodeEntry, node_rank: int, *, ssh_port: int | None, launcher_args: str
) -> list[str]:
    """``ssh`` to node ``node_rank`` running its node entry (watching stdin)."""
    port = ["-p", str(ssh_port)] if ssh_port is not None else []
    host = entry.layout.nodes[node_rank].host
    return ["ssh", *port, *shlex.split(launcher_args), host, remote_command(entry, node_rank)]


def _pdsh_prefix(layout: WorldLayout, launcher_args: str) -> list[str]:
    hosts = ",".join(node.host for node in layout.nodes)
    return ["pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", hosts, *shlex.split(launcher_args)]


def _pdsh_escape(word: str) -> str:
    return word.replace("%", "%%")


def pdsh_argv(entry: NodeEntry, *, launcher_args: str) -> list[str]:
    """One ``pdsh`` that starts every node's entry (each finds its node through ``%h``)."""
    argv = node_entry_argv(entry, "--node_host=%h", watch_stdin=False)
    words = [_pdsh_escape(word) for word in _prologue(entry)]
    for word in argv:
        quoted = shlex.quote(word)
        words.append(quoted if word == "--node_host=%h" else _pdsh_escape(quoted))
    return [*_pdsh_prefix(entry.layout, launcher_args), " ".join(words)]


def pdsh_stop_argv(entry: NodeEntry, signum: int, *, launcher_args: str) -> Sequence[str]:
    """The ``pdsh`` that signals every node entry of ``entry.job_id`` on every node."""
    stop = [
        entry.python,
        "-m",
        "deepshard.launcher.node",
        f"--stop_job={entry.job_id}",
        f"--signal={signum}",
    ]
    command = " ".join(_pdsh_escape(shlex.quote(word)) for word in stop)
    return [*_pdsh_prefix(entry.layout, launcher_args), command]
