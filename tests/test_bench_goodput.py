"""The goodput benchmark's short form: 3 real nodes, one kill, the fault-free and memory-tier
approaches (the job resumes from the peers' RAM) and, where their environment can be made, torchft
and ft_launcher; the JSON keeps its contract and no process outlives the script. Speed is measured
by the script itself (scripts/bench_goodput.py), never here."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import psutil
import pytest
from conftest import REPO, worker_env

from agent.events import read_events

sys.path.insert(0, str(REPO / "scripts"))
from bench_goodput import LOSS_RTOL, Fault, loss_vs_fault_free, make_schedule, measure, samples_lost
from harness.goodput_plot import draw
from harness.machine import PAGE_REPORTING_ORDER
from harness.peers_env import PeersUnavailable, peers_python
from harness.workloads import workload_of

DURATION_S = 60
KILL_AT_S = 30
"""One kill, 30 s into the run: on a loaded 2-core machine a recovery takes 7-20 s."""


def test_the_schedule_rotates_over_live_nodes_and_spares_node_0():
    assert make_schedule(4, 100, 20, 10) == [
        Fault(20, "kill", 1), Fault(30, "rejoin", 1), Fault(40, "kill", 2), Fault(50, "rejoin", 2),
        Fault(60, "kill", 3), Fault(70, "rejoin", 3), Fault(80, "kill", 1), Fault(90, "rejoin", 1)]
    # With both other nodes down at 30 s, that kill is skipped; a rejoin is only scheduled before the end.
    assert make_schedule(3, 50, 10, 25) == [Fault(10, "kill", 1), Fault(20, "kill", 2), Fault(35, "rejoin", 1),
                                            Fault(40, "kill", 1), Fault(45, "rejoin", 2)]


def test_samples_steps_recoveries_and_pauses_from_the_marks():
    def mark(t, step, first=False, world=3):
        return {"time": 1000.0 + t, "event": "first_step_done" if first else "step", "step": step, "world_size": world,
                "samples": 16 * world}

    marks = [mark(-5, 1, True, 2), mark(-4, 2, world=2),  # a smaller world before t0: not timed
             mark(0, 1, True), *[mark(t, t + 1) for t in range(1, 12)],  # trained to step 12, killed at 12 s
             mark(15, 11, True, 2), mark(16, 12, world=2), mark(17, 13, world=2),  # restored step 10
             mark(20, 11, True), mark(21, 12),  # a rejoin at 18 s restarted it from step 10 again
             mark(30, 14, world=2)]  # after the end
    performed = [(Fault(12, "kill", 1), 1012.0), (Fault(18, "rejoin", 1), 1018.0)]
    result = measure(marks, marks[2], 25, performed)
    # 12 - 10 lost at the kill, then 13 - 10 at the rejoin (not 12 - 10 again: what was trained
    # since the previous restart is what the rejoin threw away).
    assert (result["recoveries"], result["steps_lost"]) == (2, 2 + 3)
    # In the model at the end: steps 1..12, steps 11 and 12 as trained last (at 3 ranks, after the
    # rejoin); the 2-rank steps 11..13 were rolled back.
    assert result["steps"] == 12 and result["samples"] == 12 * 48 and result["tokens"] is None
    # The GPT's marks carry their tokens: those of the same steps count.
    with_tokens = [{**m, "tokens": m["samples"] * 32} for m in marks]
    assert measure(with_tokens, with_tokens[2], 25, performed)["tokens"] == 12 * 48 * 32
    kill, rejoin = result["recovery_details"]
    assert kill["cause"] == {"at_s": 12, "action": "kill", "node": 1} and kill["recovery_s"] == 3.0
    assert rejoin["step_at_failure"] == 13 and rejoin["recovery_s"] == 2.0
    # The kill stopped training from 11 s to 15 s, the rejoin from 17 s to 20 s.
    assert [(p["action"], p["pause_s"]) for p in result["pauses"]] == [("kill", 4.0), ("rejoin", 3.0)]
    # The time by what filled it: the two rounds' first steps, 1 + 11 steps at 3 ranks, 2 at 2.
    assert result["time_split"] == {"restarts": {"seconds": 4.0 + 3.0, "samples": 32 + 48},
                                    "full_world": {"seconds": 12.0, "samples": 12 * 48},
                                    "smaller_world": {"seconds": 2.0, "samples": 2 * 32},
                                    "tail_s": 4.0, "start_samples": 48}
    assert result["thrown_away_samples"] == 2 * 48 + 3 * 32
    # Against a fault-free run of 48 samples a second: what each part cost adds up to 1 - goodput.
    lost = samples_lost(result, 25 * 48, 25)
    assert lost == pytest.approx({"thrown_away": 192 / 1200, "restarts": (7 * 48 - 80) / 1200, "full_world": 0.0,
                                  "smaller_world": (2 * 48 - 64) / 1200, "window_ends": (4 * 48 - 48) / 1200})
    assert sum(lost.values()) == pytest.approx(1 - result["samples"] / 1200)


def test_a_rejoin_during_a_recovery_pauses_nothing_more():
    marks = [{"time": 1000.0 + t, "event": "first_step_done" if t in (0, 20) else "step", "step": s, "world_size": 3,
              "samples": 48} for t, s in [(0, 1), (1, 2), (2, 3), (20, 3), (21, 4)]]
    performed = [(Fault(5, "kill", 1), 1005.0), (Fault(10, "rejoin", 1), 1010.0)]
    kill, rejoin = measure(marks, marks[0], 30, performed)["pauses"]
    assert (kill["pause_s"], rejoin["pause_s"]) == (18.0, 1.0)


def test_a_pause_is_the_faults_it_spans_or_follows():
    """A step that ends just after a kill (its all-reduce was done) does not hide the kill's pause;
    a pause that began before a kill, after a rejoin, is the kill's."""
    times = [*range(0, 20), 20.1, 26.0, 27.0, 28.0, 29.5, 37.0, 38.0]
    marks = [{"time": 1000.0 + t, "event": "step", "step": i + 1, "world_size": 3, "samples": 48}
             for i, t in enumerate(times)]
    performed = [(Fault(20, "kill", 1), 1020.0), (Fault(25, "rejoin", 1), 1025.0), (Fault(30, "kill", 2), 1030.0)]
    kill, rejoin, second_kill = measure(marks, marks[0], 40, performed)["pauses"]
    assert kill["pause_s"] == pytest.approx(26.0 - 20.1) and second_kill["pause_s"] == pytest.approx(37.0 - 29.5)
    assert rejoin["pause_s"] == pytest.approx(1.5)  # 28 -> 29.5, its own


