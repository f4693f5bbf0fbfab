"""The one address the engine's own sockets use: process groups, their stores and the ranks' meeting
point listen on 127.0.0.1 only, never on every interface."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it before you do)."""
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])
