"""What an agent reads from the rendezvous store is data, never code, and is validated before use.

* A pickle that would run code, written where the rendezvous state lives (the c10d store's state
  key; etcd's state key with ``heartbeats=state``, etcd's round key with the default layout), makes
  the agent's handler raise RendezvousStateError: torch's ``pickle.loads`` never sees it, and the
  marker file the payload would create is never made.
* The snapshot a round's leader chose is a ``step_<N>`` name each node resolves under its own
  checkpoint dir (or a memory snapshot under its memory directory), the workers' store a host and
  a port: anything else is refused with the key, the value and what to do.
* A node the round moved on without stops waiting for the old round's values (they get deleted),
  and so does one whose round lost a participant before it wrote its part (torch's rank assignment).
"""

from __future__ import annotations

import base64
import pickle
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import REPO, STEADY_WORKER, start_torchrevive
from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from agent.config import JobConfig
from agent.events import read_events
from agent.recovery_agent import RecoveryAgent
from agent.rendezvous import round_values
from agent.rendezvous.etcd3_backend import create_etcd3_handler, options_from
from agent.rendezvous.etcd3_client import Etcd3Connection
from agent.rendezvous.round_keys import RESTORE_FROM_KEY, WORKER_STORE_KEY
from agent.rendezvous.round_values import RoundLeftBehind

sys.path.insert(0, str(REPO / "scripts"))
from harness.etcd_server import EtcdServer, etcd_available  # noqa: E402

AGENT_TIMEOUT_S = 120


class CreatesFile:
    """Unpickled, creates ``path``: what a hostile writer of the store would put there."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def hostile_state(marker: Path) -> bytes:
    return pickle.dumps(CreatesFile(marker))


def test_the_agent_refuses_a_c10d_state_that_would_run_code(store, tmp_path):
    marker = tmp_path / "pwned"
    # Where torch's C10dRendezvousBackend keeps run 'trust''s state: base64 of the pickle.
    store.set("torch.rendezvous.trust", base64.b64encode(hostile_state(marker)).decode())
    proc = start_torchrevive(["run", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", "0",
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store.port}",
                              "--rdzv-id", "trust", "--rdzv-conf", "is_host=false,join_timeout=30",
                              STEADY_WORKER, str(tmp_path)])
    out, _ = proc.communicate(timeout=AGENT_TIMEOUT_S)
    assert proc.returncode != 0, out
    assert "RendezvousStateError" in out and "holds io.open" in out, out
    assert "rendezvous state of run 'trust'" in out, out
    assert not marker.exists(), "the store's pickle ran code in the agent"


@pytest.fixture
def etcd(tmp_path):
    if not etcd_available():
        pytest.skip("no etcd binary (apt-get install etcd-server)")
    with EtcdServer(tmp_path / "etcd-data") as server:
        yield server


@pytest.mark.parametrize(("heartbeats", "key"), [("state", "/torchrevive/rendezvous/run/state"),
                                                 ("keys", "/torchrevive/rendezvous/run/members/round")])
def test_an_etcd3_handler_refuses_a_state_that_would_run_code(etcd, tmp_path, heartbeats, key):
    marker = tmp_path / "pwned"
    params = RendezvousParameters(backend="etcd3", endpoint=etcd.endpoint, run_id="run", min_nodes=1, max_nodes=1,
                                  heartbeats=heartbeats, join_timeout=10)
    connection = Etcd3Connection(options_from(params))
    connection.call(lambda client: client.put(key, hostile_state(marker)))
    handler = create_etcd3_handler(params)
    with pytest.raises(RendezvousStateError, match=f"the etcd key {key} .*holds io.open"):
        handler.next_rendezvous()
    assert not marker.exists(), "etcd's pickle ran code in the agent"


# -- the round's values: read as data, checked -------------------------------------------------------


def agent_on(store: TCPStore, run_id: str, job: JobConfig, tmp_path: Path,
             **settings: float) -> tuple[RecoveryAgent, TCPStore]:
    """A real RecoveryAgent of run ``run_id`` (c10d handler on ``store``, up to two nodes, torch's
    rendezvous ``settings``; no warm workers), and its store client."""
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{store.port}", run_id=run_id,
                                  min_nodes=1, max_nodes=2, **settings)
    client = TCPStore("127.0.0.1", store.port, is_master=False)
    job.launch.warm_workers = False
    spec = WorkerSpec(role="trainer", local_world_size=1, entrypoint=sys.executable, args=("-c", "pass"),
                      rdzv_handler=create_handler(client, C10dRendezvousBackend(client, run_id), params))
    agent = RecoveryAgent(spec=spec, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), job=job,
                          config_path=str(tmp_path / "job.yaml"))
    return agent, client


@pytest.fixture
def follower(store, tmp_path):
    """A real RecoveryAgent (c10d handler on the test's store, no workers started), as a
    non-leader node of round 1: what the test puts in the round's store is what the leader wrote."""
    made = []

    def make(checkpoint_dir: Path | None = None) -> RecoveryAgent:
        job = JobConfig()
        job.checkpoint.dir = None if checkpoint_dir is None else str(checkpoint_dir)
        agent, client = agent_on(store, "trust", job, tmp_path)
        made.append(agent)
        group = agent._worker_group
        group.store, group.group_rank = PrefixStore("torch.rendezvous.trust.1", client), 1
        return agent

    yield make
    for agent in made:
        agent._watch.close()
        agent._liveness.close()


@pytest.fixture
def checkpoint_dir(tmp_path) -> Path:
    root = tmp_path / "ckpt"
    (root / "step_3").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "step_9").symlink_to(tmp_path / "elsewhere")
    return root


