"""Workers live no longer than their agent, through the real `torchrevive run`, with workers
forked warm and spawned: a SIGKILLed agent leaves no worker (nor warm process) behind; the
agent's own environment is not touched to hand a round its variables, which the workers still
see; orphans the agent adopts are reaped while the round runs, not at the next one."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from conftest import REPO, kill_leftovers, stop_steady_job, wait_until, worker_env

from agent.events import read_events

TIMEOUT_S = 120

WORKER = textwrap.dedent("""
    # Records its pid and TORCHREVIVE_* environment in OUT/worker<RANK>.json; with --orphan, leaves
    # a child behind (sleeping 3 s, its pid in OUT/orphan<RANK>); then waits for OUT/stop.
    import json, os, subprocess, sys, time
    out, rank = sys.argv[1], os.environ["RANK"]
    if "--orphan" in sys.argv:
        subprocess.run(["sh", "-c", f"sleep 3 & echo $! > {out}/orphan{rank}"], check=True)
    seen = {"pid": os.getpid(), "parent": os.getppid(),
            "env": {k: v for k, v in os.environ.items() if k.startswith("TORCHREVIVE_")}}
    with open(f"{out}/worker{rank}.tmp", "w") as f:
        json.dump(seen, f)
    os.rename(f"{out}/worker{rank}.tmp", f"{out}/worker{rank}.json")
    while not os.path.exists(f"{out}/stop"):
        time.sleep(0.1)
""")

AGENT = textwrap.dedent("""
    # `torchrevive` in this process; at its end, the TORCHREVIVE_* variables of its environment.
    import json, os, sys
    from launcher.cli import main
    try:
        main(sys.argv[1:])
    finally:
        print("AGENT_ENV " + json.dumps(sorted(k for k in os.environ if k.startswith("TORCHREVIVE_"))), flush=True)
""")


def start_job(tmp_path: Path, warm: bool, nproc: int, *worker_args: str) -> subprocess.Popen:
    (tmp_path / "worker.py").write_text(WORKER)
    env = {k: v for k, v in worker_env().items() if not k.startswith("TORCHREVIVE_")}
    return subprocess.Popen(
        [sys.executable, "-c", AGENT, "run", "--standalone", "--nproc-per-node", str(nproc), "--monitor-interval", "0.2",
         "--set", f"launch.warm_workers={str(warm).lower()}", "--set", f"observability.event_log={tmp_path / 'events'}",
         str(tmp_path / "worker.py"), str(tmp_path), *worker_args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def workers_seen(tmp_path: Path, nproc: int) -> list[dict]:
    files = [tmp_path / f"worker{rank}.json" for rank in range(nproc)]
    wait_until(lambda: all(f.exists() for f in files), TIMEOUT_S, f"{nproc} started workers")
    return [json.loads(f.read_text()) for f in files]


def started_as(tmp_path: Path) -> tuple[str, str | None]:
    """How the agent started the round's workers. Its event can come after the workers' own files:
    a spawned worker may run before the agent has recorded that it started it."""

    def started() -> list[dict]:
        return [e for e in read_events(tmp_path / "events") if e["event"] == "workers_started"]

    [event] = wait_until(started, TIMEOUT_S, "the agent's workers_started event")
    return event["start"], event["spawn_reason"]


def gone(pid: int) -> bool:
    """The process exited (a zombie whose new parent has not reaped it yet counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "spawned"])
def test_workers_die_with_their_sigkilled_agent(tmp_path, warm):
    proc = start_job(tmp_path, warm, 2)
    pids = []
    try:
        workers = workers_seen(tmp_path, 2)
        pids = [w["pid"] for w in workers]
        start, reason = started_as(tmp_path)
        assert start == ("warm" if warm else "spawn"), reason
        assert all(w["parent"] == proc.pid for w in workers)
        if warm:
            [started] = [e for e in read_events(tmp_path / "events") if e["event"] == "warm_process_started"]
            pids.append(started["pid"])
        assert not any(gone(pid) for pid in pids)
        proc.kill()
        proc.wait(TIMEOUT_S)
        deadline = time.monotonic() + 10
        while not all(gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [pid for pid in pids if not gone(pid)] == [], "workers outlived their agent"
    finally:
        proc.kill()
        kill_leftovers(pids)


def stop(proc: subprocess.Popen, tmp_path: Path, pids: list[int]) -> str:
    code, output = stop_steady_job(proc, tmp_path, pids, TIMEOUT_S)
    assert code == 0, output
    return output


def agent_environment(output: str) -> list[str]:
    [line] = [line for line in output.splitlines() if line.startswith("AGENT_ENV ")]
    return json.loads(line.removeprefix("AGENT_ENV "))


def test_a_round_reaches_spawned_workers_without_changing_the_agents_environment(tmp_path):
    proc = start_job(tmp_path, False, 1)
    pids = []
    try:
        [worker] = workers_seen(tmp_path, 1)
        pids = [worker["pid"]]
    finally:
        output = stop(proc, tmp_path, pids)
    assert started_as(tmp_path)[0] == "spawn"
    assert worker["env"]["TORCHREVIVE_CONFIG"] and worker["env"]["TORCHREVIVE_ROUND"] == "0"
    assert worker["env"]["TORCHREVIVE_EVENT_LOG"] == str(tmp_path / "events")
    assert agent_environment(output) == []


def test_warm_workers_get_the_round_and_their_orphans_are_reaped_during_it(tmp_path):
    # The worker's shell leaves a `sleep 3` behind: re-parented to the agent (a subreaper), it
    # must be reaped once it exits, while the round goes on.
    proc = start_job(tmp_path, True, 1, "--orphan")
    pids = []
    try:
        [worker] = workers_seen(tmp_path, 1)
        pids = [worker["pid"]]
        orphan = int((tmp_path / "orphan0").read_text())
        assert psutil.Process(orphan).ppid() == proc.pid  # adopted, still sleeping
        wait_until(lambda: not psutil.pid_exists(orphan), 20, f"the exited orphan {orphan} reaped")
        assert proc.poll() is None and not gone(worker["pid"])  # the round went on
    finally:
        output = stop(proc, tmp_path, pids)
    assert started_as(tmp_path)[0] == "warm"
    assert worker["env"]["TORCHREVIVE_CONFIG"] and worker["env"]["TORCHREVIVE_ROUND"] == "0"
    assert agent_environment(output) == []


REAPER = textwrap.dedent("""
    # A stand-in agent (a subreaper) with an exited worker (a session leader, as torch spawns one),
    # an exited child of its own, and an exited orphan of a worker: what may be reaped at any time.
    import json, subprocess, time
    from agent.warm_workers import become_subreaper, reap_orphans
    become_subreaper()
    worker = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    own = subprocess.Popen(["sh", "-c", "exit 4"])
    subprocess.run(["sh", "-c", "sleep 0.5 &"], start_new_session=True, check=True)
    time.sleep(2)  # all three exited: zombies of this process
    reaped = reap_orphans()
    print(json.dumps({"reaped": reaped, "codes": [worker.wait(10), own.wait(10)]}))
""")


def test_orphans_are_reaped_at_any_time_but_no_worker_or_child_of_the_agents_own(tmp_path):
    proc = subprocess.run([sys.executable, "-c", REAPER], cwd=tmp_path, env=worker_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report == {"reaped": 1, "codes": [3, 4]}  # the orphan alone; the others keep their exit codes
