"""The etcd3 backend's heartbeat keys against a real etcd of each tested version: keep-alives
refresh leases and put nothing, a node that leaves by itself is not taken for a lapsed one, the
layout option is checked; and the stored round is read back as data (a pickle of anything else is
refused, not run)."""

from __future__ import annotations

import os
import pickle
import threading
import time
from datetime import datetime, timezone

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from agent.config import ConfigError, JobConfig, validate
from agent.rendezvous import round_state
from agent.rendezvous.etcd3_backend import create_etcd3_handler, heartbeat_layout

import bench_control_plane  # noqa: E402  (scripts/ is on the path through conftest)


def params(endpoint: str, **conf) -> RendezvousParameters:
    return RendezvousParameters(backend="etcd3", endpoint=endpoint, run_id="members", min_nodes=2, max_nodes=2,
                                local_addr="127.0.0.1", keep_alive_interval=1, keep_alive_max_attempt=3,
                                last_call_timeout=1, join_timeout=30, **conf)


def round_revision(handler) -> int:
    return handler._state_holder._backend.get_state()[1]


def test_keep_alives_put_nothing_and_a_leaving_node_is_not_lapsed(etcd):
    first, second = (create_etcd3_handler(params(etcd.endpoint, heartbeats="keys")) for _ in range(2))
    joined = [threading.Thread(target=h.next_rendezvous) for h in (first, second)]
    for thread in joined:
        thread.start()
    for thread in joined:
        thread.join(timeout=60)
    revision = round_revision(first)
    before = bench_control_plane.etcd_metrics(etcd.endpoint)
    time.sleep(3.5)  # three keep-alives of each node, and one heartbeat timeout
    after = bench_control_plane.etcd_metrics(etcd.endpoint)
    assert round_revision(first) == revision == round_revision(second)
    assert after["etcd_mvcc_put_total"] == before["etcd_mvcc_put_total"]
    assert after["etcd_mvcc_txn_total"] == before["etcd_mvcc_txn_total"]
    assert after["grpc_server_msg_received_total"] - before["grpc_server_msg_received_total"] >= 4
    # Both nodes are still there (their leases were kept alive) and each sees the other's heartbeat.
    state = pickle.loads(first._state_holder._backend.get_state()[0])
    assert len(state.participants) == 2 and len(state.last_heartbeats) == 2
    # The second node rejoins by itself: it leaves the round (its key deleted with the round's write).
    threading.Thread(target=second.next_rendezvous, daemon=True).start()
    deadline = time.monotonic() + 10
    while round_revision(first) == revision and time.monotonic() < deadline:
        time.sleep(0.05)
    assert round_revision(first) != revision
    assert first._state_holder._backend.lapsed() == {}
    for handler in (first, second):
        handler._stop_heartbeats()


def test_a_handler_shut_down_stops_refreshing_its_lease(etcd):
    """torch shuts the handler down as the agent ends: its lease's refresher and its members' watch
    end with it, instead of calling etcd for as long as the process lives."""
    handler = create_etcd3_handler(RendezvousParameters(
        backend="etcd3", endpoint=etcd.endpoint, run_id="alone", min_nodes=1, max_nodes=1, local_addr="127.0.0.1",
        keep_alive_interval=1, keep_alive_max_attempt=3, last_call_timeout=1, join_timeout=30))

    def ours() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name in ("torchrevive-etcd3-lease", "torchrevive-etcd3-members")}

    others = ours()  # of handlers earlier tests left running
    handler.next_rendezvous()
    mine = ours() - others
    assert sorted(t.name for t in mine) == ["torchrevive-etcd3-lease", "torchrevive-etcd3-members"]
    assert handler.shutdown() is True
    for thread in mine:
        thread.join(timeout=5)
    assert not any(t.is_alive() for t in mine)


def test_the_heartbeat_layout_option_is_checked():
    assert heartbeat_layout(params("127.0.0.1:1")) == "keys"
    assert heartbeat_layout(params("127.0.0.1:1", heartbeats="keys")) == "keys"
    assert heartbeat_layout(params("127.0.0.1:1", heartbeats="state")) == "state"
    with pytest.raises(ValueError, match="rdzv-conf heartbeats=blob: must be one of keys, state"):
        heartbeat_layout(params("127.0.0.1:1", heartbeats="blob"))
    config = JobConfig()
    config.rendezvous.backend, config.rendezvous.endpoint = "etcd3", "127.0.0.1:2379"
    config.rendezvous.conf = {"heartbeats": "state"}
    validate(config, {})
    config.rendezvous.conf = {"heartbeat": "state"}
    with pytest.raises(ConfigError, match="unknown option 'heartbeat'"):
        validate(config, {})


class Runs:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_a_stored_round_is_data_a_pickle_of_anything_else_is_refused():
    with pytest.raises(RendezvousStateError, match=r"holds posix.system, which a rendezvous state never holds"):
        round_state.decode(pickle.dumps(Runs()))
    with pytest.raises(RendezvousStateError, match="is corrupt"):
        round_state.decode(b"not a pickle")
    with pytest.raises(RendezvousStateError, match="is a dict, not a rendezvous state"):
        round_state.decode(pickle.dumps({}))


def test_rounds_compare_without_heartbeats_and_set_order():
    nodes = [_NodeDesc("h", 1, i) for i in range(3)]
    a, b = _RendezvousState(), _RendezvousState()
    for node in nodes:
        a.wait_list.add(node)
    for node in reversed(nodes):
        b.wait_list.add(node)
    a.last_heartbeats = {nodes[0]: datetime.now(timezone.utc)}
    decoded = round_state.decode(round_state.encode(a))
    assert round_state.same_round(decoded, b)
    round_of_a, heartbeats = round_state.split(decoded)
    assert round_of_a.last_heartbeats == {} and list(heartbeats) == ["h_1_0"]
    b.round += 1
    assert not round_state.same_round(decoded, b)
