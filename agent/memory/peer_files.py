"""The memory tier's data plane: an agent serves the files of its node's memory snapshots to peer
agents, and stores peers' replicas in its node's memory directory, over TCP.

A peer is hostile until it proves the job's secret. Each connection opens with a mutual
challenge: both sides send a random nonce and answer the other's with HMAC-SHA256 over it, so a
server reads or writes nothing for a client without the secret, and a client takes no bytes from
a server without it. Both derive a session key from the two nonces, and from it one key per
direction; every header and every payload that follows carries a MAC under its direction's key
and a sequence number, so nothing can be altered, replayed, reordered, or reflected back to its
sender on the way. That MAC is keyed BLAKE3, not HMAC-SHA256: payloads are snapshots of hundreds
of MB pulled while a job is down, and it hashes 2.6x faster (scripts/bench_peer_files.py).
Headers are length-prefixed JSON, never pickles; a file list too long for one header comes in
pages.

A request names its round, and a server answers only requests of the round it is in: a node
frozen and thawed after the others moved on neither serves nor accepts stale files. Paths are
relative to the served directory and checked like a checkpoint's file names. A put stores only
what a buddy writes: a new file of an uncommitted snapshot of the current round
(``r<round>/step_<N>/...``), never a name the node keeps for itself, within a size cap per file
and per connection. Before authentication a connection is bounded
(:mod:`agent.listener_limits`): the server holds a capped number per peer address and in total,
and cuts any that has not proven the secret within a few seconds.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import mmap
import os
import secrets
import shutil
import socket
import socketserver
import struct
import threading
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import blake3

from agent.checkpoint.direct_write import write_all
from agent.checkpoint.dirs import COMMIT_MARKER
from agent.errors import TorchreviveError
from agent.listener_limits import BoundedThreadingTCPServer, ConnectionCaps
from agent.memory.layout import FETCHED_FILE, KEY_FILE, MemorySnapshot
from agent.restore.locations import check_locations

MAGIC = b"TRV-PEER-3"
NONCE_BYTES = 32
MAC_BYTES = 32
MAX_HEADER_BYTES = 1 << 16
LIST_PAGE_BYTES = MAX_HEADER_BYTES // 2
"""What one page of a file list may take, as JSON (well under a header's limit)."""
MAX_LIST_FILES = 1 << 20
"""The most names a client takes from one list (a peer streaming pages forever is cut there)."""
CHUNK_BYTES = 4 << 20
INCOMING_SUFFIX = ".incoming"
"""A file being received ends so until its MAC checks out."""
CLIENT_TO_SERVER = "torchrevive peer files 2026-12 client->server"
SERVER_TO_CLIENT = "torchrevive peer files 2026-12 server->client"
"""BLAKE3 key-derivation contexts of the two directions' keys."""
MAX_CONNECTIONS = 256
"""Connections a server holds at once: each holds a thread."""
MAX_CONNECTIONS_PER_ADDRESS = 64
"""Connections a server holds at once from one address: a node's ranks each push their files."""


KEY_BYTES = 32
"""The data plane's key: 32 bytes (a SHA-256, or 32 random bytes)."""


class PeerError(TorchreviveError):
    """A peer refused a request, failed to authenticate, or sent something malformed."""


class _Channel:
    """One direction of a connection: the frames (headers and file payloads) one side sends and the
    other receives, each with a MAC under that direction's key over its sequence number, so that
    none can be altered, replayed, reordered, or passed off as a frame of the other direction."""

    def __init__(self, sock: socket.socket, key: bytes, endpoint: str) -> None:
        self.sock, self._key, self.endpoint = sock, key, endpoint
        self._seq = 0

    def _mac(self, seq: int) -> blake3.blake3:
        return blake3.blake3(struct.pack(">Q", seq), key=self._key)

    def _next_mac(self) -> blake3.blake3:
        mac = self._mac(self._seq)
        self._seq += 1
        return mac

    # -- the sending side ------------------------------------------------------------------------

    def send_header(self, header: dict[str, Any]) -> None:
        body = json.dumps(header).encode()
        mac = self._next_mac()
        mac.update(body)
        self.sock.sendall(struct.pack(">I", len(body)) + body + mac.digest())

    def send_file(self, path: Path, size: int) -> None:
        """Send ``size`` bytes of ``path`` and their MAC."""
        mac = self._next_mac()
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

    # -- the receiving side ----------------------------------------------------------------------

    def recv_header(self) -> dict[str, Any]:
        (size,) = struct.unpack(">I", _recv_exactly(self.sock, 4, self.endpoint))
        if size > MAX_HEADER_BYTES:
            raise PeerError(f"{self.endpoint}: a header of {size} bytes, above the {MAX_HEADER_BYTES} the protocol "
                            "allows; is the peer a torchrevive agent of the same version?")
        body = _recv_exactly(self.sock, size, self.endpoint)
        mac = self._next_mac()
        mac.update(body)
        if not hmac.compare_digest(_recv_exactly(self.sock, MAC_BYTES, self.endpoint), mac.digest()):
            raise PeerError(f"{self.endpoint}: a header failed its MAC (altered on the way)")
        header = json.loads(body)
        if not isinstance(header, dict):
            raise PeerError(f"{self.endpoint}: a header that is not a JSON object")
        return header

    def recv_file(self, dest: Path, size: int, *, exclusive: bool = False) -> None:
        """Receive ``size`` bytes into ``dest`` (through a temporary file, renamed once the MAC
        checks out: a file in place is always whole and authentic; with ``exclusive``, linked
        instead, so a ``dest`` that appeared meanwhile stays and FileExistsError is raised). When this node cannot store
        them (its tmpfs full), the rest of the payload is still read, so that the connection stays
        in step for the answer, and the OSError is raised after it."""
        mac = self._next_mac()
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.{threading.get_ident()}{INCOMING_SUFFIX}")
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
                        write_all(fd, view[:got])
                    except OSError as exc:
                        failure = exc
                left -= got
            if not hmac.compare_digest(_recv_exactly(self.sock, MAC_BYTES, self.endpoint), mac.digest()):
                raise PeerError(f"{self.endpoint}: {dest.name} failed its MAC (altered on the way)")
            if failure is not None:
                raise failure
            os.close(fd)
            fd = -1
            if exclusive:
                os.link(tmp, dest)  # the temporary file goes below
            else:
                os.replace(tmp, dest)
        finally:
            if fd >= 0:
                os.close(fd)
            tmp.unlink(missing_ok=True)


class _Connection:
    """One authenticated connection: the handshake, then a channel each way (``outgoing`` for what
    this side sends, ``incoming`` for what it receives)."""

    def __init__(self, sock: socket.socket, secret: bytes, *, server: bool, endpoint: str) -> None:
        self.sock, self.endpoint = sock, endpoint
        session = self._handshake(secret, server)
        to_server = blake3.blake3(session, derive_key_context=CLIENT_TO_SERVER).digest()
        to_client = blake3.blake3(session, derive_key_context=SERVER_TO_CLIENT).digest()
        self.outgoing = _Channel(sock, to_client if server else to_server, endpoint)
        self.incoming = _Channel(sock, to_server if server else to_client, endpoint)

    def _handshake(self, secret: bytes, server: bool) -> bytes:
        mine = secrets.token_bytes(NONCE_BYTES)
        self.sock.sendall(MAGIC + mine)
        try:
            greeting = _recv_exactly(self.sock, len(MAGIC), self.endpoint)
        except PeerError as exc:
            raise PeerError(f"{self.endpoint}: the peer closed the connection before its greeting (it holds as many "
                            "connections as it takes, or it is shutting down)") from exc
        if greeting != MAGIC:
            raise PeerError(f"{self.endpoint}: not a torchrevive peer of this version (wrong greeting); run the same "
                            "torchrevive on every node")
        theirs = _recv_exactly(self.sock, NONCE_BYTES, self.endpoint)
        me, them = (b"server", b"client") if server else (b"client", b"server")
        # Each side proves the secret over the other's nonce (nothing replays from another
        # connection); the client first, so a server sends nothing but its nonce to a stranger.
        if not server:
            self.sock.sendall(hmac.digest(secret, me + theirs + mine, "sha256"))
        mismatch = (f"{self.endpoint}: the peer does not share this node's secret; check that every node has the "
                    "same checkpoint.memory_secret_file")
        try:
            proof = _recv_exactly(self.sock, MAC_BYTES, self.endpoint)
        except PeerError as exc:  # a server closes at once on a wrong proof
            raise PeerError(mismatch) from exc
        if not hmac.compare_digest(proof, hmac.digest(secret, them + mine + theirs, "sha256")):
            raise PeerError(mismatch)
        if server:
            self.sock.sendall(hmac.digest(secret, me + theirs + mine, "sha256"))
        server_nonce, client_nonce = (mine, theirs) if server else (theirs, mine)
        return hmac.digest(secret, b"session" + server_nonce + client_nonce, "sha256")


def _recv_exactly(sock: socket.socket, size: int, endpoint: str) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise PeerError(f"{endpoint}: the connection closed")
        data += chunk
    return bytes(data)


def _checked(root: Path, path: object) -> Path:
    """``root / path`` for a relative path that stays inside ``root``; PeerError otherwise."""
    if not isinstance(path, str):
        raise PeerError(f"a path that is not a string: {path!r}")
    try:
        check_locations(root, {path: "requested"}, named_in=root)
    except TorchreviveError as exc:
        raise PeerError(f"{path!r} is not a file inside {root}") from exc
    return root / path


def _replica_file(root: Path, round: int, path: object) -> Path:
    """Where a peer's put of ``path`` goes: a new file of an uncommitted snapshot of ``round``,
    under a name the replica protocol writes (:mod:`agent.memory.saver`: the ranks' files, the
    checksum record and the commit marker); PeerError for anything else."""
    target = _checked(root, path)
    parts = PurePosixPath(str(path)).parts
    try:
        snapshot = MemorySnapshot.parse("/".join(parts[:2]))
    except ValueError:
        snapshot = None
    if snapshot is None or snapshot.round != round or len(parts) < 3:
        raise PeerError(f"{path!r}: a peer stores files only in this round's snapshots (r{round}/step_<N>/<file>)")
    if any(part.startswith((FETCHED_FILE, KEY_FILE)) or part.endswith(INCOMING_SUFFIX) for part in parts):
        raise PeerError(f"{path!r}: a name this node writes itself, never a peer")
    if (root / snapshot.relative / COMMIT_MARKER).exists():
        raise PeerError(f"{path!r}: {snapshot.relative} is committed here, and a committed snapshot is never rewritten")
    if target.exists():
        raise PeerError(f"{path!r} is here already; a replica's file is stored once")
    return target


def _list_pages(files: dict[str, int]) -> Iterator[dict[str, int]]:
    """``files`` cut into pages of at most :data:`LIST_PAGE_BYTES` as JSON (one page, maybe empty, at least)."""
    page: dict[str, int] = {}
    used = 0
    for name, size in files.items():
        entry = len(json.dumps(name)) + len(str(size)) + 4  # '"name": size, '
        if page and used + entry > LIST_PAGE_BYTES:
            yield page
            page, used = {}, 0
        page[name] = size
        used += entry
    yield page


class PeerFileServer:
    """Serves ``root`` to peers that know ``secret``, for requests of the current ``round``.

    Args:
        root: the node's memory directory.
        secret: the job's shared secret (at least 16 bytes).
        host: the address to listen on (the node's own, never a wildcard by default).
        port: the port (0: any free one; see :attr:`address`).
        max_file_bytes: the largest file a peer may put; None: what the memory directory's file
            system has free when the put comes.
        max_connection_bytes: the most bytes a peer may put over one connection; None: the size
            of the memory directory's file system.
    """

    def __init__(self, root: Path, secret: bytes, *, host: str, port: int = 0, max_file_bytes: int | None = None,
                 max_connection_bytes: int | None = None) -> None:
        if len(secret) < 16:
            raise PeerError("the memory tier's secret must be at least 16 bytes")
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.round: int | None = None
        """The round whose requests are answered; None answers nothing."""
        self.secret = secret
        """What clients must prove (new connections use the current value)."""
        self.max_file_bytes, self.max_connection_bytes = max_file_bytes, max_connection_bytes
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request, "%s:%d" % self.client_address[:2])

        caps = ConnectionCaps(f"the memory tier's data plane on {host}", total=MAX_CONNECTIONS,
                              per_address=MAX_CONNECTIONS_PER_ADDRESS)
        self._server = BoundedThreadingTCPServer((host, port), Handler, caps)
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
            connection = _Connection(sock, self.secret, server=True, endpoint=endpoint)
            self._server.proven(sock)
            stored = 0
            while True:
                try:
                    request = connection.incoming.recv_header()
                except PeerError:
                    return  # closed by the client, or a broken frame: nothing more from it
                stored += self._answer(connection, request, stored)
        except (PeerError, OSError):
            return  # a client that failed the handshake, went silent or went away gets nothing

    def _answer(self, connection: _Connection, request: dict[str, Any], stored: int) -> int:
        """Answer one request, of a connection that put ``stored`` bytes so far; the bytes it puts."""
        out = connection.outgoing
        round = self.round
        if request.get("round") != round or round is None:
            out.send_header({"error": f"round {request.get('round')} is not this node's round ({round})"})
            return 0
        op = request.get("op")
        try:
            if op == "get":
                path = _checked(self.root, request.get("path"))
                size = path.stat().st_size
                out.send_header({"size": size})
                out.send_file(path, size)
            elif op == "put":
                return self._store(connection, request, round, stored)
            elif op == "list":
                directory = _checked(self.root, request.get("path"))
                files = {str(p.relative_to(directory)): p.stat().st_size
                         for p in sorted(directory.rglob("*")) if p.is_file() and not p.name.endswith(INCOMING_SUFFIX)}
                pages = list(_list_pages(files))
                for number, page in enumerate(pages, 1):
                    out.send_header({"files": page, "more": number < len(pages)})
            else:
                out.send_header({"error": f"unknown operation {op!r}"})
        except FileNotFoundError as exc:
            out.send_header({"error": f"no such file: {exc.filename}"})
        except PeerError as exc:
            out.send_header({"error": str(exc)})
        return 0

    def _store(self, connection: _Connection, request: dict[str, Any], round: int, stored: int) -> int:
        """A put: refused before a byte of it comes unless it fits the caps; the bytes stored."""
        size = request.get("size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise PeerError(f"a put of {size!r} bytes")
        path = _replica_file(self.root, round, request.get("path"))
        usage = shutil.disk_usage(self.root)
        file_cap = usage.free if self.max_file_bytes is None else self.max_file_bytes
        connection_cap = usage.total if self.max_connection_bytes is None else self.max_connection_bytes
        if size > file_cap:
            raise PeerError(f"this node cannot store {request.get('path')}: {size} bytes, above the {file_cap} a "
                            "file may take here (the memory directory's free space)")
        if stored + size > connection_cap:
            raise PeerError(f"this node cannot store {request.get('path')}: {stored + size} bytes over one "
                            f"connection, above the {connection_cap} it may take (the memory directory's size)")
        connection.outgoing.send_header({"ready": True})
        try:
            connection.incoming.recv_file(path, size, exclusive=True)  # two puts of one file: the first stays
        except OSError as exc:
            connection.outgoing.send_header({"error": f"this node cannot store {request.get('path')}: "
                                                      f"{exc.strerror or exc}"})
            return size  # read all the same: it counts against the connection's cap
        connection.outgoing.send_header({"stored": size})
        return size


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
            self._connection = _Connection(sock, secret, server=False, endpoint=self.endpoint)
        except (PeerError, OSError):
            sock.close()
            raise

    def __enter__(self) -> PeerFileClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._connection.sock.close()

    def get(self, path: str, dest: Path, *, max_bytes: int = 1 << 40) -> int:
        """Copy the peer's ``path`` (at most ``max_bytes``) to ``dest``; its size."""
        size = self._request({"op": "get", "path": path}, "size")["size"]
        if not isinstance(size, int) or not 0 <= size <= max_bytes:
            raise PeerError(f"{self.endpoint}: {path} announced as {size!r} bytes (at most {max_bytes})")
        self._connection.incoming.recv_file(dest, size)
        return size

    def put(self, source: Path, path: str) -> int:
        """Store ``source`` as the peer's ``path``; its size."""
        size = source.stat().st_size
        self._request({"op": "put", "path": path, "size": size}, "ready")
        self._connection.outgoing.send_file(source, size)
        self._expect(self._connection.incoming.recv_header(), "stored")
        return size

    def list(self, directory: str) -> dict[str, int]:
        """The files under the peer's ``directory`` and their sizes (sent in pages)."""
        answer = self._request({"op": "list", "path": directory}, "files")
        files: dict[str, int] = {}
        while True:
            page = answer["files"]
            if not isinstance(page, dict) or not all(isinstance(k, str) and isinstance(v, int)
                                                     for k, v in page.items()):
                raise PeerError(f"{self.endpoint}: a file list that is not names and sizes")
            files.update(page)
            if len(files) > MAX_LIST_FILES:
                raise PeerError(f"{self.endpoint}: a list of {directory} above {MAX_LIST_FILES} files")
            if answer.get("more") is not True:
                return files
            answer = self._expect(self._connection.incoming.recv_header(), "files")

    def _request(self, request: dict[str, Any], key: str) -> dict[str, Any]:
        """Send ``request`` (of this client's round); the answer, which must carry ``key``."""
        self._connection.outgoing.send_header({**request, "round": self.round})
        return self._expect(self._connection.incoming.recv_header(), key)

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
