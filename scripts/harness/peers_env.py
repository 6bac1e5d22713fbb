"""The peers' virtual environment (torchft, nvidia-resiliency-ext), made on first use by
scripts/setup_peers.sh: the benchmarks run the tools torchrevive is measured beside from it, never
from the product's own environment."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class PeersUnavailable(RuntimeError):
    """The peers' environment could not be made (no package index, no wheel for this Python)."""


def peers_python() -> str:
    """The peers' python, after making their environment if needed; PeersUnavailable, with the
    installer's last lines, when it cannot be made."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "setup_peers.sh")], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise PeersUnavailable("scripts/setup_peers.sh could not install torchft==0.2.0 and "
                               f"nvidia-resiliency-ext==0.4.1 into .venv-peers:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]
