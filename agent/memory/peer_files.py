"""The memory tier's data plane: an agent serves the files of its node's memory snapshots to peer
agents, and stores peers' replicas in its node's memory directory, over TCP.

A peer is hostile until it proves the job's secret. Each connection opens with a mutual
challenge: both sides send a random nonce and answer the other's with HMAC-SHA256 over it, so a
server reads or writes nothing for a client without the secret, and a client takes no bytes from
a server without it. Both derive a session key from the two nonces; every header and every
payload that follows carries a MAC under that key and a sequence number, so nothing can be
altered, replayed or reordered on the way. That MAC is keyed BLAKE3, not HMAC-SHA256: payloads
are snapshots of hundreds of MB pulled while a job is down, and it hashes 2.6x faster
(scripts/bench_peer_files.py). Headers are length-prefixed JSON, never pickles.

A request names its round, and a server answers only requests of the round it is in: a node
frozen and thawed after the others moved on neither serves nor accepts stale files. Paths are
relative to the served directory and checked like a checkpoint's file names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import socket
import socketserver
import struct
import threading
from pathlib import Path
from typing import Any

import blake3

from agent.errors import TorchreviveError
from agent.restore.locations import check_locations

MAGIC = b"TRV-PEER-2"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_HEADER_BYTES = 1 << 16
CHUNK_BYTES = 4 << 20


KEY_BYTES = 32
"""The data plane's key: 32 bytes (a SHA-256, or 32 random bytes)."""


class PeerError(TorchreviveError):
    """A peer refused a request, failed to authenticate, or sent something malformed."""


class _Channel:
    """One authenticated connection: framed, MAC-protected headers and payloads."""

    def __init__(self, sock: socket.socket, secret: bytes, *, server: bool, endpoint: str) -> None:
        self.sock, self.endpoint = sock, endpoint
        self._send_seq = self._recv_seq = 0
        self._key = self._handshake(secret, server)

    # -- the handshake --------------------------------------------------------------------------

    def _handshake(self, secret: bytes, server: bool) -> bytes:
        mine = secrets.token_bytes(NONCE_BYTES)
        self.sock.sendall(MAGIC + mine)
        if self._recv_exactly(len(MAGIC)) != MAGIC:
            raise PeerError(f"{self.endpoint}: not a torchrevive peer (wrong greeting)")
        theirs = self._recv_exactly(NONCE_BYTES)
        me, them = (b"server", b"client") if server else (b"client", b"server")
        # Each side proves the secret over the other's nonce (nothing replays from another
        # connection); the client first, so a server sends nothing but its nonce to a stranger.
        if not server:
            self.sock.sendall(hmac.digest(secret, me + theirs + mine, "sha256"))
        mismatch = (f"{self.endpoint}: the peer does not share this node's secret; check that every node has the "
                    "same checkpoint.memory_secret_file")
        try:
            proof = self._recv_exactly(MAC_BYTES)
        except PeerError as exc:  # a server closes at once on a wrong proof
            raise PeerError(mismatch) from exc
        if not hmac.compare_digest(proof, hmac.digest(secret, them + mine + theirs, "sha256")):
            raise PeerError(mismatch)
        if server:
            self.sock.sendall(hmac.digest(secret, me + theirs + mine, "sha256"))
        server_nonce, client_nonce = (mine, theirs) if server else (theirs, mine)
        return hmac.digest(secret, b"session" + server_nonce + client_nonce, "sha256")

    # -- framing ----------------------------------------------------------------------------------

    def _mac(self, seq: int) -> blake3.blake3:
        return blake3.blake3(struct.pack(">Q", seq), key=self._key)

    def send_header(self, header: dict[str, Any]) -> None:
        body = json.dumps(header).encode()
        mac = self._mac(self._send_seq)
        mac.update(body)
        self._send_seq += 1
        self.sock.sendall(struct.pack(">I", len(body)) + body + mac.digest())

    def recv_header(self) -> dict[str, Any]:
        (size,) = struct.unpack(">I", self._recv_exactly(4))
        if size > MAX_HEADER_BYTES:
            raise PeerError(f"{self.endpoint}: a header of {size} bytes (at most {MAX_HEADER_BYTES})")
        body = self._recv_exactly(size)
        mac = self._mac(self._recv_seq)
        mac.update(body)
        self._recv_seq += 1
        if not hmac.compare_digest(self._recv_exactly(MAC_BYTES), mac.digest()):
            raise PeerError(f"{self.endpoint}: a header failed its MAC (altered on the way)")
        header = json.loads(body)
        if not isinstance(header, dict):
            raise PeerError(f"{self.endpoint}: a header that is not a JSON object")
        return header

    def send_file(self, path: Path, size: int) -> None:
        """Send ``size`` bytes of ``path`` and their MAC."""
        mac = self._mac(self._send_seq)
        self._send_seq += 1
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < size:
                raise PeerError(f"{path}: shorter than the {size} bytes announced")
            if size:  # mapped, not read: the bytes go from the page cache to the socket uncopied
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapped, memoryview(mapped) as view:
                    for start in range(0, size, CHUNK_BYTES):
                        with view[start:start + CHUNK_BYTES] as chunk:
                            mac.update(chunk)
                            self.sock.sendall(chunk)
        self.sock.sendall(mac.digest())

    def recv_file(self, dest: Path, size: int) -> None:
        """Receive ``size`` bytes into ``dest`` (through a temporary file, renamed once the MAC
        checks out: a file in place is always whole and authentic). When this node cannot store
        them (its tmpfs full), the rest of the payload is still read, so that the connection stays
        in step for the answer, and the OSError is raised after it."""
        mac = self._mac(self._recv_seq)
        self._recv_seq += 1
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}.incoming")
        failure: OSError | None = None
        fd = -1
        try:
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            except OSError as exc:
                failure = exc
            left = size
            buffer = bytearray(min(CHUNK_BYTES, max(size, 1)))
            view = memoryview(buffer)
            while left:
                got = self.sock.recv_into(view[: min(left, len(buffer))])
                if not got:
                    raise PeerError(f"{self.endpoint}: the connection closed {left} bytes before the end of {dest.name}")
                mac.update(view[:got])
                if failure is None:
                    try:
                        _write_all(fd, view[:got])
                    except OSError as exc:
                        failure = exc
                left -= got
            if not hmac.compare_digest(self._recv_exactly(MAC_BYTES), mac.digest()):
                raise PeerError(f"{self.endpoint}: {dest.name} failed its MAC (altered on the way)")
            if failure is not None:
                raise failure
            os.close(fd)
            fd = -1
            os.replace(tmp, dest)
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)

    def _recv_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise PeerError(f"{self.endpoint}: the connection closed")
            data += chunk
        return bytes(data)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _checked(root: Path, path: object) -> Path:
    """``root / path`` for a relative path that stays inside ``root``; PeerError otherwise."""
    if not isinstance(path, str):
        raise PeerError(f"a path that is not a string: {path!r}")
    try:
        check_locations(root, {path: "requested"}, named_in=root)
    except TorchreviveError as exc:
        raise PeerError(f"{path!r} is not a file inside {root}") from exc
    return root / path


