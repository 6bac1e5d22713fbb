"""The memory tier's data plane between agents, on real sockets: files go both ways intact; a
client without the job's secret, of another round, naming a path outside the memory directory, or
a connection altered on the way gets nothing and stores nothing; a put stores only a new file of
an uncommitted snapshot of the round, within caps; a frame reflected back to its sender fails its
MAC; a long file list comes in pages; idle connections are capped and cut, and peers get through."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from agent import listener_limits
from agent.checkpoint.dirs import COMMIT_MARKER
from agent.memory import peer_files
from agent.memory.layout import FETCHED_FILE, KEY_FILE
from agent.memory.peer_files import (
    MAC_BYTES,
    MAGIC,
    MAX_HEADER_BYTES,
    NONCE_BYTES,
    PeerError,
    PeerFileClient,
    PeerFileServer,
    read_secret,
)

SECRET = b"s" * 32


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "node"
    (root / "step_5" / "0").mkdir(parents=True)
    (root / "step_5" / "0" / "shard").write_bytes(os.urandom(3 << 20) + b"end")
    (root / "step_5" / ".snapshot_metadata").write_text("{}")
    server = PeerFileServer(root, SECRET, host="127.0.0.1")
    server.round = 4
    yield server
    server.close()


def test_files_go_both_ways_intact(served, tmp_path):
    with PeerFileClient(served.address, SECRET, round=4) as client:
        assert client.list("step_5") == {"0/shard": (3 << 20) + 3, ".snapshot_metadata": 2}
        size = client.get("step_5/0/shard", tmp_path / "copy")
        assert size == (3 << 20) + 3
        assert (tmp_path / "copy").read_bytes() == (served.root / "step_5" / "0" / "shard").read_bytes()
        client.put(tmp_path / "copy", "r4/step_5/1/shard")
    assert (served.root / "r4/step_5/1/shard").read_bytes() == (tmp_path / "copy").read_bytes()


def test_a_client_without_the_secret_gets_nothing(served, tmp_path):
    with pytest.raises(PeerError, match="does not share this node's secret"):
        PeerFileClient(served.address, b"x" * 32, round=4)
    # Speaking the protocol by hand with a made-up proof: the server closes without a byte more.
    with socket.create_connection(served.address, timeout=10) as sock:
        greeting = sock.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
        assert greeting.startswith(MAGIC)
        sock.sendall(MAGIC + os.urandom(NONCE_BYTES) + os.urandom(32))
        sock.sendall(b"\x00\x00\x00\x20" + b'{"op": "get", "round": 4, "path": "step_5/0/shard"}')
        assert sock.recv(1 << 20) == b""


def test_the_server_must_know_the_secret_too(tmp_path):
    impostor = PeerFileServer(tmp_path, b"y" * 32, host="127.0.0.1")
    impostor.round = 4
    try:
        with pytest.raises(PeerError, match="does not share this node's secret"):
            PeerFileClient(impostor.address, SECRET, round=4)
    finally:
        impostor.close()


def test_only_the_current_round_is_served(served, tmp_path):
    with PeerFileClient(served.address, SECRET, round=3) as stale:
        with pytest.raises(PeerError, match=r"round 3 is not this node's round \(4\)"):
            stale.get("step_5/0/shard", tmp_path / "copy")
        with pytest.raises(PeerError, match="round 3"):
            stale.put(served.root / "step_5" / ".snapshot_metadata", "step_5/injected")
    assert not (tmp_path / "copy").exists() and not (served.root / "step_5" / "injected").exists()
    served.round = None  # between rounds (this node's agent is re-forming): nothing at all
    with PeerFileClient(served.address, SECRET, round=4) as client, pytest.raises(PeerError, match="not this node's"):
        client.list("step_5")


def test_paths_outside_the_memory_directory_are_refused(served, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("private")
    (served.root / "link").symlink_to(tmp_path)
    with PeerFileClient(served.address, SECRET, round=4) as client:
        for path in ("../secret.txt", str(outside), "link/secret.txt"):
            with pytest.raises(PeerError, match="is not a file inside"):
                client.get(path, tmp_path / "copy")
            with pytest.raises(PeerError, match="is not a file inside"):
                client.put(served.root / "step_5" / ".snapshot_metadata", path.replace("secret.txt", "planted"))
    assert not (tmp_path / "copy").exists() and not (tmp_path / "planted").exists()


class FlippingProxy:
    """Relays one connection, flipping one byte of what the server sends at offset ``at``."""

    def __init__(self, target: tuple[str, int], at: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.target, self.at = target, at
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(client, server, None), daemon=True).start()
        _pipe(server, client, self.at)


def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
    seen = 0
    while data := src.recv(1 << 16):
        if flip_at is not None and seen <= flip_at < seen + len(data):
            data = bytearray(data)
            data[flip_at - seen] ^= 0x01
        seen += len(data)
        dst.sendall(bytes(data))
    dst.shutdown(socket.SHUT_WR)


def test_a_byte_altered_on_the_way_is_caught_and_nothing_is_stored(served, tmp_path):
    proxy = FlippingProxy(served.address, at=1 << 20)  # inside the file's bytes
    with PeerFileClient(proxy.address, SECRET, round=4) as client:
        with pytest.raises(PeerError, match="failed its MAC"):
            client.get("step_5/0/shard", tmp_path / "copy")
    assert not (tmp_path / "copy").exists() and not list(tmp_path.glob(".copy*"))


def test_the_secret_file_must_be_private_and_long_enough(tmp_path):
    path = tmp_path / "secret"
    path.write_text("short")
    path.chmod(0o600)
    with pytest.raises(PeerError, match="5 bytes; use at least 16"):
        read_secret(path)
    path.write_text("a" * 40)
    path.chmod(0o644)
    with pytest.raises(PeerError, match="readable by others; chmod 600"):
        read_secret(path)
    path.chmod(0o600)
    assert len(read_secret(path)) == 32
    with pytest.raises(PeerError, match="missing: cannot read"):
        read_secret(Path(tmp_path / "missing"))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_a_full_peer_says_so_stores_nothing_and_the_connection_goes_on(served, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], check=True)
    # No cap up front (as when the tmpfs fills between the check and the bytes): the bytes come,
    # and the node cannot store them.
    server = PeerFileServer(small, SECRET, host="127.0.0.1", max_file_bytes=1 << 30, max_connection_bytes=1 << 30)
    server.round = 4
    checked = PeerFileServer(small, SECRET, host="127.0.0.1")  # the default cap: the free space
    checked.round = 4
    try:
        with PeerFileClient(server.address, SECRET, round=4) as client:
            with pytest.raises(PeerError, match="cannot store r4/step_1/big: No space left on device"):
                client.put(served.root / "step_5" / "0" / "shard", "r4/step_1/big")  # 3 MB into 1 MB
            assert client.put(served.root / "step_5" / ".snapshot_metadata", "r4/step_1/small") == 2  # still in step
        with PeerFileClient(checked.address, SECRET, round=4) as client:
            with pytest.raises(PeerError, match=r"cannot store r4/step_1/big: 3145731 bytes, above the \d+ a file"):
                client.put(served.root / "step_5" / "0" / "shard", "r4/step_1/big")
            assert client.put(served.root / "step_5" / ".snapshot_metadata", "r4/step_1/other") == 2
        assert sorted(p.name for p in small.rglob("*") if p.is_file()) == ["other", "small"]
    finally:
        server.close()
        checked.close()
        subprocess.run(["umount", str(small)], check=True)


def test_a_put_stores_only_a_new_file_of_an_uncommitted_snapshot_of_the_round(served, tmp_path):
    source = served.root / "step_5" / ".snapshot_metadata"
    (served.root / KEY_FILE).write_bytes(b"k" * 32)
    with PeerFileClient(served.address, SECRET, round=4) as client:
        for path in ("r3/step_1/0/shard", "r4/shard", "step_5/0/shard", "r4/step_x/shard", KEY_FILE, "r4/step_1"):
            with pytest.raises(PeerError, match=r"only in this round's snapshots \(r4/step_<N>/<file>\)"):
                client.put(source, path)
        for name in (KEY_FILE, f"{FETCHED_FILE}.r4", ".shard.1.2.incoming"):
            with pytest.raises(PeerError, match="a name this node writes itself"):
                client.put(source, f"r4/step_1/{name}")
        assert client.put(source, "r4/step_1/0/shard") == 2
        with pytest.raises(PeerError, match="is here already"):
            client.put(served.root / "step_5" / "0" / "shard", "r4/step_1/0/shard")
        assert client.put(source, f"r4/step_1/{COMMIT_MARKER}") == 2  # as a buddy commits
        with pytest.raises(PeerError, match="r4/step_1 is committed here"):
            client.put(source, "r4/step_1/1/late")
        assert client.list("r4/step_1") == {"0/shard": 2, COMMIT_MARKER: 2}  # still in step after each refusal
    assert (served.root / KEY_FILE).read_bytes() == b"k" * 32
    assert sorted(str(p.relative_to(served.root)) for p in served.root.rglob("*") if p.is_file()) == sorted(
        [KEY_FILE, "r4/step_1/0/shard", f"r4/step_1/{COMMIT_MARKER}", "step_5/0/shard", "step_5/.snapshot_metadata"])


def test_puts_are_capped_per_file_and_per_connection(tmp_path):
    server = PeerFileServer(tmp_path / "node", SECRET, host="127.0.0.1", max_file_bytes=1000,
                            max_connection_bytes=1500)
    server.round = 4
    for size in (2000, 1000, 600):
        (tmp_path / str(size)).write_bytes(os.urandom(size))
    try:
        with PeerFileClient(server.address, SECRET, round=4) as client:
            with pytest.raises(PeerError, match="2000 bytes, above the 1000 a file may take here"):
                client.put(tmp_path / "2000", "r4/step_1/big")
            assert client.put(tmp_path / "1000", "r4/step_1/a") == 1000
            with pytest.raises(PeerError, match="1600 bytes over one connection, above the 1500"):
                client.put(tmp_path / "600", "r4/step_1/b")
        with PeerFileClient(server.address, SECRET, round=4) as client:  # a new connection, a new allowance
            assert client.put(tmp_path / "600", "r4/step_1/b") == 600
        assert sorted(p.name for p in (tmp_path / "node" / "r4" / "step_1").iterdir()) == ["a", "b"]
    finally:
        server.close()


class ReflectingProxy:
    """Relays the handshake both ways, then sends the client's first frame back to the client, as
    if the server had answered with it."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()
        self.target = target
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(self.target)
        threading.Thread(target=_pipe, args=(server, client, None), daemon=True).start()
        server.sendall(client.recv(len(MAGIC) + NONCE_BYTES + MAC_BYTES, socket.MSG_WAITALL))
        size = client.recv(4, socket.MSG_WAITALL)
        client.sendall(size + client.recv(int.from_bytes(size, "big") + MAC_BYTES, socket.MSG_WAITALL))


