"""In-process recovery (elastic.in_process) end to end: real agents on 127.0.0.1 (gloo), faults
injected by the harness. Survivors keep their worker processes and heal the DDP state from the
newest step a live rank holds; a joining node's new worker heals from a peer; a node whose own
worker died restarts it (the fallback), and the round still agrees on one step."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import REPO, start_torchrevive, wait_until
from test_recovery_e2e import assert_trained_as_without_faults, harness_args, train_through

from agent.events import read_events
from agent.recovery_timeline import recovery_after

sys.path.insert(0, str(REPO / "scripts"))
from harness.scenarios import run_scenarios


def worker_pids(events: list[dict], before: float | None = None, after: float | None = None) -> dict[int, int]:
    """Each rank's worker pid, from the steps' saves it recorded in the window."""
    return {e["rank"]: e["pid"] for e in events if e["event"] in ("save_started", "first_step_done")
            and (before is None or e["time"] < before) and (after is None or e["time"] > after)}


def test_the_survivors_of_a_node_loss_keep_their_processes_and_lose_nothing(tmp_path):
    """3 -> 2 ranks in-process: the survivors' workers go on in the same processes from the step
    they held (no step lost, no restore from storage), and the job sees the same samples per step
    and ends with the same model as one rank trained without faults."""
    faulty, reference = tmp_path / "faulty", tmp_path / "reference"
    faulty.mkdir()
    killed_at = train_through("kill", faulty, in_process=True)
    events = read_events(faulty / "events.jsonl")
    recovery = recovery_after(events, killed_at, failed_at=killed_at)
    assert recovery is not None and recovery["path"] == "in_process", recovery
    assert recovery["restore_source"] == "in_process" and recovery["bytes_from_storage"] == 0, recovery
    before, after = worker_pids(events, before=killed_at), worker_pids(events, after=killed_at)
    assert set(after.values()) <= set(before.values()), (before, after)  # no new worker process
    # The last step started at 3 ranks (its samples are logged before its collectives) is the one
    # the kill struck: the survivors go on from it when one of them completed it, else from the one
    # before, the newest they all hold. Either way no completed step is lost or trained twice (below).
    last_started = max(e["step"] for e in read_events(faulty / "samples.jsonl") if e["world_size"] == 3)
    assert recovery["restored_step"] in (last_started - 1, last_started), (recovery, last_started)
    assert_trained_as_without_faults(faulty, reference)


JOIN_WIDTH = 1024


def test_a_joining_node_heals_from_a_peer_and_the_job_trains_as_without_faults(tmp_path):
    """2 -> 3 ranks in-process: the survivors finish the step in flight (a join loses nobody), the
    new node's worker receives their state (nothing from storage), and the job sees the same
    samples per step and ends with the same model as one rank trained without faults: the healed
    parameters, optimizer moments and data position are those of the step the others held."""
    faulty, reference = tmp_path / "faulty", tmp_path / "reference"
    faulty.mkdir()
    # Wide enough that the job is still at its first 300 steps when the new node has started.
    joined_at = train_through("join", faulty, JOIN_WIDTH, in_process=True)
    events = read_events(faulty / "events.jsonl")
    healed = [e for e in events if e["event"] == "restore_done" and e["time"] > joined_at]
    assert healed and {e["source"] for e in healed} <= {"peer", "in_process"}, healed
    assert any(e["source"] == "peer" and e["bytes"] > 0 for e in healed), healed
    # The first survivor to see the join ends its round at a step's end (its steps take far less
    # than the time allowed); a peer already in its next step then fails in it and holds the same step.
    left = [e for e in events if e["event"] == "workers_stopped" and e["time"] > joined_at and e["path"] == "in_process"]
    assert any("at the end of step" in reason for e in left for reason in e["reasons"]), left
    # Their state heals the round from memory: their agents read nothing of the snapshot ahead.
    survivors = {e["node"] for e in left}
    read_ahead = [e for e in events if e["event"] == "prefetch_done" and e["time"] > joined_at and e["node"] in survivors]
    assert survivors and not read_ahead, read_ahead
    assert max(e["world_size"] for e in read_events(faulty / "samples.jsonl")) == 3
    assert_trained_as_without_faults(faulty, reference, JOIN_WIDTH)


def test_a_join_a_freeze_a_worker_crash_and_a_kill_during_the_reformation_in_process(tmp_path):
    join, freeze, crash, during = run_scenarios(
        harness_args(scenario="join,freeze,kill-worker,kill-during-restore", in_process=True), tmp_path)
    # The new node's worker heals from a live peer: nothing is read from storage.
    assert (join["cause"], join["world_size_after"], join["path"]) == ("node_joined", 3, "in_process"), join
    assert join["bytes_from_storage"] == 0, join
    # The frozen node's peers are blocked in a collective with it: cutting their connections frees them.
    assert (freeze["cause"], freeze["path"], freeze["world_size_after"]) == ("node_lost", "in_process", 2), freeze
    # The node whose worker died restarts it; its new worker heals from a survivor's memory.
    assert crash["path"] == "restart" and crash["fallback_reason"] == "a worker process ended", crash
    assert crash["bytes_from_storage"] == 0, crash
    # A second node killed while the survivors re-form: they leave that round too and go on alone,
    # or, where a worker cannot be freed in time, its node restarts it after the deadline.
    assert during["world_size_after"] == 1, during
    assert during["path"] == "in_process" or "elastic.in_process_deadline" in during["fallback_reason"], during
    events = read_events(tmp_path / "events.jsonl")
    fallbacks = [e["reason"] for e in events if e["event"] == "in_process_fallback"]
    assert all(r == "a worker process ended" or "elastic.in_process_deadline" in r for r in fallbacks), fallbacks
    # The joined node's and the restarted worker's state came from survivors (the others held it).
    healed = [e for e in events if e["event"] == "restore_done" and e["source"] == "peer"]
    assert len(healed) >= 2 and all(e["bytes"] > 0 for e in healed), healed
    restores = [e for e in events if e["event"] == "restore_done"]
    assert {e["source"] for e in restores if e["time"] < during["fault_at"]} <= {"peer", "in_process"}, restores
    # The last node alone: it goes on from its own memory, or, restarted after the deadline, holds
    # no live peer's state and reads the latest commit.
    assert during["restore_source"] == ("in_process" if during["path"] == "in_process" else "storage"), during


def two_node_script(setup: str, first_round: str = "", run_args: str = "") -> str:
    """A training script for the two-node tests below: ``setup`` at module level, ``first_round``
    run as a round begins; each step all-reduces a stop flag (the test touches ``stop``) and writes
    the world size it trains at to ``world<rank>``."""
    return f"""
