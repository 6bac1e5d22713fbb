"""Events and metrics: JSON lines from several writers, the recovery timeline read back from a log,
and the Prometheus endpoint scraped over HTTP."""

from __future__ import annotations

import urllib.request

from conftest import free_port

from agent.events import EventLog, Metrics, read_events
from agent.recovery_timeline import recovery_after


def test_events_from_several_writers_read_back_in_order(tmp_path):
    log = tmp_path / "events.jsonl"
    agent_log, worker_log = EventLog(log, node="n1"), EventLog(log, node="n1", rank=0)
    agent_log.record("membership_change", cause="node_lost")
    worker_log.record("first_step_done", step=11)
    events = read_events(log)
    assert [(e["event"], e["node"], e.get("rank")) for e in events] == [
        ("membership_change", "n1", None), ("first_step_done", "n1", 0)]
    assert events[0]["time"] <= events[1]["time"]


def test_the_recovery_timeline_from_a_log():
    events = [
        {"time": 101.0, "event": "membership_change", "cause": "node_lost", "failed_at": 100.0, "world_size": 3},
        {"time": 104.0, "event": "rendezvous_done", "round": 2, "world_size": 2},
        {"time": 104.1, "event": "rendezvous_done", "round": 2, "world_size": 2},
        {"time": 107.0, "event": "restore_done", "seconds": 0.5, "step": 40, "rank": 0},
        {"time": 107.2, "event": "restore_done", "seconds": 0.6, "step": 40, "rank": 1},
        {"time": 108.0, "event": "first_step_done", "rank": 0},
    ]
    assert recovery_after(events, since=99.0) is None  # rank 1 has not trained yet
    events.append({"time": 108.5, "event": "first_step_done", "rank": 1})
    timeline = recovery_after(events, since=99.0)
    assert timeline["recovery_s"] == 8.5 and timeline["world_size_before"] == 3 and timeline["world_size_after"] == 2
    phases = timeline["phases"]
    assert phases["detect"] == 1.0 and round(phases["rendezvous"], 6) == 3.1 and timeline["restored_step"] == 40
    assert abs(sum(phases.values()) - timeline["recovery_s"]) < 1e-9


def test_metrics_are_served_over_http():
    port = free_port()
    metrics = Metrics.serve("127.0.0.1", port)
    metrics.set_world_size(3)
    metrics.count_recovery("node_lost")
    metrics.count_recovery("node_lost")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "torchrevive_world_size 3.0" in text
    assert 'torchrevive_recoveries_total{cause="node_lost"} 2.0' in text
