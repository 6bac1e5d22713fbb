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
import warnings
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.durable import write_file


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


def write_notice(path: str | os.PathLike[str], *, step: int, tier: str) -> str | None:
    """Record a commit of ``step`` (atomically: a reader sees the old notice or the new one).

    Never raises: the commit it tells of has happened, and a notice that cannot be written (a full
    disk, say) must not turn it into a failed save. Returns the error (also warned), else None.
    Writers never collide (each writes a temporary file of its own): a node's storage save and
    memory save may tell of their commits at the same moment, and the last one stays."""
    path = Path(path)
    previous = read_notice(path)
    notice = {"step": step, "tier": tier, "at": time.time(), "previous_at": previous.at if previous else None}
    try:
        write_file(path, json.dumps(notice))
    except OSError as exc:
        error = f"{path}: cannot record the commit of step {step} ({tier}) for the agent: {exc}"
        warnings.warn(error, stacklevel=2)
        return error
    return None


def read_notice(path: str | os.PathLike[str]) -> CommitNotice | None:
    """The latest notice at ``path``; None when there is none yet (or it is unreadable)."""
    try:
        raw = json.loads(Path(path).read_text())
        return CommitNotice(step=int(raw["step"]), tier=str(raw["tier"]), at=float(raw["at"]),
                            previous_at=None if raw["previous_at"] is None else float(raw["previous_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
