"""`torchrevive status`: a running job as its rendezvous, its checkpoint dir and its event log show
it now: the round, its members and their addresses, nodes waiting or spare, the snapshot the round
restored, each tier's newest snapshot, and the last recoveries by phase.

What comes from the rendezvous is data from the network (:mod:`agent.rendezvous.state_reader`
decodes it safely); values a peer published are checked before they are shown, and a value that
fails a check is shown as such, not as what it claims.
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from agent import torch_private
from agent.checkpoint.dirs import committed_snapshots
from agent.config import JobConfig, recovery_timeouts
from agent.events import read_events
from agent.memory.layout import decode_inventory, of_run
from agent.memory.tier import inventory_key, newest_complete
from agent.recovery_agent import nodes_used
from agent.rendezvous import round_state, round_values
from agent.rendezvous.round_keys import RESTORE_FROM_KEY
from agent.rendezvous.round_values import MEMORY_CHOICE
from agent.rendezvous.state_reader import RendezvousReader
from agent.report import job_report, recovery_line

RECOVERIES_SHOWN = 3


def job_status(job: JobConfig, reader: RendezvousReader, *, now: float | None = None) -> dict[str, Any]:
    """The job's status, JSON-able: ``rendezvous`` (None before any node joined), ``restored``,
    ``storage``, ``memory`` and ``recoveries`` (None where the config names no event log)."""
    now = time.time() if now is None else now
    state, live_keys = reader.state()
    status: dict[str, Any] = {"time": now, "where": reader.where, "run_id": job.job.id,
                              "rendezvous": None, "restored": None, "memory": None,
                              "storage": _storage(job.checkpoint.dir), "recoveries": _recoveries(job)}
    if state is None:
        return status
    timeouts = recovery_timeouts(job)
    timeout = None if timeouts is None else timeouts.detection_s
    nproc = job.job.nproc_per_node
    training = (nodes_used(len(state.participants), nproc, job.elastic.world_size_multiple_of)
                if isinstance(nproc, int) else len(state.participants))

    def node(n: Any, role: str, group_rank: int | None = None) -> dict[str, Any]:
        beat = state.last_heartbeats.get(n)
        name = round_state.node_name(n)
        return {"name": name, "addr": n.addr, "pid": n.pid, "group_rank": group_rank, "role": role,
                "heartbeat_age_s": None if beat is None else now - beat.timestamp(),
                "heartbeat_live": None if live_keys is None else name in live_keys}

    members = [node(n, "joined" if not state.complete else "training" if rank < training else "standby", rank)
               for n, rank in sorted(state.participants.items(), key=lambda item: item[1])]
    status["rendezvous"] = {
        "round": state.round, "complete": state.complete, "closed": state.closed, "heartbeat_timeout_s": timeout,
        "members": members,
        "waiting": [node(n, "waiting") for n in sorted(state.wait_list, key=round_state.node_name)],
        "spares": [node(n, "spare") for n in sorted(state.redundancy_list, key=round_state.node_name)],
    }
    if state.complete:
        status["restored"] = _restored(reader, job.job.id, state.round)
        status["memory"] = _memory(reader, job.job.id, state.round, len(members))
    return status


def _storage(directory: str | None) -> dict[str, Any] | None:
    if not directory:
        return None
    committed = committed_snapshots(Path(directory))
    if not committed:
        return {"dir": directory, "newest": None}
    step, path = committed[-1]
    try:
        committed_at: float | None = path.stat().st_mtime
    except FileNotFoundError:  # pruned since it was listed: the next refresh shows the newer one
        committed_at = None
    return {"dir": directory, "newest": {"step": step, "path": str(path), "committed_at": committed_at}}


def _restored(reader: RendezvousReader, run_id: str, round: int) -> dict[str, Any] | None:
    """The snapshot the round's leader chose for the round to restore, checked as the agents check it."""
    key = torch_private.run_round_key(run_id, round, RESTORE_FROM_KEY)
    value = reader.job_value(key)
    if value is None:
        return None
    text = value.decode(errors="replace")
    if not text:
        return {"tier": None, "snapshot": None}
    try:
        if text.startswith(MEMORY_CHOICE):
            return {"tier": "memory", "snapshot": round_values.chosen_memory_snapshot(key, text).snapshot.relative}
        return {"tier": "storage", "snapshot": round_values.snapshot_name(key, text)}
    except RendezvousStateError:
        return {"tier": "unreadable", "snapshot": None}


def _memory(reader: RendezvousReader, run_id: str, round: int, nodes: int) -> dict[str, Any]:
    """The memory tier as the round's nodes published it when the round formed: the newest
    snapshot their run committed whose every file some node held then."""
    held, malformed = {}, 0
    for group_rank in range(nodes):
        key = inventory_key(round, group_rank)
        value = reader.job_value(key)
        if value is None:
            continue
        try:
            held[group_rank] = of_run(decode_inventory(value, source=key), run_id)
        except ValueError:
            malformed += 1
    choice = newest_complete(held) if held else None
    return {"published": len(held), "malformed": malformed, "newest": choice.snapshot.relative if choice else None}


