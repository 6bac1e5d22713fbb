"""A recovery's timeline from the event log alone: failure -> detection -> rendezvous -> workers
started -> restore -> first step, with the recovery time (RTO) from failure to the first step.

The failure time is the fault time when the caller knows it (a fault-injection harness), else the
``failed_at`` the detecting agent recorded (the lost node's last heartbeat, or the time a local
worker was seen failed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Event = dict[str, Any]


def events_after(events: Sequence[Event], name: str, since: float) -> list[Event]:
    """The events called ``name`` recorded at or after ``since``, oldest first."""
    return sorted((e for e in events if e["event"] == name and e["time"] >= since), key=lambda e: e["time"])


def recovery_after(events: Sequence[Event], since: float, failed_at: float | None = None) -> dict[str, Any] | None:
    """The first recovery that starts at or after ``since`` and is complete (every rank of the
    new round did its first step), or None while it is not."""
    changes = events_after(events, "membership_change", since)
    if not changes:
        return None
    first_change = changes[0]
    detected = first_change["time"]
    failed = failed_at if failed_at is not None else min(first_change.get("failed_at") or detected, detected)
    rendezvous = events_after(events, "rendezvous_done", detected)
    first_steps = events_after(events, "first_step_done", detected)
    for step in first_steps:
        before = [r for r in rendezvous if r["time"] <= step["time"]]
        if not before:
            continue
        last_round = before[-1]
        same_round = [r["time"] for r in before if r.get("round") == last_round.get("round")]
        round_start, rendezvous_done = min(same_round), max(same_round)
        ranks = {e["rank"] for e in first_steps if round_start <= e["time"] <= step["time"]}
        if len(ranks) < last_round["world_size"]:
            continue
        restores = [e for e in events if e["event"] == "restore_done" and round_start <= e["time"] <= step["time"]]
        restore_start = max((e["time"] - e["seconds"] for e in restores), default=rendezvous_done)
        restore_end = max((e["time"] for e in restores), default=rendezvous_done)
        phases = {
            "detect": detected - failed,
            "rendezvous": rendezvous_done - detected,
            "workers_start": max(0.0, restore_start - rendezvous_done),
            "restore": restore_end - max(restore_start, rendezvous_done),
            "first_step": step["time"] - restore_end,
        }
        started = [e for e in events if e["event"] == "workers_started" and round_start <= e["time"] <= step["time"]]
        fallbacks = [e for e in events if e["event"] == "in_process_fallback" and detected <= e["time"] <= step["time"]]
        in_process = any(e.get("start") == "in_process" for e in started) and not fallbacks
        return {
            "recovery_s": step["time"] - failed,
            # in_process: the survivors kept their processes (a joining node starts its own).
            "path": "in_process" if in_process else "restart",
            "fallback_reason": fallbacks[0]["reason"] if fallbacks else None,
            "cause": first_change["cause"],
            # A standby node's change has none: it ran no workers.
            "world_size_before": next((e["world_size"] for e in changes if e.get("world_size")), None),
            "world_size_after": last_round["world_size"],
            "restored_step": next((e.get("step") for e in restores), None),
            "restore_source": next((e.get("source") for e in restores), None),
            "bytes_from_storage": sum(e.get("bytes_from_storage", 0) for e in restores),
            "phases": phases,
            # Of the detect phase: how long a join waited for a commit while training went on.
            "deferred_s": first_change.get("deferred_s") or 0.0,
        }
    return None
