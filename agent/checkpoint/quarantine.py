"""Quarantine: a committed storage snapshot that failed verification at a restore is set aside, on
every rank's agreement, so that no round picks it again.

Only damage is quarantined: a checksum mismatch found by any rank's restore, or what rank 0's
structural check finds (metadata missing or unreadable, a file missing, truncated or of another
size than when committed). A restore that fails for any other reason (the user's state is of
another model, an I/O error that may pass) leaves the snapshot as it is.

Rank 0 writes the reason into the snapshot (``.torchrevive_quarantine``, with the commit marker's
record), renames it to ``step_<N>.quarantined`` (a name no other quarantine took), then removes
its commit marker, each step durable. A crash at any point leaves either a committed
``step_<N>`` (restored, failing and quarantined again next time) or a quarantined one. Nothing is
deleted: the directory is evidence, for an operator to inspect (``torchrevive list``) and remove.
"""

from __future__ import annotations

import errno
import json
import time
import warnings
from pathlib import Path

from agent.checkpoint.checksums import ChecksumError
from agent.checkpoint.dirs import COMMIT_MARKER, is_committed, quarantine_dir, step_of
from agent.checkpoint.durable import fsync_dir, remove_file, write_file
from agent.checkpoint.verify import check_structure
from agent.errors import RestoreError, SnapshotUnreadableError
from agent.events import EventLog

QUARANTINE_RECORD = ".torchrevive_quarantine"


def is_checksum_mismatch(exc: BaseException) -> bool:
    """Whether a restore failed because the snapshot's bytes are not those committed (the
    ChecksumError itself, or one that a RestoreError wraps)."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ChecksumError):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def quarantine_if_damaged(snapshot: Path, error: str, mismatch: str | None, events: EventLog) -> Path | None:
    """After ``snapshot`` failed to restore with ``error`` (``mismatch``: the error of a rank that
    found bytes that do not match their checksum, if any), set it aside when it is damaged; where
    it went, else None. Call on rank 0 only, for a storage snapshot."""
    if step_of(snapshot) is None or not is_committed(snapshot):
        return None  # not a committed snapshot (already set aside by an earlier round, say)
    damage = mismatch or structural_damage(snapshot)
    if damage is None:
        return None
    try:
        moved = quarantine(snapshot, damage)
    except OSError as exc:  # the restore falls back all the same; the next round finds the damage again
        warnings.warn(f"{snapshot} is damaged ({damage}) but could not be set aside: {exc}", stacklevel=3)
        return None
    warnings.warn(f"{snapshot} is damaged ({damage}): set aside as {moved}; no round restores it again",
                  stacklevel=3)
    events.record("snapshot_quarantined", snapshot=str(snapshot), step=step_of(snapshot), moved_to=str(moved),
                  reason=damage, error=error)
    return moved


def structural_damage(snapshot: Path) -> str | None:
    """What rank 0 finds wrong with the snapshot's structure (see :func:`check_structure`), else
    None."""
    try:
        check_structure(snapshot)
    except (SnapshotUnreadableError, OSError):  # not damage: it may pass, or a newer version reads it
        pass
    except RestoreError as exc:
        return str(exc)
    return None


def quarantine(snapshot: Path, reason: str) -> Path:
    """Set ``snapshot`` (a ``step_<N>``) aside as damaged for ``reason``; returns its new path."""
    write_file(snapshot / QUARANTINE_RECORD, json.dumps({
        "reason": reason, "quarantined_at": time.time(), "commit": _commit_record(snapshot)}))
    attempt = 0
    while True:
        moved = quarantine_dir(snapshot.parent, step_of(snapshot), attempt)
        try:
            snapshot.rename(moved)  # refused (ENOTEMPTY) over an earlier quarantine of this step
            break
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            attempt += 1
    fsync_dir(snapshot.parent)
    remove_file(moved / COMMIT_MARKER)
    return moved


def quarantine_reason(path: Path) -> str | None:
    """Why ``path`` was quarantined, as recorded in it (None when there is no readable record)."""
    try:
        return str(json.loads((path / QUARANTINE_RECORD).read_text())["reason"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _commit_record(snapshot: Path) -> object:
    """The commit marker's record (round, world size, time), kept as evidence; None if unreadable."""
    try:
        return json.loads((snapshot / COMMIT_MARKER).read_text())
    except (OSError, ValueError):
        return None
