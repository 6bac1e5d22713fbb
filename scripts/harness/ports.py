"""Ports on 127.0.0.1 for the local cluster, its etcd, the calibration's workers and the tests."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    """A port that nothing listens on, held back from other processes until its user binds it.

    A port found by binding to port 0 and closing again can be handed to anyone else (any other
    bind to port 0, any outgoing connection) before its user binds it. This one is left with a
    connection in TIME_WAIT (about 60 s): meanwhile the kernel hands it to no other bind to port
    0 or outgoing connection, and refuses a plain bind to it, while a server that sets
    SO_REUSEADDR (torch's TCPStore, etcd, Python's HTTP servers) binds it at once.
    """
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            accepted, _ = listener.accept()
            accepted.close()  # this side closes first: the TIME_WAIT is on the port itself
        return port


def wait_listening(proc: subprocess.Popen | None, host: str, port: int, *, name: str, log: Path,
                   timeout: float = 30) -> None:
    """Wait until the server ``proc`` (called ``name``, logging to ``log``) accepts connections on
    ``host:port``; RuntimeError when it exits first, TimeoutError after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {None if proc is None else proc.returncode}; see {log}")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{name} did not listen on {host}:{port} within {timeout:.0f} s; see {log}")
