"""The etcd3 rendezvous backend against a real etcd (Debian's etcd-server): compare-and-set, lease
expiry, the store, registration with torch (entry point and plain torchrun), and elastic jobs that
lose the node that started first, freeze and thaw, and live through an etcd restart."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, free_port, worker_env
from torch.distributed.elastic.rendezvous import RendezvousParameters

from agent.events import read_events
from agent.rendezvous.etcd3_backend import (
    Etcd3Lease,
    Etcd3RendezvousBackend,
    Etcd3Store,
    options_from,
)
from agent.rendezvous.etcd3_client import Etcd3Connection

sys.path.insert(0, str(REPO / "scripts"))
import local_cluster
from etcd_server import EtcdServer, etcd_available

if not etcd_available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install etcd (Debian's etcd-server): the etcd3 tests never skip in CI")
    pytest.skip("no etcd binary (apt-get install etcd-server)", allow_module_level=True)


@pytest.fixture
def etcd(tmp_path):
    with EtcdServer(tmp_path / "etcd-data") as server:
        yield server


def connect(endpoint: str, **conf) -> Etcd3Connection:
    params = RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id="run", min_nodes=1, max_nodes=1, **conf)
    return Etcd3Connection(options_from(params))


def backend_on(endpoint: str, ttl: int = 30) -> Etcd3RendezvousBackend:
    connection = connect(endpoint)
    return Etcd3RendezvousBackend(connection, "run", prefix="/test", lease=Etcd3Lease(connection, ttl))


def test_compare_and_set_has_one_winner(etcd):
    first, second = backend_on(etcd.endpoint), backend_on(etcd.endpoint)
    assert first.get_state() is None
    won = [first.set_state(b"first"), second.set_state(b"second")]
    assert [w[2] for w in won] == [True, False] and won[1][0] == b"first"
    state, token = second.get_state()
    assert state == b"first"
    assert second.set_state(b"second", token)[2]  # with the current token it wins
    stale = first.set_state(b"stale", token)  # the token is no longer current
    assert stale[2] is False and stale[0] == b"second"


def test_an_abandoned_runs_state_expires_with_its_lease(etcd):
    script = textwrap.dedent(f"""
        import os
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from agent.rendezvous.etcd3_backend import Etcd3Lease, Etcd3RendezvousBackend, options_from
        from agent.rendezvous.etcd3_client import Etcd3Connection
        params = RendezvousParameters(backend="etcd3", endpoint={etcd.endpoint!r}, run_id="run", min_nodes=1,
                                      max_nodes=1)
        connection = Etcd3Connection(options_from(params))
        Etcd3RendezvousBackend(connection, "run", prefix="/test", lease=Etcd3Lease(connection, 2)).set_state(b"state")
        os._exit(0)  # an agent that dies: its lease is never revoked, only no longer refreshed
    """)
    subprocess.run([sys.executable, "-c", script], check=True, env=worker_env(), cwd=REPO, timeout=60)
    watcher = backend_on(etcd.endpoint)
    assert watcher.get_state()[0] == b"state"
    deadline = time.time() + 10
    while watcher.get_state() is not None and time.time() < deadline:
        time.sleep(0.2)
    assert watcher.get_state() is None


def test_a_live_agents_lease_outlasts_its_ttl(etcd, caplog):
    backend = backend_on(etcd.endpoint, ttl=2)
    backend.set_state(b"state")
    time.sleep(5)  # 2.5 TTLs: the background refresh must have kept the lease (and the key) alive
    assert backend.get_state()[0] == b"state"
    assert "refreshing the etcd lease failed" not in caplog.text


def test_store(etcd):
    connection = connect(etcd.endpoint)
    store = Etcd3Store(connection, "/test/store", Etcd3Lease(connection, 30))
    store.set("a", "1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("c", "", "x") == b"x" and store.compare_set("c", "y", "z") == b"x"
    assert store.compare_set("c", "x", "z") == b"z"
    from datetime import timedelta
    with pytest.raises(LookupError, match=r"keys \['never'\] under /test/store/ not set within 1 s"):
        store.wait(["never"], timedelta(seconds=1))


def test_an_unreachable_endpoint_fails_with_one_clear_message():
    port = free_port()
    connection = connect(f"127.0.0.1:{port}", read_timeout=2)
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError
    with pytest.raises(RendezvousConnectionError, match=rf"etcd at 127.0.0.1:{port} unreachable for 2 s"):
        connection.call(lambda c: c.get("/x"))


def test_plain_torchrun_finds_the_backend_by_name(etcd, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import os, pathlib, sys\n"
                      "pathlib.Path(sys.argv[1], 'rank' + os.environ['RANK']).write_text(os.environ['WORLD_SIZE'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=etcd3",
         f"--rdzv-endpoint={etcd.endpoint}", "--rdzv-id=plain", str(script), str(tmp_path)],
        capture_output=True, text=True, env=worker_env(), cwd=REPO, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["2", "2"]


def test_the_entry_point_loads_whichever_torch_module_is_imported_first():
    # torch loads `torchrun.handlers` entry points while its elastic agent module is still being
    # imported; a plugin that imported torchsnapshot (and through it DCP) there failed on a
    # circular import, and torch only logged it and went on without the backend.
    probe = ("import torch.distributed.elastic.agent.server.local_elastic_agent\n"
             "from torch.distributed.elastic.rendezvous.api import rendezvous_handler_registry as registry\n"
             "print(sorted(name for name in ('etcd3', 'etcd-v3') if name in registry._registry))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=worker_env(), cwd=REPO,
                          timeout=60, check=True)
    assert done.stdout.split("\n")[0] == "['etcd-v3', 'etcd3']"
    assert "Exception while registering" not in done.stderr, done.stderr[-2000:]


def harness_args(endpoint: str, **overrides):
    import argparse
    args = {"nodes": 3, "nproc_per_node": 1, "scenario": "kill", "fault_node": 0, "backend": "etcd3",
            "rdzv_endpoint": endpoint, "state_mb": 4, "interval_steps": 5, "timeout": 120}
    args.update(overrides)
    return argparse.Namespace(**args)


def test_losing_the_first_node_a_freeze_and_a_join_on_etcd3(etcd, tmp_path):
    # Node 0 started first: with c10d it hosts the store, and killing it ends the job.
    runs = local_cluster.run_scenarios(harness_args(etcd.endpoint, scenario="kill,freeze,join"), tmp_path)
    kill, freeze, join = runs
    assert (kill["world_size_before"], kill["world_size_after"]) == (3, 2)
    # The frozen node is dropped, then thawed: it rejoins (2 nodes again), and a new node makes 3.
    assert freeze["world_size_after"] == 1 and freeze["restored_step"] > kill["restored_step"]
    assert (join["cause"], join["world_size_before"], join["world_size_after"]) == ("node_joined", 2, 3)


def test_an_etcd_restart_during_training_changes_nothing(etcd, tmp_path):
    cluster = local_cluster.Cluster(harness_args(etcd.endpoint, nodes=2), tmp_path)
    try:
        cluster.start(0)
        cluster.start(1)
        cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "save_committed"], 120, "a committed snapshot")
        etcd.stop()
        time.sleep(4.0)  # longer than the heartbeat timeout (1 s x 3): every heartbeat in etcd goes stale
        etcd.start()
        restarted = time.time()
        cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "save_committed" and e["time"] > restarted + 2],
                         120, "training after the etcd restart")
    finally:
        cluster.stop()
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "membership_change"]
