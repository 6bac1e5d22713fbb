"""`torchrevive report`: what happened to a job, from its event log alone (the agents' and workers'
JSON lines, finished or still being written): its rounds, each recovery by phase, its saves, and
what went wrong on the way (restores that fell back, quarantines, fallbacks from in-process).
"""

from __future__ import annotations

import datetime
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agent.recovery_timeline import Event, recovery_after

PROBLEMS = ("restore_fallback", "snapshot_quarantined", "in_process_fallback", "round_left_behind", "save_skipped",
            "memory_save_failed", "commit_notice_failed", "warm_process_unavailable")
"""Events that say something did not go as planned, with the field that says why."""
_WHY = ("error", "reason", "busy_with", "committed")


def job_report(events: Sequence[Event]) -> dict[str, Any]:
    """The job's rounds, recoveries, saves and problems; times in seconds since its first event.
    ValueError when there is no event."""
    if not events:
        raise ValueError("the event log holds no event")
    events = sorted(events, key=lambda e: e["time"])
    start = events[0]["time"]
    return {
        "start": start,
        "seconds": events[-1]["time"] - start,
        "rounds": _rounds(events, start),
        "recoveries": _recoveries(events, start),
        "saves": _saves(events),
        "problems": _problems(events),
    }


def _rounds(events: Sequence[Event], start: float) -> list[dict[str, Any]]:
    """Each round as its leader (group rank 0) recorded it, else as the first node did."""
    first: dict[Any, Event] = {}
    for e in events:
        if e["event"] == "rendezvous_done":
            known = first.get(e.get("round"))
            if known is None or (e.get("group_rank") == 0 and known.get("group_rank") != 0):
                first[e.get("round")] = e
    return [{"round": e.get("round"), "at_s": e["time"] - start, "world_size": e.get("world_size"),
             "nodes": len(e.get("nodes") or []), "lost": e.get("lost") or [], "joined": e.get("joined") or [],
             "restore_from": Path(e["restore_from"]).name if e.get("restore_from") else None}
            for e in sorted(first.values(), key=lambda e: e["time"])]


def _recoveries(events: Sequence[Event], start: float) -> list[dict[str, Any]]:
    """Each recovery from the membership change that began it to every rank's first step; the last
    one is ``completed: False`` when the log ends before it does."""
    found: list[dict[str, Any]] = []
    done_at = -float("inf")
    for change in (e for e in events if e["event"] == "membership_change"):
        if change["time"] <= done_at:
            continue  # a change seen by another node, or during a recovery: part of it
        recovery = recovery_after(events, change["time"])
        if recovery is None:
            found.append({"at_s": change["time"] - start, "cause": change.get("cause"), "completed": False})
            break
        failed_at = min(change.get("failed_at") or change["time"], change["time"])
        done_at = failed_at + recovery["recovery_s"]
        found.append({"at_s": failed_at - start, "completed": True, **recovery})
    return found


def _saves(events: Sequence[Event]) -> dict[str, Any]:
    committed = [e for e in events if e["event"] == "save_committed"]
    seconds = sorted(e["seconds"] for e in committed if "seconds" in e)
    steps = [e["step"] for e in committed]
    return {"committed": len(committed), "steps": [min(steps), max(steps)] if steps else None,
            "seconds_median": statistics.median(seconds) if seconds else None,
            "seconds_range": [seconds[0], seconds[-1]] if seconds else None,
            "memory_committed": sum(e["event"] == "memory_save_committed" for e in events)}


def _problems(events: Sequence[Event]) -> list[dict[str, Any]]:
    counts = Counter(e["event"] for e in events if e["event"] in PROBLEMS)
    first = {}
    for e in events:
        if e["event"] in counts and e["event"] not in first:
            first[e["event"]] = next((f"{key}: {e[key]}" for key in _WHY if e.get(key) is not None), "")
    return [{"event": name, "count": count, "first": first[name]} for name, count in counts.most_common()]


def render(report: dict[str, Any]) -> str:
    """The report as text, one line per round, recovery and problem."""
    begun = datetime.datetime.fromtimestamp(report["start"], tz=datetime.timezone.utc)
    recoveries = report["recoveries"]
    lines = [f"job: from {begun:%Y-%m-%d %H:%M:%S} UTC for {report['seconds']:.1f} s, {len(report['rounds'])} "
             f"rounds, {sum(r['completed'] for r in recoveries)} recoveries"]
    lines.append("rounds:")
    lines += [round_line(r) for r in report["rounds"]]
    if recoveries:
        lines.append("recoveries (failure -> every rank's first step):")
    lines += [recovery_line(r) for r in recoveries]
    saves = report["saves"]
    if saves["committed"]:
        low, high = saves["seconds_range"]
        lines.append(f"saves: {saves['committed']} committed (steps {saves['steps'][0]} to {saves['steps'][1]}), "
                     f"{saves['seconds_median']:.2f} s median [{low:.2f}..{high:.2f}] from the call to the commit"
                     + (f"; {saves['memory_committed']} memory snapshots" if saves["memory_committed"] else ""))
    else:
        lines.append("saves: none committed")
    for p in report["problems"]:
        lines.append(f"{p['event']} x{p['count']}" + (f", first {p['first'][:300]}" if p["first"] else ""))
    return "\n".join(lines) + "\n"


def round_line(r: dict[str, Any]) -> str:
    """One round of :func:`job_report` as a line of text: when, its world, who changed, what it restores."""
    change = "".join(f", {what} {', '.join(r[what])}" for what in ("lost", "joined") if r[what])
    return (f"  {r['at_s']:8.1f} s  round {r['round']}: world size {r['world_size']} on {r['nodes']} nodes"
            f"{change}; restores {r['restore_from'] or 'nothing'}")


def recovery_line(recovery: dict[str, Any]) -> str:
    """One recovery of :func:`job_report` as a line of text: when, why, the world sizes, each phase."""
    r = recovery
    if not r["completed"]:
        return f"  {r['at_s']:8.1f} s  {r['cause']}: not completed when the log ends"
    phases = " ".join(f"{name} {seconds:.2f}" for name, seconds in r["phases"].items())
    restored = (f"; restored step {r['restored_step']} ({r['restore_source']})" if r["restored_step"] is not None
                else "")
    return (f"  {r['at_s']:8.1f} s  {r['cause']}: {r['world_size_before']} -> {r['world_size_after']} ranks "
            f"in {r['recovery_s']:.2f} s ({r['path']}): {phases}{restored}")
