"""End to end through the real `torchrevive run`: real agents, real c10d rendezvous on
127.0.0.1, real workers training examples/train.py over gloo."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml
from conftest import (
    REPO,
    STEADY_WORKER,
    TORCHREVIVE,
    free_port,
    start_torchrevive,
    stop_steady_job,
    wait_until,
    workers_ready,
)
from torch.distributed import run as torchrun

from agent.events import read_events

pytestmark = pytest.mark.e2e
TIMEOUT_S = 180


def run_nodes(nodes: int, args: list[str]) -> list[tuple[int, str]]:
    procs = [start_torchrevive(["run", *args]) for _ in range(nodes)]
    results = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, out))
    return results


def steps_logged(output: str) -> list[tuple[int, int]]:
    return [(int(s), int(w)) for s, w in re.findall(r"step=(\d+) loss=\S+ world_size=(\d+)", output)]


def elastic_args(endpoint: str, *extra: str) -> list[str]:
    return [
        "--nnodes", "2:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
        "--rdzv-id", f"e2e-{uuid.uuid4().hex[:8]}", "--rdzv-conf", "join_timeout=60,last_call_timeout=1", "--monitor-interval", "0.2",
        *extra,
    ]


def test_two_agents_train_at_world_size_two(rdzv_endpoint):
    results = run_nodes(2, [*elastic_args(rdzv_endpoint), "examples/train.py", "--steps", "4"])
    assert [code for code, _ in results] == [0, 0], results
    logged = steps_logged("".join(out for _, out in results))
    assert logged == [(1, 2), (2, 2), (3, 2), (4, 2)]


def test_crashed_worker_is_restarted_by_its_agent():
    # One agent, two workers: the agent restarts its whole worker group after rank 0 fails.
    args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "--monitor-interval", "0.2",
            "examples/train.py", "--steps", "4", "--crash-at-step", "2"]
    [(code, output)] = run_nodes(1, args)
    assert code == 0, output
    assert "injected failure at step 2 (--crash-at-step)" in output
    assert "world_size=2 restart=0" in output and "world_size=2 restart=1" in output
    assert steps_logged(output)[-1] == (4, 2)


def test_two_nodes_resume_after_a_worker_crash(rdzv_endpoint):
    # Each round's workers get a fresh store: stale peer addresses from the failed round would
    # make the new round's gloo init fail or hang.
    args = [*elastic_args(rdzv_endpoint, "--max-restarts", "2"), "examples/train.py", "--steps", "4", "--crash-at-step", "2"]
    results = run_nodes(2, args)
    assert [code for code, _ in results] == [0, 0], results
    output = "".join(out for _, out in results)
    assert "injected failure at step 2 (--crash-at-step)" in output
    assert len(re.findall(r"world_size=2 restart=\d", output)) == 2  # workers started twice
    assert steps_logged(output)[-1] == (4, 2)


def test_exhausted_restarts_exit_nonzero_with_torchruns_summary(rdzv_endpoint):
    args = ["--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "examples/train.py", "--steps", "3", "--crash-at-step", "1"]
    [(code, output)] = run_nodes(1, args)
    assert code == 1
    assert "examples/train.py FAILED" in output
    assert "Root Cause (first observed failure)" in output
    assert "injected failure at step 1" in output


def worker_files(log_dir: Path) -> dict[str, str]:
    """torchrun's per-attempt, per-rank files under ``log_dir`` (its run id's folder left out), and
    their text with PIDs, times and addresses masked."""
    files = {}
    for path in sorted(log_dir.rglob("*")):
        if path.is_file():
            text = re.sub(r"\b\d{4,}\b|\d+\.\d+", "N", path.read_text())
            files[str(path.relative_to(log_dir)).split("/", 1)[1]] = text
    return files


def test_worker_logs_redirects_tee_exit_codes_and_error_files_as_torchrun(tmp_path):
    # Two workers, rank 0 fails at step 2, one restart; every rank's output redirected to files in
    # --log-dir, rank 0's tee'd to the agent's output: the same files, contents, error files and
    # output whether workers are forked warm or spawned as torchrun spawns them.
    seen = {}
    for warm in (True, False):
        out = tmp_path / str(warm)
        args = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.2",
                "--log-dir", str(out / "logs"), "--redirects", "3", "--tee", "3", "--local-ranks-filter", "0",
                "--set", f"launch.warm_workers={str(warm).lower()}", "--set", f"observability.event_log={out / 'events'}",
                "examples/train.py", "--steps", "3", "--crash-at-step", "2", "--samples", "256", "--width", "64"]
        [(code, output)] = run_nodes(1, args)
        assert code == 0, output
        started = [e for e in read_events(out / "events") if e["event"] == "workers_started"]
        assert [e["start"] for e in started] == ["warm" if warm else "spawn"] * 2, started
        seen[warm] = worker_files(out / "logs"), sorted(line for line in output.splitlines() if line.startswith("[default"))
    (warm_files, warm_tee), (spawned_files, spawned_tee) = seen[True], seen[False]
    # Rank 1 of the first attempt fails in a collective when rank 0 dies, or its agent stops it
    # first: whether it writes an error file, and how gloo words its error, is timing.
    by_chance = {name for name in {*warm_files, *spawned_files} if name.startswith("attempt_0/1/")}
    assert {k: v for k, v in warm_files.items() if k not in by_chance} == {
        k: v for k, v in spawned_files.items() if k not in by_chance}
    assert {"attempt_0/1/stdout.log", "attempt_0/1/stderr.log"} <= warm_files.keys() & spawned_files.keys()
    assert "injected failure at step 2" in warm_files["attempt_0/0/stderr.log"]
    assert "RuntimeError: injected failure at step 2" in warm_files["attempt_0/0/error.json"]
    assert "world_size=2 restart=1" in warm_files["attempt_1/0/stdout.log"] and "step=3" in warm_files["attempt_1/0/stdout.log"]
    assert warm_tee == spawned_tee and any(line.startswith("[default0]:step=3") for line in warm_tee)
    assert not any(line.startswith("[default1]") for line in warm_tee)  # --local-ranks-filter 0


def test_example_config_trains_at_world_size_two_and_resumes(rdzv_endpoint, tmp_path):
    args = ["--config", "configs/local.yaml", "--rdzv-endpoint", rdzv_endpoint, "--set", f"checkpoint.dir={tmp_path}",
            "--set", "checkpoint.interval_steps=2", "examples/train.py", "--fsdp", "--steps"]
    [(code, output)] = run_nodes(1, [*args, "3"])
    assert code == 0, output
    assert "mode=fsdp2" in output
    assert steps_logged(output) == [(1, 2), (2, 2), (3, 2)]
    # the committed snapshot, and the fencing token the round's leader wrote (no partial save left)
    [fence, snapshot] = sorted(p.name for p in tmp_path.iterdir())
    assert re.fullmatch(r"\.torchrevive_round\.\d+", fence) and snapshot == "step_2"
    # A second run resumes from the committed snapshot of step 2, with the same losses.
    [(code, resumed)] = run_nodes(1, [*args, "3"])
    assert code == 0, resumed
    assert "resumed from step 2" in resumed
    assert re.findall(r"step=3 loss=\S+", resumed) == re.findall(r"step=3 loss=\S+", output)


def test_help_lists_every_torchrun_flag():
    out = subprocess.run([*TORCHREVIVE, "run", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    for action in torchrun.get_args_parser()._actions:
        for option in action.option_strings:
            if option.startswith("--") and "_" not in option:
                assert option in out


def test_print_config_shows_the_resolved_job():
    proc = start_torchrevive(["run", "--config", "configs/local.yaml", "--max-restarts", "9", "--print-config"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    resolved = yaml.safe_load(out)
    assert resolved["job"]["max_restarts"] == 9
    assert resolved["rendezvous"]["backend"] == "c10d"


def test_bad_config_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job:\n  nnodes: '3:1'\n")
    proc = start_torchrevive(["run", "--config", str(bad), "examples/train.py"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out.strip() == f"torchrevive run: error: {bad}: job.nnodes: '3:1' has min 3 > max 1; write MIN:MAX with MIN <= MAX"


def test_a_compile_cache_dir_the_agent_cannot_use_stops_the_launch_with_one_line(tmp_path):
    taken = tmp_path / "a-file"
    taken.write_text("")
    proc = start_torchrevive(["run", "--standalone", "--set", f"compile.cache_dir={taken}", "examples/train.py"])
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    [line] = [line for line in out.splitlines() if "error" in line.lower()]
    assert line.startswith(f"torchrevive run: error: compile.cache_dir: cannot keep compile caches in {taken}/inductor"), out
    assert "Traceback" not in out


def test_a_signal_the_agent_handles_is_forwarded_to_the_workers(tmp_path):
    # torchrun --signals-to-handle: the agent turns SIGUSR1 into a shutdown that sends SIGUSR1 to
    # every worker (torch's own path); unhandled, SIGUSR1 would kill the agent and orphan them.
    proc = start_torchrevive(["run", "--standalone", "--nproc-per-node", "2", "--signals-to-handle", "SIGTERM,SIGUSR1",
                              "--monitor-interval", "0.2", STEADY_WORKER, str(tmp_path), "--record-signal", "SIGUSR1"])
    pids = [w["pid"] for w in workers_ready(tmp_path, 2)]
    proc.send_signal(signal.SIGUSR1)
    recorded = [tmp_path / f"signal{rank}" for rank in range(2)]
    deadline = time.monotonic() + TIMEOUT_S  # the stop file must not end a worker before the signal reaches it
    while not all(p.exists() for p in recorded) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    code, output = stop_steady_job(proc, tmp_path, pids, TIMEOUT_S)
    assert [p.read_text() for p in recorded] == ["SIGUSR1", "SIGUSR1"], output
    assert code != 0 and "SignalException" in output  # the agent stops as torchrun's does


def probe(port: int) -> tuple[int, dict] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except OSError:
        return None


def test_the_health_check_answers_on_torchruns_port_through_the_job(tmp_path):
    port = free_port()
    proc = start_torchrevive(["run", "--standalone", "--nproc-per-node", "1", STEADY_WORKER, str(tmp_path)],
                             env={"TORCHELASTIC_HEALTH_CHECK_PORT": str(port)})
    pids = []
    try:
        wait_until(lambda: probe(port), 60, f"a health-check answer on port {port}")
        pids = [w["pid"] for w in workers_ready(tmp_path, 1)]
        status, body = probe(port)
        assert status == 200 and body["alive"] and body["age_s"] < 60
    finally:
        code, output = stop_steady_job(proc, tmp_path, pids, TIMEOUT_S)
    assert code == 0, output
    assert probe(port) is None  # torch's shutdown stops it with the agent


def listening_sockets(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket listening in one of ``pids``, from ss -ltnp."""
    table = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in table.splitlines():
        fields = line.split()
        address, _, port = fields[3].rpartition(":")
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        found += [(address, int(port), pid) for pid in owners & pids]
    return found


