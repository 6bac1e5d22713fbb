"""The checkpoint directory's layout. Light on purpose: the agent reads it without torchsnapshot.

* ``step_<N>``: a snapshot, committed once its marker file exists. A save writes into its own
  ``step_<N>.r<round>.partial`` directory and renames it to ``step_<N>`` once committed, so a
  ``step_<N>`` never holds a half-written save;
* ``.torchrevive_round``: the fencing token, the newest rendezvous round of the job, written by
  each round's leader agent before its workers start. A save of an older round (the workers of a
  node frozen and thawed after the others moved on) is refused at its commit; and the fence moves
  every older round's ``.partial`` directory aside (``.fenced``, then removed), so a commit that
  checked the fence a moment before it moved finds nothing to rename.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

COMMIT_MARKER = ".torchrevive_commit"
FENCE_FILE = ".torchrevive_round"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.r(\d+|-)\.(partial|fenced)$")


def snapshot_dir(root: Path, step: int) -> Path:
    return root / f"step_{step}"


def partial_dir(root: Path, step: int, round: int | None) -> Path:
    """Where a save of ``step`` by round ``round`` (None outside an agent) is written."""
    return root / f"step_{step}.r{'-' if round is None else round}.partial"


def is_committed(path: Path) -> bool:
    """Whether a snapshot directory carries its commit marker."""
    return (path / COMMIT_MARKER).is_file()


def step_of(path: Path) -> int | None:
    """N for a ``step_<N>`` directory, else None."""
    match = _STEP_DIR.match(path.name)
    return int(match.group(1)) if match else None


def list_snapshots(root: Path) -> list[tuple[int, Path]]:
    """Every ``step_<N>`` directory under ``root``, committed or not, oldest first."""
    return _matching(root, _STEP_DIR)


def list_partial(root: Path) -> list[tuple[int, Path]]:
    """Every save still being written, or left behind by a dead or fenced one, oldest step first."""
    return _matching(root, _PARTIAL_DIR)


def committed_snapshots(root: Path) -> list[tuple[int, Path]]:
    """The committed ``step_<N>`` snapshots under ``root``, oldest first."""
    return [(step, p) for step, p in list_snapshots(root) if is_committed(p)]


def write_fence(root: Path, round: int) -> None:
    """Record ``round`` as the job's newest (a temporary file renamed into place), then move every
    older round's save in progress aside. Its commit renames the same directory: rename is atomic,
    so either that commit happened first (and lists as committed from now on) or it fails."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{FENCE_FILE}.{os.getpid()}.tmp"
    tmp.write_text(str(round))
    os.replace(tmp, root / FENCE_FILE)
    for path in root.glob("step_*.r*.partial"):
        match = _PARTIAL_DIR.match(path.name)
        if match and match.group(2) != "-" and int(match.group(2)) < round:
            fenced = path.with_suffix(".fenced")
            try:
                os.rename(path, fenced)
            except FileNotFoundError:  # committed (or removed) a moment ago
                continue
            shutil.rmtree(fenced, ignore_errors=True)


def fenced_round(root: Path) -> int | None:
    """The job's newest round, as its leader recorded it (None when no agent recorded one)."""
    try:
        return int((root / FENCE_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return None


def _matching(root: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir())
