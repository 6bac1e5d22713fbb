"""agent.liveness with real processes: a watched agent killed is declared dead within a moment; one
that ends on purpose, one frozen for a while, one sending what agents never send, and one whose
connection is reset while it still listens are not; an address reached before and no longer
listening is dead, one never reached is not; a published address that is not the node's is never
connected to; a flood of idle connections to a peer's listener does not stop its death being seen.
End to end: survivors of a killed node see it lost from its closed connection, not from its
heartbeats."""

from __future__ import annotations

import logging
import queue
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from agent.liveness import (
    ADDRESS_KEY,
    GOODBYE,
    HELLO,
    MAX_UNPROVEN,
    PeerLiveness,
    checked_address,
    watched_peers,
)
from agent.events import read_events

from conftest import REPO
from harness.scenarios import run_scenarios
from test_recovery_e2e import harness_args

PEER = textwrap.dedent("""
    import signal, sys, time
    from torch.distributed import TCPStore
    from agent import listener_limits
    from agent.liveness import PeerLiveness
    listener_limits.HANDSHAKE_TIMEOUT_S = float(sys.argv[2])
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
PEER_HANDSHAKE_TIMEOUT_S = 2.0
"""The peer's deadline for a hello (10 s in a real agent)."""


@pytest.fixture
def peer(store):
    """A peer agent's liveness in a process of its own, published in ``store`` as node "peer"."""
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(store.port), str(PEER_HANDSHAKE_TIMEOUT_S)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
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


def watching(liveness: PeerLiveness, node: str = "peer", timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
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


def test_a_flood_of_idle_connections_does_not_stop_a_death_being_seen(store, peer):
    host, port = checked_address("peer", store.get(ADDRESS_KEY.format(node="peer")).decode())
    flood = [socket.create_connection((host, port)) for _ in range(2 * MAX_UNPROVEN)]  # opened first, held
    deaths: queue.Queue = queue.Queue()
    liveness = PeerLiveness("127.0.0.1", on_dead=lambda node, at: deaths.put((node, at)))
    try:
        liveness.start_round(store, "watcher", ["peer", "watcher"])
        watching(liveness)
        with pytest.raises(queue.Empty):  # refused for now is not dead
            deaths.get(timeout=PEER_HANDSHAKE_TIMEOUT_S + 2 * SILENCE_S)  # by then the flood is cut, the watcher in
        killed = time.time()
        peer.kill()
        node, at = deaths.get(timeout=5)
        assert node == "peer" and 0 <= at - killed < 2.0
    finally:
        liveness.close()
        for sock in flood:
            sock.close()


def reset(connection: socket.socket) -> None:
    """Close ``connection`` with a reset (RST), as a middlebox or a kernel under pressure may."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def test_a_reset_connection_is_dead_only_once_the_peer_no_longer_listens(store, watcher):
    deaths, liveness = watcher
    server = socket.create_server(("127.0.0.1", 0))
    store.set(ADDRESS_KEY.format(node="peer"), f"127.0.0.1:{server.getsockname()[1]}")
    server.settimeout(10)
    first, _ = server.accept()
    first.settimeout(10)
    assert first.recv(64) == HELLO + b"peer\n"
    watching(liveness)
    reset(first)  # the connection goes, the peer still listens: not dead, watched again
    second, _ = server.accept()
    second.settimeout(10)
    assert second.recv(64) == HELLO + b"peer\n"
    with pytest.raises(queue.Empty):
        deaths.get(timeout=SILENCE_S)
    watching(liveness)
    closed = time.time()
    server.close()  # now nothing listens: the reconnect after the reset fails
    reset(second)
    node, at = deaths.get(timeout=5)
    assert node == "peer" and 0 <= at - closed < 1.0


def test_published_addresses_are_checked_before_any_connection():
    assert checked_address("peer", "127.0.0.1:80") == ("127.0.0.1", 80)
    assert checked_address("peer", "[::1]:80") == ("::1", 80)
    assert checked_address("localhost_4242_0", "127.0.0.1:80") == ("127.0.0.1", 80)  # torch's name: addr_pid_localid
    for published, reason in [("127.0.0.1", "not host:port"), ("127.0.0.1:0", "port in 1..65535"),
                              ("127.0.0.1:65536", "port in 1..65535"), ("127.0.0.1:x", "not host:port"),
                              ("evil.example:80", "does not name an IP address"),
                              ("0.0.0.0:80", "not the address of one host"), ("224.0.0.1:80", "not the address")]:
        with pytest.raises(ValueError, match=reason):
            checked_address("peer", published)
    with pytest.raises(ValueError, match=r"'127.0.0.2:80' is not an address of 127.0.0.1, where the rendezvous knows"):
        checked_address("127.0.0.1_4242_0", "127.0.0.2:80")


def test_an_address_that_is_not_the_nodes_is_never_connected_to(store, caplog):
    peer = "127.0.0.1_4242_0"  # the rendezvous knows it at 127.0.0.1; its published address says 127.0.0.2
    elsewhere = socket.create_server(("127.0.0.2", 0))
    elsewhere.settimeout(SILENCE_S)
    store.set(ADDRESS_KEY.format(node=peer), f"127.0.0.2:{elsewhere.getsockname()[1]}")
    liveness = PeerLiveness("127.0.0.1", on_dead=lambda node, at: None)
    try:
        with caplog.at_level(logging.WARNING, logger="agent.liveness"):
            liveness.start_round(store, "watcher", [peer, "watcher"])
            with pytest.raises(socket.timeout):
                elsewhere.accept()
        assert "is not an address of 127.0.0.1, where the rendezvous knows 127.0.0.1_4242_0" in caplog.text
        assert peer not in liveness._watched
    finally:
        liveness.close()
        elsewhere.close()


def test_survivors_see_a_killed_node_lost_from_its_closed_connection(tmp_path):
    runs = run_scenarios(harness_args(scenario="kill"), tmp_path)
    # The first change seen: a survivor's agent seeing the closed connection, or (see below) its worker's failure.
    assert runs[0]["cause"] in ("node_lost", "worker_failed")
    assert (runs[0]["world_size_before"], runs[0]["world_size_after"]) == (3, 2)
    events = read_events(tmp_path / "events.jsonl")
    losses = [e for e in events if e["event"] == "membership_change" and e["cause"] == "node_lost"]
    # The killed node's loss; the harness then kills the other nodes too, which a survivor may see.
    killed = losses[0]["lost"]
    changes = [e for e in losses if e["lost"] == killed]
    closed = [change for change in changes if change["by_connection"]]
    assert closed, changes
    # Each survivor watches it (the next two are watched). One may learn of the loss from the state
    # the other wrote on seeing the connection close, a moment before its own connection tells it
    # (once in a clean-clone run, 20 ms later): well within the heartbeat timeout (3 s) of the close.
    closed_at = min(change["failed_at"] for change in closed)
    assert all(change["by_connection"] or change["time"] - closed_at < 1.0 for change in changes), changes
    # A survivor's worker may fail on the killed node's broken collective a few ms before its agent
    # sees the loss: that survivor's change is then its worker's failure, and its next round names
    # the killed node lost.
    next_rounds = {e["node"]: e for e in events if e["event"] == "rendezvous_done" and e["lost"] == killed}
    assert len(next_rounds) == 2, next_rounds
    saw_it = {change["node"] for change in changes}
    for survivor, next_round in next_rounds.items():
        if survivor not in saw_it:
            change = [e for e in events if e["event"] == "membership_change" and e["node"] == survivor
                      and e["time"] <= next_round["time"]][-1]
            assert change["cause"] == "worker_failed", change