@pytest.mark.parametrize("chosen", ["/etc", "../step_3", "step_3/../../elsewhere", "step_3/x", "step_9", "step_x",
                                    'memory:{"snapshot": "r1/step_2", "holders": {}}'])
def test_a_restore_choice_outside_the_checkpoint_dir_is_refused(follower, checkpoint_dir, chosen):
    agent = follower(checkpoint_dir)
    agent._worker_group.store.set(RESTORE_FROM_KEY, chosen)
    refused = rf"rendezvous store's {RESTORE_FROM_KEY} is {re.escape(repr(chosen))}: .*round's leader agent: "
    with pytest.raises(RendezvousStateError, match=refused):
        agent._agree_on_snapshot(agent._worker_group)
    assert agent._restore_from == ""


def test_a_restore_choice_is_a_snapshot_name_resolved_under_each_nodes_own_dir(follower, checkpoint_dir):
    agent = follower(checkpoint_dir)
    agent._worker_group.store.set(RESTORE_FROM_KEY, "step_3")
    assert agent._agree_on_snapshot(agent._worker_group) == str(checkpoint_dir / "step_3")
    agent._worker_group.store.set(RESTORE_FROM_KEY, "")
    assert agent._agree_on_snapshot(agent._worker_group) == ""


@pytest.mark.parametrize("published", ["127.0.0.1", "127.0.0.1 0", "127.0.0.1 65536", "127.0.0.1 80 x",
                                       "$(touch x) 80", "../x 80", " 80"])
def test_a_worker_store_address_that_is_not_host_and_port_is_refused(follower, published):
    agent = follower()
    group = agent._worker_group
    group.store.set(WORKER_STORE_KEY, published)
    refused = rf"{WORKER_STORE_KEY} is {re.escape(repr(published))}: not 'HOST PORT'"
    with pytest.raises(RendezvousStateError, match=refused):
        agent._serve_fresh_worker_store(group)


def test_a_worker_store_address_is_host_and_port(follower):
    agent = follower()
    group = agent._worker_group
    for published, expected in [("node-1.example 29500", ("node-1.example", 29500)), ("::1 80", ("::1", 80))]:
        group.store.set(WORKER_STORE_KEY, published)
        agent._serve_fresh_worker_store(group)
        assert (group.master_addr, group.master_port) == expected


def test_a_value_the_round_moved_on_from_is_not_waited_for(store):
    round_store = PrefixStore("torch.rendezvous.trust.7", store)
    moved_on = threading.Event()
    threading.Timer(0.5, moved_on.set).start()
    started = time.monotonic()
    with pytest.raises(RoundLeftBehind, match=f"moved on without this node: this node stops waiting for {RESTORE_FROM_KEY}"):
        round_values.wait_for_value(round_store, RESTORE_FROM_KEY,
                                    lambda: "the round moved on without this node" if moved_on.is_set() else None)
    assert time.monotonic() - started < store.timeout.total_seconds() / 2  # not the store's timeout
    threading.Timer(0.2, lambda: round_store.set(RESTORE_FROM_KEY, "step_1")).start()
    assert round_values.wait_for_value(round_store, RESTORE_FROM_KEY, lambda: None) == "step_1"


