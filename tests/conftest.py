"""Shared fixtures: localhost ports held for their user and a runner for the real `torchrevive`
command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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


def start_torchrevive(args: Sequence[str], *, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    """Start `torchrevive ...` as a real process in the repo root, output captured; ``env`` adds
    variables to :func:`worker_env`."""
    return subprocess.Popen(
        [*TORCHREVIVE, *args],
        cwd=REPO,
        env={**worker_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.fixture
def store():
    """A TCPStore server on 127.0.0.1, on a port the kernel chose (as the c10d store's host)."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server
    del server


@pytest.fixture
def rdzv_endpoint() -> str:
    return f"127.0.0.1:{free_port()}"


STEADY_WORKER = "tests/steady_worker.py"
"""A worker that all-reduces until OUT/stop exists (see its docstring)."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``predicate`` every 0.1 s until it returns something true, which is returned."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"no {what} within {timeout:.0f} s")


def workers_ready(out: Path, ranks: int, timeout: float = 120) -> list[dict[str, Any]]:
    """What each steady worker recorded once its process group formed."""
    files = [out / f"ready{rank}" for rank in range(ranks)]
    wait_until(lambda: all(f.exists() and f.read_text() for f in files), timeout, f"{ranks} ready workers in {out}")
    return [json.loads(f.read_text()) for f in files]


def stop_steady_job(proc: subprocess.Popen, out: Path, pids: Sequence[int], timeout: float) -> tuple[int, str]:
    """Ask the steady workers writing to ``out`` to stop; the launcher's exit code and output
    (whatever it left behind killed)."""
    (out / "stop").touch()
    try:
        output, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
        kill_leftovers(pids)
    return proc.returncode, output


def kill_leftovers(pids: Sequence[int]) -> None:
    """SIGKILL processes a failed test may have left behind (orphaned workers)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
