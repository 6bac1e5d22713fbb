"""What a rank learns from its agent: the environment contract between agent and worker.

The agent exports torchrun's variables (RANK, WORLD_SIZE, ...) and the TORCHREVIVE_* variables
below; :meth:`WorkerContext.from_env` reads both into one typed object.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

CHECKPOINT_DIR = "TORCHREVIVE_CHECKPOINT_DIR"
RESTORE_FROM = "TORCHREVIVE_RESTORE_FROM"
PREV_WORLD_SIZE = "TORCHREVIVE_PREV_WORLD_SIZE"
GRAD_ACCUM_STEPS = "TORCHREVIVE_GRAD_ACCUM_STEPS"
EVENT_LOG = "TORCHREVIVE_EVENT_LOG"
CONFIG = "TORCHREVIVE_CONFIG"
ROUND = "TORCHREVIVE_ROUND"
MEMORY_DIR = "TORCHREVIVE_MEMORY_DIR"
MEMORY_BUDDY = "TORCHREVIVE_MEMORY_BUDDY"
COMMIT_NOTICE = "TORCHREVIVE_COMMIT_NOTICE"
REGROUP_DIR = "TORCHREVIVE_REGROUP_DIR"
"""Where the agent and its workers re-form rounds in-process (:mod:`agent.regroup`); unset unless
``elastic.in_process``."""
REHEARSAL_ROUND = -1
"""``TORCHREVIVE_ROUND`` of a joining node's rehearsal (:mod:`agent.rehearsal`): a round of the node's
own workers alone, before it joins, for the script's warm-up."""
PROCESS_GROUP_TIMEOUT = "TORCHREVIVE_PROCESS_GROUP_TIMEOUT"
"""Seconds a collective may wait for a silent peer (``elastic.process_group_timeout``)."""


@dataclass(frozen=True, kw_only=True)
class WorkerContext:
    """One rank's view of the job for the current round.

    ``prev_world_size`` is None in the first round; ``restore_from`` is None when the agent chose
    no snapshot (none exists yet, or the job runs without a checkpoint dir); ``round`` is the
    rendezvous round (the fencing token of saves), None outside torchrevive's agent.
    ``memory_dir`` is the node's memory directory when the memory tier is on, ``memory_buddy``
    the ``host:port`` of the agent that holds this node's replicas ("" with a single node).
    ``commit_notice`` is the file where the node's local rank 0 tells its agent of each commit
    (:mod:`agent.commit_notice`), None outside torchrevive's agent. ``process_group_timeout`` is
    the timeout to give the process groups (``init_process_group(timeout=...)``), derived with the
    other recovery timeouts (:mod:`agent.timeouts`); None outside torchrevive's agent (torch's
    default).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    group_rank: int
    restart_count: int
    run_id: str
    checkpoint_dir: str | None
    restore_from: str | None
    prev_world_size: int | None
    grad_accum_steps: int
    event_log: str | None
    config_path: str | None
    round: int | None = None
    memory_dir: str | None = None
    memory_buddy: str = ""
    commit_notice: str | None = None
    process_group_timeout: datetime.timedelta | None = None

    @property
    def rehearsal(self) -> bool:
        """Whether this is a joining node's rehearsal (:data:`REHEARSAL_ROUND`), not a round of the job."""
        return self.round == REHEARSAL_ROUND

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        """Read the context from the environment (a process started by the agent, or torchrun:
        then the TORCHREVIVE_* fields take their defaults). Outside any launcher this is a
        single-process world of size 1."""
        env = os.environ if environ is None else environ

        def integer(name: str, default: int) -> int:
            raw = env.get(name, "")
            try:
                return int(raw) if raw else default
            except ValueError:
                raise ValueError(f"environment variable {name}={raw!r} is not a whole number; the launcher sets it") from None

        def optional(name: str) -> str | None:
            return env.get(name) or None

        prev = integer(PREV_WORLD_SIZE, 0)
        return cls(
            rank=integer("RANK", 0),
            local_rank=integer("LOCAL_RANK", 0),
            world_size=integer("WORLD_SIZE", 1),
            local_world_size=integer("LOCAL_WORLD_SIZE", 1),
            group_rank=integer("GROUP_RANK", 0),
            restart_count=integer("TORCHELASTIC_RESTART_COUNT", 0),
            run_id=env.get("TORCHELASTIC_RUN_ID", ""),
            checkpoint_dir=optional(CHECKPOINT_DIR),
            restore_from=optional(RESTORE_FROM),
            prev_world_size=prev or None,
            grad_accum_steps=integer(GRAD_ACCUM_STEPS, 1),
            event_log=optional(EVENT_LOG),
            config_path=optional(CONFIG),
            round=integer(ROUND, -1) if env.get(ROUND) else None,
            memory_dir=optional(MEMORY_DIR),
            memory_buddy=env.get(MEMORY_BUDDY, ""),
            commit_notice=optional(COMMIT_NOTICE),
            process_group_timeout=_seconds(env, PROCESS_GROUP_TIMEOUT),
        )


def _seconds(env: Mapping[str, str], name: str) -> datetime.timedelta | None:
    raw = env.get(name, "")
    try:
        return datetime.timedelta(seconds=float(raw)) if raw else None
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not a number of seconds; the launcher sets it") from None