def test_a_smaller_world_that_goes_on_trains_fewer_samples_a_step():
    """torchft's survivors never roll back: their steps stay, each with the samples of the replica
    groups that took part."""
    marks = [{"time": 1000.0 + t, "event": "step", "step": t + 1, "world_size": 3 if t < 5 or t > 8 else 2,
              "samples": 48 if t < 5 or t > 8 else 32} for t in range(12)]
    result = measure(marks, marks[0], 20, [(Fault(5, "kill", 2), 1005.5)])
    assert (result["steps"], result["samples"], result["recoveries"]) == (12, 8 * 48 + 4 * 32, 0)


def test_a_loss_that_left_the_fault_free_runs_is_found_at_its_step():
    reference = [[step, 4.0 - step / 10] for step in range(1, 11)]
    same = [[step, loss * (1 + 1e-7)] for step, loss in reference[2:]]  # summation order only
    assert loss_vs_fault_free(same, reference) == {"max_rel_diff": pytest.approx(1e-7), "at_step": 10,
                                                   "steps_compared": 8}
    wrong = [*same[:4], [7, 4.96], *same[5:]]  # a wrong shard after a recovery: the loss jumps
    assert loss_vs_fault_free(wrong, reference)["at_step"] == 7
    assert loss_vs_fault_free(wrong, reference)["max_rel_diff"] > LOSS_RTOL
    diverged = [*same, [11, float("nan")]]
    assert loss_vs_fault_free(diverged, reference)["max_rel_diff"] == pytest.approx(1e-7)  # step 11: no reference
    assert loss_vs_fault_free([[9, float("nan")]], reference) == {"max_rel_diff": float("inf"), "at_step": 9,
                                                                 "steps_compared": 1}
    assert loss_vs_fault_free([[20, 1.0]], reference) is None