@pytest.mark.parametrize(("group_rank", "waited_for"), [(0, "torchelastic/role_info/1"),
                                                         (1, "torchelastic/assigned_ranks/1")])
@pytest.mark.parametrize("death", ["connection closed", "heartbeats lapsed"])
def test_the_ranks_assignment_gives_up_on_a_participant_that_died_after_the_round(follower, group_rank, waited_for,
                                                                                  death):
    # torch's own assignment reads these keys with blocking calls: 60 s (the store's timeout) for a
    # participant that died between the round's completion and its write.
    agent = follower()
    group = agent._worker_group
    ledger = agent._executor.ledger
    agent._round_nodes = frozenset({"peer_1_0"})
    ledger.saw({"peer_1_0": time.time()})
    started = time.monotonic()
    threading.Timer(0.3, lambda: ledger.declare_dead("peer_1_0") if death == "connection closed"
                    else ledger.saw({"peer_1_0": time.time() - 100})).start()
    if death == "heartbeats lapsed":
        ledger.heartbeat_timeout = 0.5
    with pytest.raises(RoundLeftBehind, match=f"participant peer_1_0 of the round died after it completed: this "
                                              f"node stops waiting for {waited_for} and joins the next round"):
        agent._assign_worker_ranks(group.store, group_rank, 2, group.spec)
    assert time.monotonic() - started < 5
    assert group.store.check([f"torchelastic/role_info/{group_rank}"])  # its own part was written


DIES_AFTER_THE_ROUND = """import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler
from agent.rendezvous.prompt import PromptOpExecutor
client = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
params = RendezvousParameters(backend="c10d", endpoint="", run_id="dies", min_nodes=1, max_nodes=2,
                              keep_alive_interval=1, keep_alive_max_attempt=3)
handler = create_handler(client, C10dRendezvousBackend(client, "dies"), params)
PromptOpExecutor.install(handler, poll_interval=0.02)  # a torchrevive node's rendezvous
handler.next_rendezvous()
print("in the round", flush=True)
time.sleep(600)
"""