class PeerFileServer:
    """Serves ``root`` to peers that know ``secret``, for requests of the current ``round``.

    Args:
        root: the node's memory directory.
        secret: the job's shared secret (at least 16 bytes).
        host: the address to listen on (the node's own, never a wildcard by default).
        port: the port (0: any free one; see :attr:`address`).
    """

    def __init__(self, root: Path, secret: bytes, *, host: str, port: int = 0) -> None:
        if len(secret) < 16:
            raise PeerError("the memory tier's secret must be at least 16 bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.round: int | None = None
        """The round whose requests are answered; None answers nothing."""
        self.secret = secret
        """What clients must prove (new connections use the current value)."""
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request, "%s:%d" % self.client_address[:2])

        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self._server = socketserver.ThreadingTCPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="torchrevive-peer-files",
                                        daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _serve(self, sock: socket.socket, endpoint: str) -> None:
        try:
            channel = _Channel(sock, self.secret, server=True, endpoint=endpoint)
            while True:
                try:
                    request = channel.recv_header()
                except PeerError:
                    return  # closed by the client, or a broken frame: nothing more from it
                self._answer(channel, request)
        except (PeerError, OSError):
            return  # a client that failed the handshake or went away gets nothing

    def _answer(self, channel: _Channel, request: dict[str, Any]) -> None:
        if request.get("round") != self.round or self.round is None:
            channel.send_header({"error": f"round {request.get('round')} is not this node's round ({self.round})"})
            return
        op = request.get("op")
        try:
            if op == "get":
                path = _checked(self.root, request.get("path"))
                size = path.stat().st_size
                channel.send_header({"size": size})
                channel.send_file(path, size)
            elif op == "put":
                size = request.get("size")
                if not isinstance(size, int) or size < 0:
                    raise PeerError(f"a put of {size!r} bytes")
                path = _checked(self.root, request.get("path"))
                channel.send_header({"ready": True})
                try:
                    channel.recv_file(path, size)
                except OSError as exc:
                    channel.send_header({"error": f"this node cannot store {request.get('path')}: "
                                                  f"{exc.strerror or exc}"})
                    return
                channel.send_header({"stored": size})
            elif op == "list":
                directory = _checked(self.root, request.get("path"))
                files = {str(p.relative_to(directory)): p.stat().st_size
                         for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(".incoming")}
                channel.send_header({"files": files})
            else:
                channel.send_header({"error": f"unknown operation {op!r}"})
        except FileNotFoundError as exc:
            channel.send_header({"error": f"no such file: {exc.filename}"})
        except PeerError as exc:
            channel.send_header({"error": str(exc)})