def test_every_port_of_a_job_listens_on_the_configured_address_only(tmp_path, rdzv_endpoint):
    # docs/security.md's list of listeners: the agent's c10d store, torch's shared store, the workers' store,
    # metrics and health check, the liveness listener; each worker's gloo listener. All on 127.0.0.1 here,
    # none on *.
    metrics, health = free_port(), free_port()
    proc = start_torchrevive(["run", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                              "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "ports",
                              "--set", f"observability.metrics_port={metrics}", STEADY_WORKER, str(tmp_path)],
                             env={"TORCHELASTIC_HEALTH_CHECK_PORT": str(health)})
    pids = []
    try:
        pids = [w["pid"] for w in workers_ready(tmp_path, 2)]
        sockets = listening_sockets({proc.pid, *pids})
    finally:
        code, output = stop_steady_job(proc, tmp_path, pids, TIMEOUT_S)
    assert code == 0, output
    agent = sorted(port for _, port, pid in sockets if pid == proc.pid)
    assert {int(rdzv_endpoint.rsplit(":", 1)[1]), metrics, health} <= set(agent) and len(agent) == 6, sockets
    assert sorted(pid for _, _, pid in sockets if pid != proc.pid) == sorted(pids), sockets  # one gloo port each
    assert {address for address, _, _ in sockets} == {"127.0.0.1"}, sockets


def test_print_config_redacts_the_etcd_password(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("rendezvous:\n  backend: etcd3\n  endpoint: 127.0.0.1:2379\n  conf:\n    user: root\n"
                   "    password: hunter2\n")
    proc = start_torchrevive(["run", "--config", str(job), "--print-config"])
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "hunter2" not in out and yaml.safe_load(out)["rendezvous"]["conf"]["password"] == "<redacted>"
