"""The memory directory's layout on a node: ``<memory_dir>/r<round>/step_<N>/``, one snapshot in
torchsnapshot's format, holding this node's ranks' files and a replica of its predecessor's
(node ``g`` is the buddy of node ``g - 1``). A memory snapshot is committed once its checksum
record and commit marker exist on two nodes: rank 0's and its buddy's.

A node keeps its newest committed memory snapshot and the one being written, nothing older; a
save that fails leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.checksums import CHECKSUMS_FILE
from agent.checkpoint.dirs import COMMIT_MARKER

_ROUND_DIR = re.compile(r"^r(\d+)$")
_STEP_DIR = re.compile(r"^step_(\d+)$")
KEY_FILE = ".torchrevive_memory_key"
FETCHED_FILE = ".torchrevive_fetched"


@dataclass(frozen=True, order=True)
class MemorySnapshot:
    """A snapshot in a memory directory, ordered by round, then step."""

    round: int
    step: int

    @property
    def relative(self) -> str:
        return f"r{self.round}/step_{self.step}"

    @classmethod
    def parse(cls, relative: str) -> MemorySnapshot:
        round_dir, _, step_dir = relative.partition("/")
        rnd, step = _ROUND_DIR.match(round_dir), _STEP_DIR.match(step_dir)
        if rnd is None or step is None:
            raise ValueError(f"{relative!r} is not a memory snapshot (r<round>/step_<N>)")
        return cls(int(rnd.group(1)), int(step.group(1)))


def snapshots(root: Path) -> list[MemorySnapshot]:
    """Every memory snapshot directory under ``root``, committed or not, oldest first."""
    found = []
    for round_dir in root.glob("r*"):
        for step_dir in round_dir.glob("step_*"):
            try:
                found.append(MemorySnapshot.parse(f"{round_dir.name}/{step_dir.name}"))
            except ValueError:
                continue
    return sorted(found)


def inventory(root: Path) -> dict[str, dict]:
    """What this node holds, for the round's leader: per snapshot, its files and sizes, and, where
    this node holds the commit marker, the snapshot's complete file list from its checksum record."""
    held: dict[str, dict] = {}
    for snapshot in snapshots(root):
        path = root / snapshot.relative
        files = {str(p.relative_to(path)): p.stat().st_size for p in path.rglob("*")
                 if p.is_file() and not p.name.endswith(".incoming") and not p.name.startswith(FETCHED_FILE)}
        entry: dict = {"files": files}
        if COMMIT_MARKER in files and CHECKSUMS_FILE in files:
            try:
                record = json.loads((path / CHECKSUMS_FILE).read_text())
                entry["complete"] = {name: d["size"] for name, d in record["files"].items()}
                entry["complete"].update({CHECKSUMS_FILE: files[CHECKSUMS_FILE], COMMIT_MARKER: files[COMMIT_MARKER]})
            except (OSError, ValueError, KeyError, TypeError):
                pass  # a damaged record: this node cannot vouch for the snapshot
        held[snapshot.relative] = entry
    return held


def mark_fetched(snapshot: Path, round: int, summary: dict) -> None:
    """Tell round ``round``'s workers that their agent is done pulling ``snapshot``'s files."""
    tmp = snapshot / f"{FETCHED_FILE}.r{round}.tmp"
    tmp.write_text(json.dumps(summary))
    tmp.rename(snapshot / f"{FETCHED_FILE}.r{round}")


def wait_fetched(snapshot: Path, round: int, *, timeout: float, poll: float = 0.005) -> bool:
    """Wait until the agent is done pulling ``snapshot``'s files for ``round``; False on timeout
    (the restore then finds what is missing, and falls back)."""
    done = snapshot / f"{FETCHED_FILE}.r{round}"
    deadline = time.monotonic() + timeout
    while not done.exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def prune(root: Path, committed: MemorySnapshot) -> None:
    """Remove every snapshot older than ``committed`` (a newer one may be arriving already)."""
    for snapshot in snapshots(root):
        if snapshot < committed:
            shutil.rmtree(root / snapshot.relative, ignore_errors=True)
    _remove_empty_rounds(root)


def discard(root: Path, failed: MemorySnapshot) -> None:
    """Remove what this node holds of a snapshot that was not committed (its own files and the
    replica it received), so that a failed save leaves no RAM behind."""
    shutil.rmtree(root / failed.relative, ignore_errors=True)
    _remove_empty_rounds(root)


def _remove_empty_rounds(root: Path) -> None:
    for round_dir in root.glob("r*"):
        if round_dir.is_dir() and not any(round_dir.iterdir()):
            with contextlib.suppress(OSError):  # a snapshot of that round arriving meanwhile
                round_dir.rmdir()
