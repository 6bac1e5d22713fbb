"""The commit notice: how a node's agent learns, without reading storage or asking a peer, that
its workers' job committed a snapshot.

Every rank learns a commit's verdict from rank 0 (the commit's last collective); each node's local
rank 0 then replaces one small JSON file, ``TORCHREVIVE_COMMIT_NOTICE``, with the step, the tier,
the times of this commit and the one before it, and the job's pace: its steady step time and the
steps between two commits. A round's restore writes one too (tier ``restore``): from then on, a
restart would go back to that step, and the next commit is due an interval after it. The agent
reads it to admit a joining node right after a commit (see ``elastic.join_wait``): the notice says
when the next one is due, from the first commit or restore of a round on. A round's restore knows
the pace only from the notice before it, and a node that joined has none: the training thread tells
the round's own pace a few steps in (:func:`tell_pace`), so that every node knows when the round's
first commit is due, not only the nodes that saw a commit before.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from agent.checkpoint.durable import write_file


RESTORE_TIER = "restore"
"""The tier of the notice a round's restore writes: the step the round went on from, no new commit."""

_WRITING = threading.Lock()
"""Each write reads the notice before it: one writer at a time in a process (the training thread,
the storage and the memory saver's threads), so that none puts back a notice another replaced."""


@dataclass(frozen=True)
class CommitNotice:
    """The latest commit a node's workers saw: ``step`` of ``tier`` ("storage", "memory", or
    ``RESTORE_TIER`` for the step this round restored), committed at ``at`` (seconds since the
    epoch, this node's clock), the commit before at ``previous_at`` (None for the first, and after
    a restore); the job's steady step time ``step_s`` and ``interval_steps`` between two commits of
    any tier (None while unknown)."""

    step: int
    tier: str
    at: float
    previous_at: float | None
    step_s: float | None = None
    interval_steps: int | None = None

    @property
    def is_commit(self) -> bool:
        """A snapshot committed (not a round's restore)."""
        return self.tier != RESTORE_TIER

    @property
    def next_due(self) -> float | None:
        """When the next commit is due: ``interval_steps`` steps of ``step_s`` after this one, or,
        while the pace is unknown, as far apart as the last two (None after the first)."""
        if self.step_s is not None and self.interval_steps is not None:
            return self.at + self.interval_steps * self.step_s
        return None if self.previous_at is None else self.at + (self.at - self.previous_at)


def write_notice(path: str | os.PathLike[str], *, step: int, tier: str, step_s: float | None = None,
                 interval_steps: int | None = None) -> str | None:
    """Record a commit of ``step`` (atomically: a reader sees the old notice or the new one); the
    pace given (``step_s``, ``interval_steps``), else the previous notice's.

    Never raises: the commit it tells of has happened, and a notice that cannot be written (a full
    disk, say) must not turn it into a failed save. Returns the error (also warned), else None.
    A node's storage save and memory save may tell of their commits at the same moment: they take
    turns, and the last one stays."""
    path = Path(path)
    with _WRITING:
        previous = read_notice(path)
        notice = {"step": step, "tier": tier, "at": time.time(),
                  "previous_at": previous.at if previous and tier != RESTORE_TIER else None,
                  "step_s": step_s if step_s is not None else previous.step_s if previous else None,
                  "interval_steps": interval_steps if interval_steps is not None
                  else previous.interval_steps if previous else None}
        return _write(path, notice, f"cannot record the commit of step {step} ({tier})")


def tell_pace(path: str | os.PathLike[str], step_s: float, *, step: int) -> str | None:
    """Put the job's steady step time ``step_s``, measured up to ``step``, in the notice, which
    otherwise stays as it is. A commit's notice keeps its time: the next commit is due an interval
    of steps after it. A restore's is moved to when ``step`` would have been reached at this pace,
    so that the round's first steps (compiling, say) do not make the commit look due too early. No
    notice: nothing to do. Never raises; returns the error (also warned), else None."""
    path = Path(path)
    with _WRITING:
        current = read_notice(path)
        if current is None:
            return None
        at = current.at if current.is_commit else time.time() - (step - current.step) * step_s
        return _write(path, {**asdict(current), "at": at, "step_s": step_s},
                      f"cannot record the pace ({step_s:.3f} s a step)")


def _write(path: Path, notice: dict[str, object], what: str) -> str | None:
    try:  # a message to the live agent (in its own temporary folder): no fsync, which can take seconds
        write_file(path, json.dumps(notice), durable=False)
    except OSError as exc:
        error = f"{path}: {what} for the agent: {exc}"
        warnings.warn(error, stacklevel=3)
        return error
    return None


def read_notice(path: str | os.PathLike[str]) -> CommitNotice | None:
    """The latest notice at ``path``; None when there is none yet (or it is unreadable)."""
    try:
        raw = json.loads(Path(path).read_text())
        optional = {key: None if raw.get(key) is None else kind(raw[key])
                    for key, kind in (("previous_at", float), ("step_s", float), ("interval_steps", int))}
        return CommitNotice(step=int(raw["step"]), tier=str(raw["tier"]), at=float(raw["at"]), **optional)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
