"""The memory tier's data plane between agents, on real sockets: files go both ways intact; a
client without the job's secret, of another round, naming a path outside the memory directory, or
a connection altered on the way gets nothing and stores nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from agent.memory.peer_files import MAGIC, NONCE_BYTES, PeerError, PeerFileClient, PeerFileServer, read_secret

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
        client.put(tmp_path / "copy", "replicas/node1/step_5/0/shard")
    assert (served.root / "replicas/node1/step_5/0/shard").read_bytes() == (tmp_path / "copy").read_bytes()


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
    server = PeerFileServer(small, SECRET, host="127.0.0.1")
    server.round = 4
    try:
        with PeerFileClient(server.address, SECRET, round=4) as client:
            with pytest.raises(PeerError, match="cannot store r4/big: No space left on device"):
                client.put(served.root / "step_5" / "0" / "shard", "r4/big")  # 3 MB into 1 MB
            assert client.put(served.root / "step_5" / ".snapshot_metadata", "r4/small") == 2  # still in step
        assert sorted(p.name for p in small.rglob("*") if p.is_file()) == ["small"]
    finally:
        server.close()
        subprocess.run(["umount", str(small)], check=True)
