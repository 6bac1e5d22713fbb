"""Shared fixtures: localhost ports held for their user and a runner for the real `torchrevive`
command."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TORCHREVIVE = [sys.executable, "-m", "launcher.cli"]
sys.path.insert(0, str(REPO / "scripts"))
from local_ports import free_port  # noqa: E402  (one helper for the tests and the scripts)

__all__ = ["REPO", "TORCHREVIVE", "free_port", "start_torchrevive", "worker_env"]


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