def _recoveries(job: JobConfig) -> dict[str, Any] | None:
    log = job.observability.event_log
    if not log:
        return None
    try:
        report = job_report(read_events(log))
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return {"event_log": log, "error": why, "rounds": 0, "total": 0, "last": []}
    return {"event_log": log, "error": None, "rounds": len(report["rounds"]),
            "total": len(report["recoveries"]), "last": report["recoveries"][-RECOVERIES_SHOWN:]}


def render(status: dict[str, Any]) -> str:
    """The status as text."""
    at = datetime.datetime.fromtimestamp(status["time"], tz=datetime.timezone.utc)
    lines = [f"job {status['run_id']} at {at:%Y-%m-%d %H:%M:%S} UTC, from {status['where']}"]
    rdzv = status["rendezvous"]
    if rdzv is None:
        lines.append(f"rendezvous: no state for run '{status['run_id']}' (no agent joined yet, or another --rdzv-id)")
    else:
        phase = "closed" if rdzv["closed"] else "complete" if rdzv["complete"] else "forming"
        members = "members" if rdzv["complete"] else "joined so far"
        lines.append(f"round {rdzv['round']} ({phase}): {len(rdzv['members'])} {members}, {len(rdzv['waiting'])} "
                     f"waiting, {len(rdzv['spares'])} spare")
        # Until a round completes, its nodes' keep-alives are paused: no heartbeat is late then.
        timeout = rdzv["heartbeat_timeout_s"] if rdzv["complete"] else float("inf")
        for node in rdzv["members"] + rdzv["waiting"] + rdzv["spares"]:
            rank = f"node {node['group_rank']}" if node["group_rank"] is not None else ""
            lines.append(f"  {rank:8s} {node['role']:8s} {_shown(node['addr']):24s} pid {node['pid']:<8d} "
                         f"{_heartbeat(node, timeout)}")
    lines.append(f"restored: {_restored_text(status['restored'], rdzv)}")
    storage = status["storage"]
    if storage is None:
        lines.append("storage: no checkpoint.dir (give --config job.yaml)")
    elif storage["newest"] is None:
        lines.append(f"storage: no committed snapshot in {storage['dir']} (as this machine sees it)")
    else:
        newest = storage["newest"]
        when = "just pruned" if newest["committed_at"] is None else \
            f"committed {status['time'] - newest['committed_at']:.0f} s ago"
        lines.append(f"storage: newest committed step_{newest['step']} ({newest['path']}, {when})")
    lines.append(f"memory: {_memory_text(status['memory'], rdzv)}")
    lines += _recoveries_text(status["recoveries"])
    return "\n".join(lines) + "\n"


def _shown(text: str, limit: int = 64) -> str:
    """A string from the network as it may go to a terminal: escapes for what is not printable."""
    return (text if text.isprintable() else text.encode("unicode_escape").decode())[:limit]


def _heartbeat(node: dict[str, Any], timeout: float) -> str:
    if node["heartbeat_live"] is not None:
        return "heartbeat key live" if node["heartbeat_live"] else "heartbeat key gone (lapsing)"
    age = node["heartbeat_age_s"]
    if age is None:
        return "no heartbeat"
    return f"heartbeat {age:.1f} s ago" + (f" (late: over {timeout:.0f} s)" if age > timeout else "")


def _restored_text(restored: dict[str, Any] | None, rdzv: dict[str, Any] | None) -> str:
    if rdzv is None or not rdzv["complete"]:
        return _forming(rdzv)
    if restored is None:
        return f"not published for round {rdzv['round']} (its leader has not chosen yet)"
    if restored["tier"] == "unreadable":
        return "the round's published choice is not a snapshot name (something else wrote the store)"
    if restored["tier"] is None:
        return "nothing (no committed snapshot when the round formed)"
    return f"{restored['snapshot']} ({restored['tier']})"


def _forming(rdzv: dict[str, Any] | None) -> str:
    return "no round has formed" if rdzv is None else f"round {rdzv['round']} is still forming"


def _memory_text(memory: dict[str, Any] | None, rdzv: dict[str, Any] | None) -> str:
    if memory is None:
        return _forming(rdzv)
    if not memory["published"]:
        return (f"nothing published in the rendezvous for round {rdzv['round']} (the memory tier is off: "
                "checkpoint.memory_interval_steps; or the round's agents have not published yet)"
                + (f"; {memory['malformed']} malformed inventories" if memory["malformed"] else ""))
    newest = memory["newest"] or "no snapshot whole on the round's nodes"
    return (f"{newest}, as {memory['published']} nodes published it when round {rdzv['round']} formed (agents "
            "publish once a round)")


def _recoveries_text(recoveries: dict[str, Any] | None) -> list[str]:
    if recoveries is None:
        return ["recoveries: no observability.event_log in the config"]
    if recoveries["error"]:
        return [f"recoveries: {recoveries['event_log']}: {recoveries['error']}"]
    if not recoveries["last"]:
        return [f"recoveries: none in {recoveries['event_log']} ({_rounds(recoveries['rounds'])})"]
    return [f"recoveries: last {len(recoveries['last'])} of {recoveries['total']} ({_rounds(recoveries['rounds'])}), "
            "seconds since the log's first event:", *map(recovery_line, recoveries["last"])]


def _rounds(count: int) -> str:
    return f"{count} round" + ("" if count == 1 else "s")
