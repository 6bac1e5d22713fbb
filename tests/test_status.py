"""`torchrevive status` against real jobs: `torchrevive run` agents on a c10d rendezvous and on
etcd3, steady workers, a real committed snapshot in the checkpoint dir; and against an endpoint
where nothing listens."""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import os
import pickle
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    REPO,
    STEADY_WORKER,
    TORCHREVIVE,
    free_port,
    only_etcd_3_4,
    start_torchrevive,
    stop_steady_job,
    worker_env,
    workers_ready,
)
from torch import nn
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from agent import torch_private
from agent.checkpoint.checkpointer import Checkpointer
from agent.config import load_config
from agent.memory.layout import encode_inventory
from agent.rendezvous.round_keys import RESTORE_FROM_KEY
from agent.rendezvous.state_reader import C10dReader
from agent.status import job_status, render
from launcher.status_command import parse_status_args

TIMEOUT_S = 60


def job_config(tmp_path: Path, backend: str, endpoint: str, nnodes: int, **checkpoint: object) -> Path:
    """A job config naming the rendezvous, a checkpoint dir holding a committed step_3, and an event log.
    Heartbeats keep torch's default timeout (15 s): on a busy machine a shorter one loses nodes that live."""
    torch.manual_seed(0)
    Checkpointer(tmp_path / "ckpt", staging=False).save(3, {"model": nn.Linear(4, 4)})
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "job": {"id": f"status-{uuid.uuid4().hex[:8]}", "nnodes": f"{nnodes}:{nnodes}", "nproc_per_node": 1,
                "monitor_interval": 0.2},
        "rendezvous": {"backend": backend, "endpoint": endpoint,
                       "conf": {"join_timeout": "60s", "last_call_timeout": "1s"}},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), **checkpoint},
        "observability": {"event_log": str(tmp_path / "events.jsonl")},
    }))
    return config


def status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHREVIVE, "status", *args], cwd=REPO, env=worker_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)


@contextlib.contextmanager
def running_job(config: Path, nodes: int, out: Path) -> Iterator[list[subprocess.Popen]]:
    """``nodes`` agents of the job training steady workers, stopped at the end (killed if they never got ready)."""
    out.mkdir()
    procs = [start_torchrevive(["run", "--config", str(config), STEADY_WORKER, str(out)]) for _ in range(nodes)]
    pids: list[int] = []
    try:
        pids = [w["pid"] for w in workers_ready(out, nodes, timeout=TIMEOUT_S)]
        yield procs
    finally:
        for proc in procs:
            if not pids:
                proc.kill()
            stop_steady_job(proc, out, pids, TIMEOUT_S)


