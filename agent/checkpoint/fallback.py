"""Fallback: restore the chosen snapshot, and when it fails on any rank (damaged, a checksum
mismatch), the previous committed one, on every rank together."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agent.checkpoint.collectives import first_error
from agent.errors import RestoreError
from agent.events import EventLog
from agent.restore.engine import RestoreStats
from agent.restore.engine import restore as restore_snapshot


def restore_first_good(candidates: Sequence[Path], app_state: Mapping[str, Any], options: Mapping[str, Any],
                       events: EventLog, *, fully_verified: Path | None = None) -> tuple[Path, RestoreStats] | None:
    """The first of ``candidates`` that restores on every rank, with this rank's stats; None
    when there is no candidate. A candidate under ``fully_verified`` (the memory tier's files,
    which came from peers) has every block checked. Each failure warns and records
    ``restore_fallback``; when none restores, RestoreError naming the last error."""
    error = None
    for path in candidates:
        stats = None
        verify = "full" if fully_verified is not None and path.is_relative_to(fully_verified) else options.get("verify")
        try:
            stats = restore_snapshot(path, app_state, **{**options, "verify": verify})
        except RestoreError as exc:
            error = str(exc)
        error = first_error(None if stats else error)
        if stats is not None and error is None:
            return path, stats
        warnings.warn(f"falling back from {path}: {error}", stacklevel=3)
        events.record("restore_fallback", snapshot=str(path), error=error)
    if candidates:
        raise RestoreError(f"{candidates[0].parent}: no committed snapshot restores; last error: {error}")
    return None