def test_a_node_that_dies_after_the_round_completes_leaves_the_survivor_to_the_next_round(store, tmp_path):
    # A real agent and a node that dies between the round's completion and its part of torch's rank
    # assignment (killed once its rendezvous returned): the agent moves on to a round of its own at
    # once, instead of waiting out the store's timeout (60 s) in torch's blocking read of the dead
    # node's role.
    job = JobConfig()
    job.observability.event_log = str(tmp_path / "events.jsonl")
    agent, _ = agent_on(store, "dies", job, tmp_path, keep_alive_interval=1, keep_alive_max_attempt=3)
    other = subprocess.Popen([sys.executable, "-c", DIES_AFTER_THE_ROUND, str(store.port)], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    try:
        threading.Thread(target=lambda: other.stdout.readline() and other.kill(), daemon=True).start()
        started = time.monotonic()
        agent._rendezvous(agent._worker_group)
        took = time.monotonic() - started
    finally:
        other.kill()
        agent._watch.close()
        agent._liveness.close()
    events = read_events(tmp_path / "events.jsonl")
    (left,) = [e for e in events if e["event"] == "round_left_behind"]
    # The agent is the round's first node (it waited for the other's role) or the second (for the
    # ranks the first was to assign it), as the nodes' names fall.
    assert re.search(r"participant \S+ of the round died after it completed: this node stops waiting for "
                     r"torchelastic/(role_info/1|assigned_ranks/1) and joins the next round", left["error"]), left
    (formed,) = [e for e in events if e["event"] == "rendezvous_done"]
    assert formed["round"] == 1 and formed["world_size"] == 1 and formed["nodes"] == [agent._watch.node]
    assert took < 20, took


def test_the_ranks_are_assigned_when_every_participant_wrote(follower):
    leader, other = follower(), follower()
    leader._round_nodes, other._round_nodes = frozenset({"peer_1_0"}), frozenset({"peer_0_0"})
    for agent in (leader, other):
        agent._executor.ledger.saw({"peer_0_0": time.time(), "peer_1_0": time.time()})
    assigned = {}
    thread = threading.Thread(target=lambda: assigned.update(
        other=other._assign_worker_ranks(other._worker_group.store, 1, 2, other._worker_group.spec)))
    thread.start()
    workers = leader._assign_worker_ranks(leader._worker_group.store, 0, 2, leader._worker_group.spec)
    thread.join(timeout=30)
    assert [(w.global_rank, w.world_size) for w in workers] == [(0, 2)]
    assert [(w.global_rank, w.world_size) for w in assigned["other"]] == [(1, 2)]


# -- a round's keys go once the next round formed ----------------------------------------------------

FAILS_THEN_SUCCEEDS = """import os, sys
sys.exit(1 if int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < int(sys.argv[1]) else 0)
"""


def run_failing_job(tmp_path: Path, backend: str, endpoint: str, run_id: str, failures: int) -> None:
    """A one-node job whose worker fails ``failures`` times (each restart is a new rendezvous round)."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS_THEN_SUCCEEDS)
    conf = "is_host=false,join_timeout=60" if backend == "c10d" else "join_timeout=60"
    proc = start_torchrevive(["run", "--nnodes", "1", "--nproc-per-node", "1", "--max-restarts", str(failures),
                              "--monitor-interval", "0.2", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                              "--rdzv-id", run_id, "--rdzv-conf", conf, "--set", "launch.warm_workers=false",
                              str(script), str(failures)])
    out, _ = proc.communicate(timeout=AGENT_TIMEOUT_S)
    assert proc.returncode == 0, out


def test_the_c10d_store_holds_as_many_keys_after_many_rounds_as_after_two(store, tmp_path):
    grown = []
    for failures in (1, 5):
        before = store.num_keys()
        run_failing_job(tmp_path, "c10d", f"127.0.0.1:{store.port}", f"bounded{failures}", failures)
        grown.append(store.num_keys() - before)
    assert grown[0] == grown[1], f"keys written by a job of 2 rounds, and of 6: {grown}"


@pytest.mark.parametrize("heartbeats", ["keys", "state"])
def test_etcd_holds_as_many_keys_after_many_rounds_as_after_two(etcd, tmp_path, heartbeats):
    connection = Etcd3Connection(options_from(RendezvousParameters(backend="etcd3", endpoint=etcd.endpoint,
                                                                   run_id="x", min_nodes=1, max_nodes=1)))
    held = {}
    for failures in (1, 5):
        run_failing_job(tmp_path, "etcd3", etcd.endpoint, f"bounded{failures}", failures)
        keys = connection.call(lambda c, f=failures: list(c.get_prefix(f"/torchrevive/rendezvous/bounded{f}/",
                                                                       keys_only=True)))
        held[failures] = sorted(meta.key.decode().replace(f"bounded{failures}", "RUN") for _, meta in keys)
    assert len(held[1]) == len(held[5]), held


def test_a_node_the_rendezvous_moved_on_without_stops_waiting_for_its_rounds_keys(follower, store):
    agent = follower()
    # This node completed round 1 (the fixture's); the stored rendezvous is past it (a fresh state:
    # round 0 here), and the round's leader never set the workers' store, or it was deleted since.
    agent._executor._completed_round = 1
    started = time.monotonic()
    with pytest.raises(RoundLeftBehind, match=WORKER_STORE_KEY):
        agent._serve_fresh_worker_store(agent._worker_group)
    assert time.monotonic() - started < store.timeout.total_seconds() / 2


def test_a_state_of_the_right_classes_but_the_wrong_shape_is_refused():
    from agent.rendezvous import round_state
    from agent.torch_private import NodeDesc, RendezvousState

    state = RendezvousState()
    state.participants = {NodeDesc("h", 1, 0): 0}
    assert round_state.decode(pickle.dumps(state), "the key K").participants == state.participants
    state.participants = ["h_1_0"]
    with pytest.raises(RendezvousStateError, match=r"the key K is not a rendezvous state as torch writes it "
                                                   r"\(participants missing or of the wrong type\)"):
        round_state.decode(pickle.dumps(state), "the key K")
    state.participants = {NodeDesc("h", "1", 0): 0}
    with pytest.raises(RendezvousStateError, match="a node whose addr, pid or local_id is of the wrong type"):
        round_state.decode(pickle.dumps(state), "the key K")