@pytest.mark.e2e
def test_status_of_a_running_c10d_job(tmp_path):
    config = job_config(tmp_path, "c10d", f"127.0.0.1:{free_port()}", nnodes=2)
    with running_job(config, 2, tmp_path / "out") as procs:
        done = status("--config", str(config), "--json")
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        text = status("--config", str(config))
        watch = subprocess.Popen([*TORCHREVIVE, "status", "--config", str(config), "--json", "--watch", "0.2"],
                                 cwd=REPO, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            refreshes = [json.loads(watch.stdout.readline()) for _ in range(2)]
            watch.send_signal(signal.SIGINT)
            _, errors = watch.communicate(timeout=TIMEOUT_S)  # reads on: a full pipe would block it
            assert watch.returncode == 0, errors  # Ctrl-C ends the watch, and is no error
        finally:
            watch.kill()
    rdzv = found["rendezvous"]
    assert (rdzv["round"], rdzv["complete"], rdzv["waiting"], rdzv["spares"]) == (0, True, [], [])
    members = rdzv["members"]
    assert [(m["group_rank"], m["role"]) for m in members] == [(0, "training"), (1, "training")]
    assert sorted(m["pid"] for m in members) == sorted(p.pid for p in procs)  # each agent's own process
    assert all(m["name"] == f"{m['addr']}_{m['pid']}_0" and m["addr"] for m in members)
    assert all(0 <= m["heartbeat_age_s"] < rdzv["heartbeat_timeout_s"] for m in members)
    assert found["restored"] == {"tier": "storage", "snapshot": "step_3"}
    assert found["storage"]["newest"]["step"] == 3
    assert found["memory"] == {"published": 0, "malformed": 0, "newest": None}  # the memory tier is off
    assert found["recoveries"]["rounds"] == 1 and found["recoveries"]["last"] == []
    assert "round 0 (complete): 2 members, 0 waiting, 0 spare" in text.stdout
    assert "restored: step_3 (storage)" in text.stdout and "storage: newest committed step_3" in text.stdout
    assert "memory: nothing published in the rendezvous for round 0" in text.stdout
    assert [r["rendezvous"]["round"] for r in refreshes] == [0, 0] and refreshes[1]["time"] > refreshes[0]["time"]


@pytest.mark.e2e
@only_etcd_3_4
def test_status_of_a_running_etcd3_job(tmp_path, etcd):
    # The memory tier on: the agent publishes its (empty) memory inventory in the round's store.
    config = job_config(tmp_path, "etcd3", etcd.endpoint, nnodes=1, memory_interval_steps=1000,
                        memory_dir=str(tmp_path / "shm"))
    with running_job(config, 1, tmp_path / "out") as procs:
        done = status("--config", str(config), "--json")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    rdzv = found["rendezvous"]
    assert (rdzv["round"], rdzv["complete"], len(rdzv["members"])) == (0, True, 1)
    assert rdzv["members"][0]["pid"] == procs[0].pid and rdzv["members"][0]["heartbeat_live"] is True
    assert found["restored"] == {"tier": "storage", "snapshot": "step_3"}
    assert found["memory"] == {"published": 1, "malformed": 0, "newest": None}  # no memory snapshot saved yet


@pytest.mark.parametrize("backend", ["c10d", "etcd3"])
def test_nothing_listening_is_one_clear_error(backend):
    endpoint = f"127.0.0.1:{free_port()}"
    done = status("--rdzv-backend", backend, "--rdzv-endpoint", endpoint, "--rdzv-id", "job", "--timeout", "1")
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("torchrevive status: error: ") and endpoint in done.stderr
    assert ("--rdzv-endpoint" in done.stderr) and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_job_is_named_as_for_run(tmp_path):
    args, job = parse_status_args(["--rdzv-backend", "etcd3", "--rdzv-endpoint", "h:2379", "--rdzv-id", "j",
                                   "--rdzv-conf", "key_prefix=/p", "--watch", "2"])
    assert (job.rendezvous.backend, job.rendezvous.endpoint, job.job.id, job.rendezvous.conf["key_prefix"]) == \
        ("etcd3", "h:2379", "j", "/p")
    assert args.watch == 2 and not args.json
    config = job_config(tmp_path, "c10d", "127.0.0.1:1234", nnodes=2)
    _, job = parse_status_args(["--config", str(config), "--json"])
    assert (job.rendezvous.endpoint, job.checkpoint.dir) == ("127.0.0.1:1234", str(tmp_path / "ckpt"))
    for argv, why in ((["--standalone"], "--rdzv-endpoint"), (["--config", str(config), "train.py"], "train.py"),
                      (["--rdzv-endpoint", "h:1"], "'static' keeps no state")):
        done = status(*argv)
        assert done.returncode == 2 and why in done.stderr and done.stderr.startswith("torchrevive status: error: ")


def test_what_the_store_holds_is_checked_before_it_is_shown(store, tmp_path):
    """Values in the rendezvous store are data from the network: a crafted state runs nothing, and a
    crafted restore choice or inventory is shown as unreadable, never as what it claims."""
    run, node = "job", torch_private.NodeDesc("10.0.0.7\x1b[2J", 4242, 0)
    state = torch_private.RendezvousState()
    state.round, state.complete, state.participants = 3, True, {node: 0}
    state.last_heartbeats = {node: datetime.datetime.now(datetime.timezone.utc)}
    store.set(f"torch.rendezvous.{run}", base64.b64encode(pickle.dumps(state)))
    complete = {"0/a": 10, ".torchrevive_checksums.json": 3, ".torchrevive_commit": 2}
    store.set("torchrevive/memory/3/inventory/0", encode_inventory(
        {"r2/step_40": {"files": complete, "complete": complete, "run": run},
         "r2/step_50": {"files": complete, "complete": complete, "run": "another run"}}))
    store.set(torch_private.run_round_key(run, 3, RESTORE_FROM_KEY), "../../etc/passwd")
    job = load_config(None)
    job.job.id = run
    job.observability.event_log = str(REPO / "tests" / "data" / "events_gpt_in_process_mesh_defect.jsonl")
    reader = C10dReader(f"127.0.0.1:{store.port}", run, timeout_s=5)
    found = job_status(job, reader)
    # The last recoveries as `torchrevive report` tells them (the job's own log, here a real one's).
    assert [r["cause"] for r in found["recoveries"]["last"]] == ["worker_failed", "worker_failed", "node_lost"]
    assert "recoveries: last 3 of 7 (7 rounds)" in render(found)
    assert "node_lost: not completed when the log ends" in render(found)
    assert [(m["addr"], m["pid"], m["group_rank"]) for m in found["rendezvous"]["members"]] == \
        [("10.0.0.7\x1b[2J", 4242, 0)]
    assert "10.0.0.7\\x1b[2J" in render(found) and "\x1b" not in render(found)  # no terminal escape gets through
    assert found["memory"] == {"published": 1, "malformed": 0, "newest": "r2/step_40"}  # only its own run's
    assert found["restored"] == {"tier": "unreadable", "snapshot": None}
    assert "not a snapshot name" in render(found) and "passwd" not in render(found)
    store.set(torch_private.run_round_key(run, 3, RESTORE_FROM_KEY), "memory:" + json.dumps({"snapshot": "r2/step_40",
                                                                                 "holders": {"0/a": 0}}))
    store.set("torchrevive/memory/3/inventory/0", "zlib+b64:!!")
    found = job_status(job, reader)
    assert found["restored"] == {"tier": "memory", "snapshot": "r2/step_40"}
    assert found["memory"] == {"published": 0, "malformed": 1, "newest": None}

    planted = tmp_path / "planted"
    store.set(f"torch.rendezvous.{run}", base64.b64encode(pickle.dumps(Planted(planted))))
    with pytest.raises(RendezvousStateError, match="posix.system"):
        job_status(job, reader)
    assert not planted.exists()


class Planted:
    """A pickle that would create a file when plainly unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.path}",)
