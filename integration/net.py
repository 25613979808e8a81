"""A free local TCP port for a server the harness or a test spawns.

Only the standard library's ``socket``: a process that must start no thread before it forks (the
tensor-parallel shutdown worker) imports it too.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the OS picks it; another process may
    still take it before the caller binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
