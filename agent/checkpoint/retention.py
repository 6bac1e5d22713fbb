"""Retention: keep the newest ``keep`` committed snapshots, remove what dead saves left behind.
Runs on rank 0 after each commit; never removes the snapshot just committed or the one this job
restored from. A quarantined snapshot (``step_<N>.quarantined``, see
:mod:`agent.checkpoint.quarantine`) is neither counted nor removed: it is evidence of damage,
for an operator to inspect and remove."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from agent.checkpoint.dirs import COMMIT_MARKER, committed_snapshots, is_committed, list_partial, list_snapshots
from agent.checkpoint.durable import remove_file


def prune(root: Path, keep: int, protected: Iterable[Path | None]) -> list[Path]:
    """Remove committed snapshots beyond the newest ``keep``, every partial save (none of this
    round's is in flight when a commit just finished; an older round's can never commit), and
    uncommitted ``step_<N>`` leftovers older than the newest commit. Returns what was removed."""
    committed = committed_snapshots(root)
    newest = committed[-1][0] if committed else -1
    spared = set(protected)
    leftovers = [p for s, p in list_snapshots(root) if s < newest and not is_committed(p)]
    doomed = [p for _, p in committed[:-keep]] + leftovers + [p for _, p in list_partial(root)]
    removed = [p for p in doomed if p not in spared]
    for path in removed:
        # Un-commit first, durably: a process killed during the removal, or a power loss after
        # it, must not leave a directory that looks committed with some of its files gone.
        remove_file(path / COMMIT_MARKER)
        shutil.rmtree(path, ignore_errors=True)
    return removed