import gc, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
import agent

out = Path(sys.argv[1])
{setup}

def train(round):
    ctx, step = round.context, round.held_step or 0
    {first_round}
    while True:
        flag = torch.tensor([float((out / "stop").exists())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        step += 1
        (out / f"world{{ctx.rank}}").write_text(str(ctx.world_size))
        round.step_done(step)
        time.sleep(0.05)
    dist.barrier()
    os._exit(0)  # no teardown: gloo's destructors can abort when peers exit at once

agent.run_resilient(train{run_args})
"""


def train_on_two_nodes(tmp_path: Path, rdzv_endpoint: str, script: str, *options: str) -> tuple[list[str], list[dict]]:
    """Start ``script`` on one node, then on a second; once both train at world size 2, stop
    them. Their outputs (each must end with exit code 0) and the job's events."""
    (tmp_path / "train.py").write_text(script)
    events = tmp_path / "events.jsonl"
    args = ["run", "--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            rdzv_endpoint, "--rdzv-id", tmp_path.name, "--rdzv-conf", "join_timeout=60,last_call_timeout=1",
            "--monitor-interval", "0.2", "--set", "elastic.in_process=true", "--set",
            f"observability.event_log={events}", *options, str(tmp_path / "train.py"), str(tmp_path)]
    first = start_torchrevive(args)
    try:
        wait_until(while_running(first, lambda: (tmp_path / "world0").exists()), 120, "training on the first node")
        second = start_torchrevive(args)
        try:
            wait_until(while_running(first, lambda: all((tmp_path / f"world{r}").exists()
                                                        and (tmp_path / f"world{r}").read_text() == "2" for r in (0, 1))),
                       120, "training of both nodes at world size 2")
            (tmp_path / "stop").touch()
            outputs = [proc.communicate(timeout=60)[0] for proc in (first, second)]
            assert [first.returncode, second.returncode] == [0, 0], outputs
        finally:
            second.kill()
    finally:
        first.kill()
    return outputs, read_events(events)


def test_a_rehearsal_that_fails_lets_the_node_join_with_new_workers(tmp_path, rdzv_endpoint):
    """The joining node's warm-up raises: its rehearsal ends, its workers are stopped, and it joins
    the job as without a rehearsal (new workers); the job goes on at world size 2."""
    failing_warmup = two_node_script("def warmup(round):\n    raise RuntimeError('this warm-up fails')\n",
                                     run_args=", warmup=warmup")
    outputs, recorded = train_on_two_nodes(tmp_path, rdzv_endpoint, failing_warmup)
    assert "this warm-up fails" in outputs[1]
    [rehearsal] = [e for e in recorded if e["event"] == "rehearsal_done"]
    assert rehearsal["problem"] == "a worker process ended in the rehearsal (local rank 0 exit code 1)", rehearsal
    joined = [e for e in recorded if e["event"] == "workers_started" and e["node"] == rehearsal["node"]]
    assert joined and joined[0]["start"] in ("warm", "spawn"), joined  # started anew, not handed over


STALLS_WHEN_COLLECTED = """
gc.disable()  # the collector runs when run_resilient calls it, between rounds


class StallsWhenCollected:
    def __init__(self):
        self.cycle = self  # freed by the collector alone

    def __del__(self):
        time.sleep(3600)
"""


def test_a_worker_stuck_after_it_left_a_round_is_restarted_and_its_stacks_logged(tmp_path, rdzv_endpoint):
    """The first node's worker leaves its round when a second node joins, then stalls before it
    takes the next one (in a finalizer that the collector runs): after elastic.in_process_deadline
    its agent logs its stacks and restarts it (a worker's failure: one of --max-restarts), and the job
    trains at world size 2."""
    stalls = two_node_script(STALLS_WHEN_COLLECTED, first_round="if round.number == 0 and ctx.world_size == 1:\n"
                                                                 "        StallsWhenCollected()  # the first worker's")
    outputs, recorded = train_on_two_nodes(tmp_path, rdzv_endpoint, stalls, "--max-restarts", "1",
                                           "--set", "elastic.in_process_deadline=3")
    fallbacks = [e["reason"] for e in recorded if e["event"] == "in_process_fallback"]
    assert any("did not take round" in r and "elastic.in_process_deadline" in r for r in fallbacks), fallbacks
    assert "in __del__" in outputs[0]  # where it stalled, from its stacks


def while_running(proc, condition):
    """``condition``, which fails at once with ``proc``'s output if ``proc`` has ended."""
    def check():
        assert proc.poll() is None, f"the job ended: {proc.communicate()[0][-3000:]}"
        return condition()
    return check
