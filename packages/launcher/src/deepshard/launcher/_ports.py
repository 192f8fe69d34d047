"""Choosing the rendezvous port.

``--master_port`` defaults to 29500 (torchrun's and DeepSpeed's). When rank 0 runs on this
machine, the launcher checks the port by binding it (without ``SO_REUSEADDR``, so a port still
held by a stuck process counts as taken) and picks a free one from the kernel when it is taken
or when the user passed ``0``. Another process may grab the port between the check and rank 0's
bind; torchrun has the same window. When rank 0 runs on another host the port cannot be checked
from here, so an explicit non-zero port is required there.
"""

from __future__ import annotations

import socket

from deepshard.interface.errors import LaunchError

__all__ = ["DEFAULT_MASTER_PORT", "is_local_address", "port_is_free", "resolve_master_port"]

DEFAULT_MASTER_PORT = 29500
"""Port used when ``--master_port`` is not given (torchrun's default)."""

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "::1")


def _family(addr: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def is_local_address(addr: str) -> bool:
    """Whether ``addr`` names this machine (a loopback name, or an address it can bind)."""
    if addr in _LOOPBACK_NAMES or addr.startswith("127.") or addr == socket.gethostname():
        return True
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as probe:
            probe.bind((addr, 0))
    except OSError:
        return False
    return True


def port_is_free(addr: str, port: int) -> bool:
    """Whether ``port`` can be bound on ``addr`` right now."""
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as probe:
            probe.bind((addr, port))
    except OSError:
        return False
    return True


def _kernel_port(addr: str) -> int:
    with socket.socket(_family(addr), socket.SOCK_STREAM) as probe:
        probe.bind((addr, 0))
        port: int = probe.getsockname()[1]
        return port


def resolve_master_port(addr: str, requested: int | None) -> tuple[int, str | None]:
    """The port rank 0 will serve the rendezvous on.

    Args:
        addr: ``MASTER_ADDR``.
        requested: ``--master_port`` (``None``: the default 29500; ``0``: any free port).

    Returns:
        ``(port, note)``: the note says why the port differs from the request, else ``None``.

    Raises:
        LaunchError: The port is out of range, or ``0`` was asked for a remote ``addr``.
    """
    port = DEFAULT_MASTER_PORT if requested is None else requested
    if not 0 <= port <= 65535:
        raise LaunchError(f"--master_port {port} is not a port number (0-65535)")
    if not is_local_address(addr):
        if port == 0:
            raise LaunchError(
                f"--master_port 0 asks for a free port, but rank 0 runs on {addr!r}, which "
                "this machine cannot check; pass an explicit --master_port"
            )
        return port, None
    if port == 0:
        return _kernel_port(addr), None
    if port_is_free(addr, port):
        return port, None
    chosen = _kernel_port(addr)
    return chosen, f"port {port} on {addr} is in use, using free port {chosen} instead"
