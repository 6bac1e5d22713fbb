"""Free TCP ports on 127.0.0.1 for the local cluster, its etcd and the calibration's workers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
