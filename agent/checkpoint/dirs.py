"""The checkpoint directory's layout: one ``step_<N>`` directory per snapshot, committed once its
marker file exists. Light on purpose: the agent reads the layout without loading torchsnapshot."""

from __future__ import annotations

import re
from pathlib import Path

COMMIT_MARKER = ".torchrevive_commit"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def snapshot_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def is_committed(path: Path) -> bool:
    """Whether a snapshot directory carries its commit marker."""
    return (path / COMMIT_MARKER).is_file()


def step_of(path: Path) -> int | None:
    """N for a ``step_<N>`` directory, else None."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def list_snapshots(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory under ``root``, committed or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((step, p) for p in root.iterdir() if (step := step_of(p)) is not None and p.is_dir())


def committed_snapshots(root: Path) -> list[tuple[int, Path]]:
    """The committed ``step_<N>`` snapshots under ``root``, oldest first."""
    return [(step, p) for step, p in list_snapshots(root) if is_committed(p)]
