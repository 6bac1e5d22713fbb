"""The commit notice: how a node's agent learns, without reading storage or asking a peer, that
its workers' job committed a snapshot.

Every rank learns a commit's verdict from rank 0 (the commit's last collective); each node's local
rank 0 then replaces one small JSON file, ``TORCHREVIVE_COMMIT_NOTICE``, with the step, the tier,
and the times of this commit and the one before it. The agent reads it to admit a joining node
right after a commit (see ``elastic.join_wait``): the two times say when the next one is due.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CommitNotice:
    """The latest commit a node's workers saw: ``step`` of ``tier`` ("storage" or "memory"),
    committed at ``at`` (seconds since the epoch, this node's clock), the one before at
    ``previous_at`` (None for the first)."""

    step: int
    tier: str
    at: float
    previous_at: float | None

    @property
    def next_due(self) -> float | None:
        """When the next commit is due, as far as the last two tell (None after the first)."""
        return None if self.previous_at is None else self.at + (self.at - self.previous_at)


def write_notice(path: str | os.PathLike[str], *, step: int, tier: str) -> None:
    """Record a commit of ``step`` (atomically: a reader sees the old notice or the new one)."""
    path = Path(path)
    previous = read_notice(path)
    notice = {"step": step, "tier": tier, "at": time.time(), "previous_at": previous.at if previous else None}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(notice))
    os.replace(tmp, path)


def read_notice(path: str | os.PathLike[str]) -> CommitNotice | None:
    """The latest notice at ``path``; None when there is none yet (or it is unreadable)."""
    try:
        raw = json.loads(Path(path).read_text())
        return CommitNotice(step=int(raw["step"]), tier=str(raw["tier"]), at=float(raw["at"]),
                            previous_at=None if raw["previous_at"] is None else float(raw["previous_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
