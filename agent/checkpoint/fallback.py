"""Fallback: restore the chosen snapshot, and when it fails on any rank (damaged, a checksum
mismatch), the previous committed one, on every rank together. A storage snapshot that failed
because it is damaged is quarantined by rank 0 (:mod:`agent.checkpoint.quarantine`), so that no
later round picks it again."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.checkpoint.collectives import gather, rank
from agent.checkpoint.quarantine import is_checksum_mismatch, quarantine_if_damaged
from agent.errors import RestoreError
from agent.events import EventLog
from agent.restore.engine import RestoreStats
from agent.restore.engine import restore as restore_snapshot


def restore_first_good(candidates: Sequence[Path], app_state: Mapping[str, Any], options: Mapping[str, Any],
                       events: EventLog, *, fully_verified: Path | None = None) -> tuple[Path, RestoreStats] | None:
    """The first of ``candidates`` that restores on every rank, with this rank's stats; None
    when there is no candidate. A candidate under ``fully_verified`` (the memory tier's files,
    which came from peers) has every block checked, and is never quarantined. Each failure warns
    and records ``restore_fallback``; a damaged storage candidate is then quarantined. When none
    restores, RestoreError naming the last error."""
    error = None
    for path in candidates:
        stats, mismatch = None, False
        in_memory = fully_verified is not None and path.is_relative_to(fully_verified)
        verify = "full" if in_memory else options.get("verify")
        try:
            stats = restore_snapshot(path, app_state, **{**options, "verify": verify})
        except RestoreError as exc:
            error, mismatch = str(exc), is_checksum_mismatch(exc)
        outcomes = gather((None, False) if stats else (error, mismatch))
        error = next((e for e, _ in outcomes if e is not None), None)
        if error is None:
            return path, stats
        warnings.warn(f"falling back from {path}: {error}", stacklevel=3)
        events.record("restore_fallback", snapshot=str(path), error=error)
        if not in_memory and rank() == 0:
            quarantine_if_damaged(path, error, next((e for e, m in outcomes if m), None), events)
    if candidates:
        raise RestoreError(f"{candidates[0].parent}: no committed snapshot restores; last error: {error}")
    return None
