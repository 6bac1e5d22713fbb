"""Shared fixtures: free localhost ports and a runner for the real `torchrevive` command."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHREVIVE = [sys.executable, "-m", "launcher.cli"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def worker_env() -> dict[str, str]:
    """The environment for launched jobs: the repo importable, one thread per worker, and no
    PET_* variables from the caller's shell leaking into the job."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PET_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    return env


def start_torchrevive(args: Sequence[str], **kwargs) -> subprocess.Popen:
    """Start `torchrevive ...` as a real process in the repo root, output captured."""
    return subprocess.Popen(
        [*TORCHREVIVE, *args],
        cwd=REPO,
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.fixture
def rdzv_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"
