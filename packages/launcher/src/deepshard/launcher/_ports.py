"""Choosing the rendezvous port.

``--master_port`` defaults to 29500 (torchrun's and DeepSpeed's). When rank 0 runs on this
machine, the launcher checks the port by binding it as rank 0's store server will, with
``SO_REUSEADDR``: a port that only the connections of the previous run hold (in TIME-WAIT for a
minute after every run) counts as free, one that a process listens on (a stuck job) as taken.
It picks a free port from the kernel when it is taken or when the user passed ``0``. Another
process may grab the port between the check and rank 0's bind; torchrun has the same window.
When rank 0 runs on another host the port cannot be checked from here, so an explicit non-zero
port is required there. An explicit ``--master_addr`` must be an IP address or a host name that
resolves here (`check_master_addr`), so a typo fails before any rank starts.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from deepshard.interface.errors import LaunchError

__all__ = [
    "DEFAULT_MASTER_PORT",
    "check_master_addr",
    "is_local_address",
    "port_is_free",
    "resolve_master_port",
]

DEFAULT_MASTER_PORT = 29500
"""Port used when ``--master_port`` is not given (torchrun's default)."""

_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "::1")
_HOST_LABEL = r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_HOST_LABEL}(\.{_HOST_LABEL})*\.?")


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


def check_master_addr(addr: str, *, resolve: bool = True) -> None:
    """Refuse a ``--master_addr`` that is not an IP address or a host name that resolves.

    Args:
        addr: The address the ranks will rendezvous at.
        resolve: Also look the name up here (off when a scheduler places rank 0 on a host
            whose names this machine may not know).

    Raises:
        LaunchError: ``addr`` is malformed, or ``resolve`` and it does not resolve.
    """
    try:
        ipaddress.ip_address(addr)
        return
    except ValueError:
        pass
    dotted_numbers = all(part.isdigit() for part in addr.rstrip(".").split("."))
    if not _HOST_NAME.fullmatch(addr) or dotted_numbers:
        raise LaunchError(
            f"--master_addr {addr!r} is neither an IP address nor a host name; pass the address "
            "or name of the host that runs rank 0, e.g. 10.0.0.1 or worker-0"
        )
    if not resolve:
        return
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:  # socket.gaierror; idna for odd labels
        raise LaunchError(
            f"--master_addr {addr!r} does not resolve on this machine ({error}); check the "
            "name, or pass an IP address of the host that runs rank 0"
        ) from error


def port_is_free(addr: str, port: int) -> bool:
    """Whether rank 0's rendezvous server could listen on ``port`` of ``addr`` right now.

    The probe binds with ``SO_REUSEADDR``, as the server does: connections of an earlier run
    lingering in TIME-WAIT do not make the port busy; a listening socket does.
    """
    try:
        with socket.socket(_family(addr), socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
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
