"""The checkpoint directory's layout. Light on purpose: the agent reads it without torchsnapshot.

* ``step_<N>``: a snapshot, committed once its marker file exists. A save writes into its own
  ``step_<N>.r<round>.partial`` directory and renames it to ``step_<N>`` once committed, so a
  ``step_<N>`` never holds a half-written save;
* ``step_<N>.quarantined`` (``.quarantined.<k>`` for the k-th of the same step): a snapshot that
  failed verification at a restore, set aside with the reason inside it (see
  :mod:`agent.checkpoint.quarantine`). It never lists as a snapshot, so it is never restored,
  never counted or removed by retention, and a new save of its step goes ahead;
* ``.torchrevive_round.<R>``: the fencing token, the newest rendezvous round of the job, recorded
  by each round's leader agent before its workers start. A save of an older round (the workers of
  a node frozen and thawed after the others moved on) is refused at its commit; and the fence
  moves every older round's ``.partial`` directory aside (``.fenced``, then removed), so a commit
  that checked the fence a moment before it moved finds nothing to rename.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from agent.checkpoint.durable import fsync_dir
from agent.errors import StaleRoundError

COMMIT_MARKER = ".torchrevive_commit"
FENCE_FILE = ".torchrevive_round"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PARTIAL_DIR = re.compile(r"^step_(\d+)\.r(\d+|-)\.(partial|fenced)$")
_QUARANTINED_DIR = re.compile(r"^step_(\d+)\.quarantined(?:\.\d+)?$")
_FENCE_ENTRY = re.compile(rf"^{re.escape(FENCE_FILE)}\.(\d+)$")


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


def list_quarantined(root: Path) -> list[tuple[int, Path]]:
    """Every snapshot set aside as damaged (``step_<N>.quarantined[.<k>]``), oldest step first."""
    return _matching(root, _QUARANTINED_DIR)


def quarantine_dir(root: Path, step: int, attempt: int) -> Path:
    """Where the ``attempt``-th try (from 0) sets a damaged ``step_<N>`` aside: a name no other
    quarantine of the same step took (a second damaged save of one step is kept too)."""
    return root / (f"step_{step}.quarantined" + (f".{attempt}" if attempt else ""))


def committed_snapshots(root: Path) -> list[tuple[int, Path]]:
    """The committed ``step_<N>`` snapshots under ``root``, oldest first."""
    return [(step, p) for step, p in list_snapshots(root) if is_committed(p)]


def write_fence(root: Path, round: int) -> None:
    """Record ``round`` as the job's newest (durably), then move every older round's save in
    progress aside. Its commit renames the same directory: rename is atomic, so either that commit
    happened first (and lists as committed from now on) or it fails.

    Within a run the fence only grows. Each round is a file of its own and the fence is the
    highest, so two leaders writing at once never lower it, and no lock is held (a frozen leader
    would hold it forever). A round lower than the fence is a stale leader's (its node was frozen
    or cut off while the job moved on): StaleRoundError, and nothing changes. Round 0 starts a new
    run of the job (a resubmitted job's rendezvous counts its rounds from 0 again): it replaces
    what an earlier run recorded. So the caller writes round 0 only while the rendezvous is still
    in round 0 (the agent checks; a leader frozen between that check and this write is the one
    case that lowers the fence)."""
    root.mkdir(parents=True, exist_ok=True)
    newest = fenced_round(root)
    if newest is not None and 0 < round < newest:
        raise StaleRoundError(f"{fence_path(root, newest)}: the job is in round {newest}; this leader's round "
                              f"{round} is older (its node was frozen or cut off while the job moved on), so it "
                              "fences nothing and starts no workers: restart this node's agent to rejoin the job")
    fence_path(root, round).touch()  # the name is the record
    fsync_dir(root)
    others = sorted(entry for entry in _fence_entries(root) if entry[0] != round)
    # A new run drops what the earlier one recorded; otherwise the newest older round stays, so
    # that a reader listing the directory meanwhile sees it even where it misses the new file.
    outdated = [path for _, path in others] if round == 0 else [path for older, path in others if older < round][:-1]
    for path in outdated:
        path.unlink(missing_ok=True)
    if outdated:
        fsync_dir(root)
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
    """The job's newest round, as its leaders recorded it (None when no agent recorded one)."""
    return max((round for round, _ in _fence_entries(root)), default=None)


def fence_path(root: Path, round: int) -> Path:
    """The file that records ``round`` in the fence."""
    return root / f"{FENCE_FILE}.{round}"


def _fence_entries(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), root / name) for name in os.listdir(root) if (m := _FENCE_ENTRY.match(name))]


def _matching(root: Path, pattern: re.Pattern[str]) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name)) and p.is_dir())
