"""agent.liveness with real processes: a watched agent killed is declared dead within a moment; one
that ends on purpose, one frozen for a while, one sending what agents never send, and one beyond the
watcher cap are not; an address reached before and no longer listening is dead, one never reached
is not. End to end: survivors of
a killed node see it lost from its closed connection, not from its heartbeats."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from agent.liveness import ADDRESS_KEY, FULL, GOODBYE, MAX_WATCHERS, PeerLiveness, watched_peers
from agent.events import read_events

from conftest import REPO
from test_recovery_e2e import harness_args, local_cluster

PEER = textwrap.dedent("""
    import signal, sys, time
    from torch.distributed import TCPStore
    from agent.liveness import PeerLiveness
    store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False)
    liveness = PeerLiveness("127.0.0.1", on_dead=lambda node, at: None)
    signal.signal(signal.SIGTERM, lambda *_: (liveness.close(), sys.exit(0)))
    liveness.start_round(store, "peer", ["peer", "watcher"])
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")
SILENCE_S = 2.0
"""How long a watcher must stay quiet where no death happened."""


@pytest.fixture
def peer(store):
    """A peer agent's liveness in a process of its own, published in ``store`` as node "peer"."""
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


@pytest.fixture
def watcher(store):
    """This test's agent, watching "peer"; yields the queue its declarations land in."""
    deaths: queue.Queue = queue.Queue()
    liveness = PeerLiveness("127.0.0.1", on_dead=lambda node, at: deaths.put((node, at)))
    liveness.start_round(store, "watcher", ["peer", "watcher"])
    yield deaths, liveness
    liveness.close()


def watching(liveness: PeerLiveness, node: str = "peer") -> None:
    deadline = time.monotonic() + 10
    while node not in liveness._watched:
        assert time.monotonic() < deadline, f"never connected to {node}"
        time.sleep(0.02)


def test_each_node_watches_the_next_ones_in_the_rounds_order():
    nodes = ["d", "a", "c", "b"]
    assert watched_peers("a", nodes) == ["b", "c"]
    assert watched_peers("d", nodes) == ["a", "b"]  # around the ring
    assert watched_peers("a", ["a", "b"]) == ["b"]
    assert watched_peers("a", ["a"]) == [] and watched_peers("x", nodes) == []


def test_a_killed_peer_is_declared_dead_at_once(peer, watcher):
    deaths, liveness = watcher
    watching(liveness)
    killed = time.time()
    peer.kill()
    node, at = deaths.get(timeout=5)
    assert node == "peer" and 0 <= at - killed < 1.0  # the heartbeats would take 3 s


def test_a_peer_that_ends_on_purpose_is_not_declared(peer, watcher):
    deaths, liveness = watcher
    watching(liveness)
    peer.send_signal(signal.SIGTERM)  # its agent closes: goodbye first
    assert peer.wait(timeout=10) == 0
    with pytest.raises(queue.Empty):
        deaths.get(timeout=SILENCE_S)


def test_a_frozen_peer_is_not_declared_and_is_still_watched(peer, watcher):
    deaths, liveness = watcher
    watching(liveness)
    peer.send_signal(signal.SIGSTOP)  # as slow as a node gets: its kernel keeps the connection
    with pytest.raises(queue.Empty):
        deaths.get(timeout=SILENCE_S)
    peer.send_signal(signal.SIGCONT)
    peer.kill()
    assert deaths.get(timeout=5)[0] == "peer"


def a_peer_sends_and_ends(store, watcher, data: bytes) -> None:
    """A stand-in peer published as "peer" that, once watched, sends ``data`` and closes: the
    watcher must not declare it dead for that."""
    deaths, liveness = watcher
    with socket.create_server(("127.0.0.1", 0)) as server:
        store.set(ADDRESS_KEY.format(node="peer"), f"127.0.0.1:{server.getsockname()[1]}")
        connection, _ = server.accept()
        watching(liveness)
        connection.sendall(data)
        connection.close()
        with pytest.raises(queue.Empty):
            deaths.get(timeout=SILENCE_S)


def test_an_address_reached_before_that_no_longer_listens_is_dead(store, watcher):
    deaths, liveness = watcher
    a_peer_sends_and_ends(store, watcher, GOODBYE)  # it leaves the round on purpose: not declared
    liveness.start_round(store, "watcher", ["peer", "watcher"])  # the next round: nothing listens there now
    assert deaths.get(timeout=5)[0] == "peer"


def test_a_refused_address_never_reached_is_not_declared(store, watcher):
    # A hostname that resolves to a loopback address is published as one, and refused by every
    # other host's loopback: its heartbeats must tell, not the refusal.
    deaths, liveness = watcher
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    store.set(ADDRESS_KEY.format(node="peer"), f"127.0.0.1:{port}")
    with pytest.raises(queue.Empty):
        deaths.get(timeout=SILENCE_S)


def test_a_peer_that_sends_what_agents_never_send_is_not_declared(store, watcher):
    a_peer_sends_and_ends(store, watcher, b"hello")
    assert "peer" not in watcher[1]._watched


def test_watchers_beyond_the_cap_are_told_so_and_do_not_declare(store, watcher):
    deaths, liveness = watcher
    strangers = [socket.create_connection(("127.0.0.1", int(liveness.address.rsplit(":", 1)[1])))
                 for _ in range(MAX_WATCHERS)]
    try:
        for stranger in strangers:  # a stranger gets nothing from a listener
            stranger.settimeout(0.01)
            with pytest.raises(socket.timeout):
                stranger.recv(1)
        late = PeerLiveness("127.0.0.1", on_dead=lambda node, at: deaths.put((node, at)))
        late.start_round(store, "late", ["late", "watcher"])
        with pytest.raises(queue.Empty):
            deaths.get(timeout=SILENCE_S)
        assert "watcher" not in late._watched
        late.close()
        probe = socket.create_connection(("127.0.0.1", int(liveness.address.rsplit(":", 1)[1])))
        assert probe.recv(1) == FULL
        probe.close()
    finally:
        for stranger in strangers:
            stranger.close()


def test_survivors_see_a_killed_node_lost_from_its_closed_connection(tmp_path):
    runs = local_cluster.run_scenarios(harness_args(scenario="kill"), tmp_path)
    assert runs[0]["cause"] == "node_lost" and (runs[0]["world_size_before"], runs[0]["world_size_after"]) == (3, 2)
    losses = [e for e in read_events(tmp_path / "events.jsonl")
              if e["event"] == "membership_change" and e["cause"] == "node_lost"]
    # The killed node's loss; the harness then kills the other nodes too, which a survivor may see.
    changes = [e for e in losses if e["lost"] == losses[0]["lost"]]
    assert len(changes) == 2 and all(change["by_connection"] for change in changes), changes
    assert len({change["node"] for change in changes}) == 2  # each survivor watches it (the next two are watched)