class PeerFileClient:
    """One authenticated connection to a peer's :class:`PeerFileServer`, for requests of ``round``."""

    def __init__(self, address: tuple[str, int], secret: bytes, *, round: int, timeout: float = 30.0) -> None:
        self.endpoint = "%s:%d" % address
        self.round = round
        try:
            sock = socket.create_connection(address, timeout=timeout)
        except OSError as exc:
            raise PeerError(f"{self.endpoint}: cannot connect to the peer's memory tier ({exc})") from exc
        try:
            self._channel = _Channel(sock, secret, server=False, endpoint=self.endpoint)
        except (PeerError, OSError):
            sock.close()
            raise

    def __enter__(self) -> PeerFileClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.sock.close()

    def get(self, path: str, dest: Path, *, max_bytes: int = 1 << 40) -> int:
        """Copy the peer's ``path`` (at most ``max_bytes``) to ``dest``; its size."""
        size = self._request({"op": "get", "path": path}, "size")["size"]
        if not isinstance(size, int) or not 0 <= size <= max_bytes:
            raise PeerError(f"{self.endpoint}: {path} announced as {size!r} bytes (at most {max_bytes})")
        self._channel.recv_file(dest, size)
        return size

    def put(self, source: Path, path: str) -> int:
        """Store ``source`` as the peer's ``path``; its size."""
        size = source.stat().st_size
        self._request({"op": "put", "path": path, "size": size}, "ready")
        self._channel.send_file(source, size)
        self._expect(self._channel.recv_header(), "stored")
        return size

    def list(self, directory: str) -> dict[str, int]:
        """The files under the peer's ``directory`` and their sizes."""
        files = self._request({"op": "list", "path": directory}, "files")["files"]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in files.items()):
            raise PeerError(f"{self.endpoint}: a file list that is not names and sizes")
        return files

    def _request(self, request: dict[str, Any], key: str) -> dict[str, Any]:
        """Send ``request`` (of this client's round); the answer, which must carry ``key``."""
        self._channel.send_header({**request, "round": self.round})
        return self._expect(self._channel.recv_header(), key)

    def _expect(self, answer: dict[str, Any], key: str) -> dict[str, Any]:
        if "error" in answer:
            raise PeerError(f"{self.endpoint}: {answer['error']}")
        if key not in answer:
            raise PeerError(f"{self.endpoint}: an answer without {key!r}")
        return answer


def read_secret(path: str | os.PathLike[str]) -> bytes:
    """The data plane's key derived from the job's memory-tier secret at ``path`` (a file only its
    owner can read): its SHA-256."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise PeerError(f"{path}: cannot read the memory tier's secret ({exc.strerror}); set "
                        "checkpoint.memory_secret_file to a file every node can read") from exc
    if mode & 0o077:
        raise PeerError(f"{path}: the memory tier's secret is readable by others; chmod 600 it")
    if len(secret) < 16:
        raise PeerError(f"{path}: the memory tier's secret is {len(secret)} bytes; use at least 16")
    return hashlib.sha256(secret).digest()


def write_key(path: str | os.PathLike[str], key: bytes) -> None:
    """Keep the data plane's key (32 bytes) at ``path``, readable by its owner alone, for the
    node's workers (:func:`read_key`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)


def read_key(path: str | os.PathLike[str]) -> bytes:
    """The key :func:`write_key` kept at ``path``."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        key = path.read_bytes()
    except OSError as exc:
        raise PeerError(f"{path}: cannot read the memory tier's key ({exc.strerror}); is the node's agent "
                        "running with the memory tier on?") from exc
    if mode & 0o077 or len(key) != KEY_BYTES:
        raise PeerError(f"{path}: not a memory-tier key (mode {oct(mode & 0o777)}, {len(key)} bytes); "
                        "its agent writes it, mode 600")
    return key


def parse_address(endpoint: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a socket address."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)