def test_a_frame_reflected_back_to_its_sender_fails_its_mac(served, tmp_path):
    proxy = ReflectingProxy(served.address)
    with PeerFileClient(proxy.address, SECRET, round=4) as client:
        with pytest.raises(PeerError, match="a header failed its MAC"):
            client.get("step_5/0/shard", tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_a_long_file_list_comes_in_pages(served):
    snapshot = served.root / "r4" / "step_1" / "model"
    snapshot.mkdir(parents=True)
    names = [f"model/{i:05d}_{'x' * 40}" for i in range(3000)]  # ~170 KB of names: a header holds 64
    for name in names:
        (served.root / "r4" / "step_1" / name).write_bytes(b"")
    with PeerFileClient(served.address, SECRET, round=4) as client:
        assert client.list("r4/step_1") == dict.fromkeys(names, 0)
        assert client.list("r4/step_2") == {}  # one empty page, and the connection still in step
        assert client.list("step_5") == {"0/shard": (3 << 20) + 3, ".snapshot_metadata": 2}


def test_a_header_above_the_limit_is_refused_with_a_clear_error(tmp_path):
    """A peer of another version (or not a peer) answering with a header above the limit."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer_too_long() -> None:
        sock, _ = listener.accept()
        connection = peer_files._Connection(sock, SECRET, server=True, endpoint="test")
        connection.incoming.recv_header()
        connection.outgoing.send_header({"files": {"x" * MAX_HEADER_BYTES: 1}, "more": False})
        sock.close()

    threading.Thread(target=answer_too_long, daemon=True).start()
    with PeerFileClient(listener.getsockname(), SECRET, round=4) as client:
        with pytest.raises(PeerError, match=r"a header of \d+ bytes, above the 65536 the protocol allows; is the peer "
                                            "a torchrevive agent of the same version"):
            client.list("r4/step_1")
    listener.close()


@pytest.fixture
def capped(tmp_path, monkeypatch):
    """A server holding 4 connections per address, 8 in total."""
    monkeypatch.setattr(peer_files, "MAX_CONNECTIONS_PER_ADDRESS", 4)
    monkeypatch.setattr(peer_files, "MAX_CONNECTIONS", 8)

    def start(handshake_timeout_s: float) -> PeerFileServer:
        monkeypatch.setattr(listener_limits, "HANDSHAKE_TIMEOUT_S", handshake_timeout_s)
        server = PeerFileServer(tmp_path / "flooded", SECRET, host="127.0.0.1")
        server.round = 4
        servers.append(server)
        return server

    servers: list[PeerFileServer] = []
    yield start
    for server in servers:
        server.close()


def test_connections_beyond_the_caps_are_refused_before_any_thread(capped, caplog):
    server = capped(handshake_timeout_s=60)

    def serving() -> set[threading.Thread]:  # socketserver's threads, one per connection served
        return {t for t in threading.enumerate() if "process_request_thread" in t.name}

    before = serving()  # (counted by name: other tests' leftovers start and end threads of their own)
    with caplog.at_level(logging.WARNING, logger="agent.listener_limits"):
        idle = [socket.create_connection(server.address, timeout=30) for _ in range(20)]
        greeted = [sock.recv(len(MAGIC)) == MAGIC for sock in idle]  # a refused one is closed at once
    assert greeted == [True] * 4 + [False] * 16 and len(serving() - before) == 4
    assert "refused 1 connection(s) (the last from 127.0.0.1, which holds 4 of 4 per address" in caplog.text
    refusals = [r for r in caplog.records if r.name == "agent.listener_limits"]  # (other tests' threads log too)
    assert len(refusals) == 1  # one line for the flood, not one per connection
    for sock in idle:
        sock.close()


def test_idle_connections_are_cut_at_their_deadline_and_peers_then_get_through(capped):
    server = capped(handshake_timeout_s=1.0)
    idle = [socket.create_connection(server.address, timeout=30) for _ in range(4)]
    assert all(sock.recv(len(MAGIC) + NONCE_BYTES, socket.MSG_WAITALL).startswith(MAGIC) for sock in idle)
    with pytest.raises(PeerError, match="closed the connection before its greeting"):
        PeerFileClient(server.address, SECRET, round=4)  # while the flood holds this address's share
    started = time.monotonic()
    for sock in idle:  # cut at their deadline: the flood drains
        assert sock.recv(1 << 10) == b""
        sock.close()
    assert time.monotonic() - started < 10
    # One that drips a byte of its greeting now and then, never silent long enough for a socket
    # timeout, is cut at its deadline all the same.
    drip = socket.create_connection(server.address, timeout=30)
    started = time.monotonic()
    with pytest.raises(OSError):
        for byte in MAGIC + os.urandom(NONCE_BYTES + MAC_BYTES):  # 22 s at this pace
            drip.sendall(bytes([byte]))
            time.sleep(0.3)
    assert time.monotonic() - started < 10
    drip.close()
    with PeerFileClient(server.address, SECRET, round=4) as client:
        time.sleep(1.5)  # a peer that proved the secret has no deadline, only an idle timeout
        assert client.list("r4") == {}
