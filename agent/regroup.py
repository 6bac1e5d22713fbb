"""The regroup channel: how a node's agent and its live workers re-form a round in-process
(``elastic.in_process``), through small JSON files in a directory of the agent's own
(``TORCHREVIVE_REGROUP_DIR``), each replaced atomically (not durably: they are messages between
live processes):

* ``leave.json`` (agent -> workers): ``{"round": R, "finish_step_s": S}``, every round up to R must
  end: now, or, when S > 0 (nobody was lost: the step in flight can complete), at the end of the
  step in flight if that comes within S seconds;
* ``left-<local rank>.json`` (worker -> agent): ``{"round", "reason", "step", "pid", "healed",
  "sharded"}``, the worker left round R (asked to, or its collective failed) holding the state of
  ``step`` (in memory the next round heals from, when ``healed``: its training function healed R;
  when ``sharded``, only if no node was lost), and waits;
* ``handover-<local rank>.json`` (agent -> worker): ``{"round", "env"}``, the next round's
  torchrun and TORCHREVIVE_* variables;
* ``taken-<local rank>.json`` (worker -> agent): ``{"round"}``, the worker took round R's
  environment and goes on to form its process group.

A worker that does not leave a round, or take the next, in time gets ``STACK_DUMP_SIGNAL`` before
it is stopped: it writes its threads' stacks to its stderr (faulthandler), which says where it was
stuck.

What is read is data, checked before use: a malformed file reads as absent.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.durable import write_file

LEAVE = "leave.json"
STACK_DUMP_SIGNAL = signal.SIGUSR1
STACK_DUMP_WAIT_S = 0.5
"""How long the agent gives a late worker to write its stacks before it stops it."""


@dataclass(frozen=True)
class Left:
    """A worker's word that it left ``round``: why, the step whose state it holds (None: none), and
    whether that state heals the next round (its training function healed ``round``: it restores
    from no snapshot; ``sharded`` state only when no node was lost)."""

    round: int
    reason: str
    step: int | None
    pid: int
    healed: bool = False
    sharded: bool = False


@dataclass(frozen=True)
class LeaveRequest:
    """The agent's request that every round up to ``round`` end, at once or, with
    ``finish_step_s`` > 0, at the end of the step in flight if it ends within that many seconds."""

    round: int
    finish_step_s: float = 0.0


def request_leave(directory: str | os.PathLike[str], round: int, finish_step_s: float = 0.0) -> None:
    """Ask the node's workers to end every round up to ``round`` (see :class:`LeaveRequest`)."""
    write_file(Path(directory) / LEAVE, json.dumps({"round": round, "finish_step_s": finish_step_s}), durable=False)


def leave_requested(directory: str | os.PathLike[str]) -> LeaveRequest | None:
    """The agent's latest request to end rounds, or None."""
    raw = _read(Path(directory) / LEAVE)
    if not isinstance(raw, dict) or not isinstance(raw.get("round"), int):
        return None
    finish = raw.get("finish_step_s", 0.0)
    if isinstance(finish, bool) or not isinstance(finish, int | float) or not 0 <= finish < float("inf"):
        finish = 0.0  # a request all the same: leave at once
    return LeaveRequest(round=raw["round"], finish_step_s=float(finish))


def post_left(directory: str | os.PathLike[str], local_rank: int, left: Left) -> None:
    write_file(Path(directory) / f"left-{local_rank}.json",
               json.dumps({"round": left.round, "reason": left.reason, "step": left.step, "pid": left.pid,
                          "healed": left.healed, "sharded": left.sharded}),
               durable=False)


def read_left(directory: str | os.PathLike[str], local_rank: int) -> Left | None:
    raw = _read(Path(directory) / f"left-{local_rank}.json")
    try:
        step = raw["step"]
        if not isinstance(step, int | None) or not all(isinstance(raw[k], int) for k in ("round", "pid")):
            return None
        return Left(round=raw["round"], reason=str(raw["reason"]), step=step, pid=raw["pid"],
                    healed=raw.get("healed") is True, sharded=raw.get("sharded") is not False)
    except (KeyError, TypeError):
        return None


def left_round(directory: str | os.PathLike[str], local_ranks: list[int], round: int) -> dict[int, Left]:
    """What each of ``local_ranks`` that said it left ``round`` said, by local rank."""
    said = {rank: read_left(directory, rank) for rank in local_ranks}
    return {rank: left for rank, left in said.items() if left is not None and left.round == round}


def hand_over(directory: str | os.PathLike[str], local_rank: int, round: int, env: dict[str, str]) -> None:
    write_file(Path(directory) / f"handover-{local_rank}.json", json.dumps({"round": round, "env": env}), durable=False)


def read_handover(directory: str | os.PathLike[str], local_rank: int,
                  after: int) -> tuple[int, dict[str, str]] | None:
    """The round later than ``after`` handed to this worker and its environment, or None yet."""
    raw = _read(Path(directory) / f"handover-{local_rank}.json")
    if not isinstance(raw, dict) or not isinstance(raw.get("round"), int) or raw["round"] <= after:
        return None
    env = raw.get("env")
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        return None
    return raw["round"], env


def post_taken(directory: str | os.PathLike[str], local_rank: int, round: int) -> None:
    write_file(Path(directory) / f"taken-{local_rank}.json", json.dumps({"round": round}), durable=False)


def took_round(directory: str | os.PathLike[str], local_ranks: list[int], round: int) -> set[int]:
    """Which of ``local_ranks`` said they took ``round``'s environment."""
    said = {rank: _read(Path(directory) / f"taken-{rank}.json") for rank in local_ranks}
    return {rank for rank, raw in said.items() if isinstance(raw, dict) and raw.get("round") == round}


def _read(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