@pytest.fixture(scope="module")
def short_run(tmp_path_factory) -> tuple[dict, Path, str | None]:
    """One short run of the benchmark: fault-free, the memory tier, in-process recovery and, when
    their environment can be made, the peers; (report, work dir, why the peers did not run)."""
    tmp = tmp_path_factory.mktemp("goodput")
    try:
        peers_python()
        approaches, no_peers = ["fault_free", "torchrevive_memory", "torchrevive_in_process", "torchft", "nvrx"], None
    except PeersUnavailable as exc:
        approaches, no_peers = ["fault_free", "torchrevive_memory", "torchrevive_in_process"], str(exc)
    out = tmp / "goodput.json"
    done = subprocess.run(
        [sys.executable, "scripts/bench_goodput.py", "--nodes", "3", "--state-mb", "4", "--duration-s", str(DURATION_S),
         "--kill-every-s", str(KILL_AT_S), "--rejoin-after-s", "1000", "--approaches", ",".join(approaches),
         "--interval-steps", "400", "--work-dir", str(tmp / "work"), "--json", str(out)],
        cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), tmp / "work", no_peers


def test_bench_goodput_writes_its_contract_and_leaves_no_process(short_run):
    report, work, _ = short_run
    assert report["duration_s"] == DURATION_S
    assert report["schedule"] == [{"at_s": KILL_AT_S, "action": "kill", "node": 1}]  # never node 0; no rejoin in time
    for name, result in report["results"].items():
        assert isinstance(result["samples"], int) and result["samples"] > 0, (name, result)
        assert 0 < result["steps"] <= result["samples"] and result["peer_config"], (name, result)
        # Samples kept against the fault-free run's; above 1 is possible here: on 2 cores, 2 survivors
        # step faster than 3 nodes do.
        assert result["goodput"] == pytest.approx(result["samples"] / report["results"]["fault_free"]["samples"])
        assert result["goodput"] > 0 and result["steps_lost"] >= 0, (name, result)
        assert result["full_world_step_s"] > 0, (name, result)
        assert sum(result["samples_lost"].values()) == pytest.approx(1 - result["goodput"]), (name, result)
    assert report["results"]["fault_free"]["goodput"] == 1.0
    # The machine as the figures need it: on a VM that hands freed memory back to its host, fresh
    # memory costs far more to touch (harness.machine).
    assert report["machine"]["free_page_reporting_order"] == (int(PAGE_REPORTING_ORDER.read_text())
                                                              if PAGE_REPORTING_ORDER.exists() else None)
    assert report["machine"]["cpus"] == os.cpu_count() and len(report["machine"]["load_avg_1m_5m_15m"]) == 3
    assert (report["workload"], report["params"]) == ("mlp", workload_of(argparse.Namespace(state_mb=4)).params)
    assert all(result["tokens"] is None for result in report["results"].values())  # the MLP's samples are no text
    memory = report["results"]["torchrevive_memory"]
    # One kill; a survivor a moment late can still miss the first round and join at once, a second
    # recovery (open work of the fast-restart issue): the job ends in one round of the 2 survivors.
    assert memory["faults"] == 1 and memory["recoveries"] >= 1
    details = memory["recovery_details"]
    assert details[0]["cause"]["action"] == "kill" and details[-1]["world_size"] == 2
    assert sum(d["step_at_failure"] - d["step_restored"] for d in details) == memory["steps_lost"] >= 0
    assert memory["pauses"][0]["action"] == "kill" and memory["pauses"][0]["pause_s"] > 0
    # examples/train.py keeps its global batch of 48 at any world size.
    assert memory["samples"] == 48 * memory["steps"]
    # Every step in the model trained what the fault-free run's did: the same loss, up to summation order.
    for name in ("torchrevive_memory", "torchrevive_in_process"):
        drift = report["results"][name]["loss_vs_fault_free"]
        assert drift["steps_compared"] >= report["results"][name]["steps"] // 2, (name, drift)
        assert drift["max_rel_diff"] <= LOSS_RTOL, (name, drift)
    events = read_events(work / "torchrevive_memory" / "events.jsonl")
    # Storage snapshots 400 steps apart (a few seconds here): the survivors resume from the newest
    # snapshot, the peers' RAM's unless a storage save committed just before the kill is as new (the
    # memory tier's writer yields the CPU to training, so on a job of 15 ms steps its snapshot can be
    # a few steps behind). tests/test_memory_tier.py checks the restore from memory itself.
    sources = [e["source"] for e in events if e["event"] == "restore_done"]
    assert len(sources) >= 2 and set(sources) <= {"memory", "storage"}, sources
    leftovers = [p.pid for p in psutil.process_iter(["cmdline"]) if str(work) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers
    # The picture beside the JSON: a line of steps per approach, and their losses below.
    svg = ElementTree.parse(work.parent / "goodput.svg").getroot()
    lines = list(svg.iter("{http://www.w3.org/2000/svg}polyline"))
    logged = [name for name, result in report["results"].items() if result.get("losses")]
    assert len(lines) == len(report["results"]) + len(logged) and "fault_free" in logged, logged


def test_in_process_survivors_go_on_from_the_step_they_held(short_run):
    report, work, _ = short_run
    in_process = report["results"]["torchrevive_in_process"]
    assert in_process["faults"] == 1 and in_process["recoveries"] >= 1, in_process
    # A rank can complete the step its peer died in; the round goes on from the newest step held.
    assert in_process["steps_lost"] <= in_process["recoveries"], in_process
    events = read_events(work / "torchrevive_in_process" / "events.jsonl")
    assert {e["path"] for e in events if e["event"] == "workers_stopped"} == {"in_process"}
    assert {e["source"] for e in events if e["event"] == "restore_done"} <= {"in_process", "peer"}


def test_the_peers_run_under_the_same_schedule(short_run):
    """torchft's survivors go on at 2 of 3 replica groups (16 samples a step each); ft_launcher
    restarts every worker from rank 0's checkpoint."""
    report, _, no_peers = short_run
    if no_peers:
        pytest.skip(no_peers)
    torchft, nvrx = report["results"]["torchft"], report["results"]["nvrx"]
    assert torchft["recoveries"] == 0 and torchft["steps_lost"] == 0, torchft
    assert 16 * 2 * torchft["steps"] <= torchft["samples"] < 16 * 3 * torchft["steps"], torchft
    assert torchft["pauses"][0]["pause_s"] > 0
    assert torchft["peer_config"]["lighthouse"]["heartbeat_timeout_ms"] > 0
    assert nvrx["recoveries"] == 1 and nvrx["recovery_details"][0]["world_size"] == 2, nvrx
    assert nvrx["recovery_details"][0]["cause"]["action"] == "kill"
    assert nvrx["peer_config"]["launcher"].startswith("ft_launcher")


def test_the_picture_draws_each_approach_and_each_fault():
    report = {"duration_s": 30, "schedule": [{"at_s": 10, "action": "kill", "node": 1},
                                             {"at_s": 20, "action": "rejoin", "node": 1}],
              "results": {name: {"goodput": goodput, "started_from_step": 4,
                                 "timeline": [[0.0, 5, 3], [10.0, 15, 3], [14.0, 12, 2], [30.0, 30, 3]]}
                          for name, goodput in (("fault_free", 1.0), ("torchft", 0.9))}}
    svg = ElementTree.fromstring(draw(report))  # well-formed
    lines = list(svg.iter("{http://www.w3.org/2000/svg}polyline"))
    assert len(lines) == 2 and lines[0].get("stroke") != lines[1].get("stroke")
    texts = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert "kill 1" in texts and "rejoin 1" in texts and "torchft (goodput 0.900)" in texts
    assert "step" not in texts  # no losses logged: no loss panel
    # With losses (the GPT's), a second panel: each approach's loss against the step, a step run
    # twice drawn with its last value, and a diverged (NaN) step left out.
    report["results"]["fault_free"]["losses"] = [[1, 5.0], [2, 4.0], [3, 3.0]]
    report["results"]["torchft"]["losses"] = [[1, 5.0], [2, 4.5], [2, 4.0], [3, float("nan")]]
    svg = ElementTree.fromstring(draw(report))
    losses = [line for line in svg.iter("{http://www.w3.org/2000/svg}polyline") if line.get("class") == "loss"]
    assert [len(line.get("points").split()) for line in losses] == [3, 2]
    assert losses[0].get("points").split()[1] == losses[1].get("points").split()[1]  # torchft's step 2: 4.0
    assert int(svg.get("height")) == 2 * int(ElementTree.fromstring(draw({**report, "results": {
        "torchft": {**report["results"]["torchft"], "losses": []}}})).get("height"))


def test_the_gpt_runs_only_where_its_script_does():
    """The peers and plain torchrun train an MLP script of their own: with the GPT they are refused
    before anything starts."""
    done = subprocess.run([sys.executable, "scripts/bench_goodput.py", "--workload", "gpt",
                           "--approaches", "fault_free,torchrevive_in_process,torchft"],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--workload gpt: torchft train(s) the MLP only; leave them out" in done.stderr
