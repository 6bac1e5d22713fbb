"""torch.compile's caches, kept by the agent for its node (the job config's ``compile`` section).

A worker restarted on a node compiles its model again from scratch unless inductor's caches
outlived it. With ``compile.cache_dir`` the agent points its workers' inductor caches
(``TORCHINDUCTOR_CACHE_DIR``: the FX graph cache, the AOTAutograd cache and the compiled kernels
they name) at ``<cache_dir>/inductor``, a directory the agent owns that outlives the workers (and,
placed on a volume, the container), and whose contents belong to this job's node alone.

With ``compile.share`` the round's leader packs that directory, after a commit, when its
contents changed since its last pack, into one archive beside the job's snapshots
(``<checkpoint.dir>/compile_cache/``: ``<sha256>.tar`` and ``current.json`` naming it; the one
before stays for a reader that read the older pointer) and, with the memory tier, into its memory
directory, which its data plane serves to peers. A node whose own caches are empty, one that joins
or replaces a lost one, fills them before its workers start: from a peer over the data plane
(authenticated by the job's secret) where it can, else from the checkpoint directory. Precompiled
headers stay out (hundreds of MB; only a compile of new kernels reads them).

Why a directory and not ``torch.compiler.save_cache_artifacts``: on CPU those artifacts carry no
compiled C++ kernels, so a process that loaded them still compiled every kernel (measured on a
3-layer MLP: 9.6 s against 10.3 s cold and 1.5 s from the kept directory).

Cache entries are code the workers import and run (Python modules, shared objects). Nothing is
kept or shared unless the job asks. An archive is taken only when its bytes match the digest its
pointer names and its torch version is the workers', and it is unpacked with tarfile's ``data``
filter (nothing outside the directory, no links, no devices) within a size cap, wherever it came
from; one that fails is skipped, with the reason in the ``compile_cache_ready`` event, and the
workers compile from scratch. These checks stop torn and corrupt archives, not someone who can
write the checkpoint directory or who holds the job's secret: ``share`` trusts them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch

from agent.checkpoint.durable import fsync_dir, write_file
from agent.errors import TorchreviveError

INDUCTOR_CACHE_DIR = "TORCHINDUCTOR_CACHE_DIR"
"""inductor's own variable: where its caches are (read each time a cache is looked up)."""
SHARED_DIR = "compile_cache"
"""The checkpoint directory's folder of shared caches."""
POINTER_FILE = "current.json"
LEFT_OUT = frozenset({"precompiled_headers", "locks"})
"""Top-level folders of inductor's cache directory that are never shared."""
MAX_ARCHIVE_BYTES = 4 << 30
_ARCHIVE_NAME = re.compile(r"^[0-9a-f]{64}\.tar$")


class CompileCacheError(TorchreviveError):
    """A cache directory the agent cannot use, or a shared archive that is not taken (the message
    says which file and why)."""


@dataclass(frozen=True)
class Ready:
    """What a node's workers compile from: ``warm_from`` is ``local`` (the node's own caches),
    ``peer`` (a peer's archive, over the data plane), ``snapshot`` (the checkpoint directory's) or
    ``none``; ``problem``: why a source that was tried was not taken."""

    warm_from: str
    files: int
    bytes: int
    seconds: float
    problem: str | None = None


@dataclass(frozen=True)
class Shared:
    """An archive the leader wrote: its name, size, number of files and the seconds it took."""

    archive: str
    bytes: int
    files: int
    seconds: float


PeerFetch = Callable[[Path], None]
"""Copies a peer's shared caches (:func:`fetch_shared`) into a folder; CompileCacheError when it cannot."""


class CompileCache:
    """One node's compile caches: ``directory`` (``compile.cache_dir``) and, with ``share``, the
    checkpoint directory ``checkpoint_dir`` whose archive it packs and unpacks, and the folder its
    data plane serves (``served``, the memory directory) where a copy goes for peers."""

    def __init__(self, directory: str | os.PathLike[str], checkpoint_dir: str | None, *, share: bool,
                 served: Path | None = None) -> None:
        self.caches = Path(directory).resolve() / "inductor"
        try:
            self.caches.mkdir(parents=True, exist_ok=True)
            if not os.access(self.caches, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        except OSError as exc:
            raise CompileCacheError(f"compile.cache_dir: cannot keep compile caches in {self.caches} "
                                    f"({exc.strerror or exc}); give a directory this node's agent can write, or leave "
                                    "compile.cache_dir unset") from None
        self.shared = Path(checkpoint_dir) / SHARED_DIR if share and checkpoint_dir else None
        self.served = served / SHARED_DIR if self.shared is not None and served is not None else None
        self._packed: int | None = None
        """The fingerprint of the contents last packed."""
        self._packing: threading.Thread | None = None

    def environment(self) -> dict[str, str]:
        """The variables that point a worker's inductor caches here."""
        return {INDUCTOR_CACHE_DIR: str(self.caches)}

    def prepare(self, from_peer: PeerFetch | None = None) -> Ready:
        """Before this node's workers start: its own caches when it has any, else (with
        ``share``, once the job has shared its caches) a peer's archive (``from_peer``) or the
        checkpoint directory's unpacked into them."""
        started = time.monotonic()
        files, size = contents(self.caches)
        if files:
            return Ready("local", files, size, time.monotonic() - started)
        if self.shared is None:
            return Ready("none", 0, 0, time.monotonic() - started)
        problem = None
        if from_peer is not None and (self.shared / POINTER_FILE).exists():  # the job has shared caches: ask a peer
            incoming = Path(tempfile.mkdtemp(dir=_made(self.caches.parent), prefix=".peer-incoming-"))
            try:
                from_peer(incoming)
                files, size = unpack(incoming, self.caches)
                if files:
                    return Ready("peer", files, size, time.monotonic() - started)
            except CompileCacheError as exc:
                problem = f"from a peer: {exc}"
            finally:
                shutil.rmtree(incoming, ignore_errors=True)
        try:
            files, size = unpack(self.shared, self.caches)
        except CompileCacheError as exc:
            return Ready("none", 0, 0, time.monotonic() - started, problem="; ".join(filter(None, [problem, str(exc)])))
        return Ready("snapshot" if files else "none", files, size, time.monotonic() - started, problem=problem)

    def share_if_changed(self, on_done: Callable[[Shared | None, str | None], None]) -> None:
        """(The round's leader, after a commit.) Pack this node's caches in the background when
        they changed since the last pack (and no pack is running); ``on_done(shared, problem)``
        after a pack."""
        if self.shared is None or (self._packing is not None and self._packing.is_alive()):
            return
        self._packing = threading.Thread(target=self._share, args=(self.shared, on_done),
                                         name="torchrevive-compile-cache", daemon=True)
        self._packing.start()

    def _share(self, shared: Path, on_done: Callable[[Shared | None, str | None], None]) -> None:
        fingerprint = _fingerprint(self.caches)
        if fingerprint is None or fingerprint == self._packed:
            return
        try:
            result = pack(self.caches, [shared, *([self.served] if self.served else [])])
        except OSError as exc:
            on_done(None, f"cannot keep this node's compile caches beside the snapshots: {exc}")
            return
        self._packed = fingerprint
        on_done(result, None)


def contents(caches: Path) -> tuple[int, int]:
    """The files under ``caches`` that would be shared, and their bytes (0, 0 when it is absent)."""
    files = size = 0
    for path in _shared_files(caches):
        with contextlib.suppress(FileNotFoundError):
            size += path.lstat().st_size
            files += 1
    return files, size


def pack(caches: Path, destinations: list[Path]) -> Shared:
    """Write ``caches`` (less :data:`LEFT_OUT`) as ``<sha256>.tar`` into each of ``destinations``
    (packed once, into the first) and point its ``current.json`` at it; archives older than the one
    it replaces go."""
    started = time.monotonic()
    shared = destinations[0]
    shared.mkdir(parents=True, exist_ok=True)
    fd, incoming = tempfile.mkstemp(dir=shared, prefix=".incoming-", suffix=".tar")
    files = 0
    try:
        with os.fdopen(fd, "wb") as raw:
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for path in _shared_files(caches):
                    try:
                        tar.add(path, arcname=str(path.relative_to(caches)), recursive=False)
                        files += 1
                    except FileNotFoundError:
                        continue  # replaced by a compile while packed: the next pack has it
            raw.flush()
            os.fsync(raw.fileno())
        digest, size = _digest(Path(incoming))
        name = f"{digest}.tar"
        os.replace(incoming, shared / name)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(incoming)
        raise
    pointer = json.dumps({"archive": name, "sha256": digest, "bytes": size, "files": files, "torch": torch.__version__})
    for destination in destinations:
        if destination != shared:
            destination.mkdir(parents=True, exist_ok=True)
            _copy_new(shared / name, destination / name)
        _point(destination, name, pointer)
    return Shared(name, size, files, time.monotonic() - started)


def _copy_new(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` (unless it is there: archives are named by their bytes)."""
    if target.exists():
        return
    incoming = target.with_name(f".incoming-{os.getpid()}-{target.name}")
    shutil.copyfile(source, incoming)
    os.replace(incoming, target)


def _point(shared: Path, name: str, pointer: str) -> None:
    """Make ``shared/current.json`` the ``pointer`` to ``name``; archives before the one it named go."""
    previous = _pointed(shared)
    write_file(shared / POINTER_FILE, pointer)
    for old in shared.glob("*.tar"):
        if old.name not in (name, previous):
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
    fsync_dir(shared)


def fetch_shared(get: Callable[..., int], into: Path) -> None:
    """Copy a peer's shared caches into ``into`` with ``get(path, destination, max_bytes=...)`` (a
    :class:`~agent.memory.peer_files.PeerFileClient`'s): its pointer, then the archive the pointer
    names. :func:`unpack` checks them as it checks the checkpoint directory's."""
    get(f"{SHARED_DIR}/{POINTER_FILE}", into / POINTER_FILE, max_bytes=1 << 16)
    name = _pointed(into)
    if not isinstance(name, str) or not _ARCHIVE_NAME.match(name):
        raise CompileCacheError(f"the peer's {SHARED_DIR}/{POINTER_FILE} names no archive of this form (<sha256>.tar)")
    get(f"{SHARED_DIR}/{name}", into / name, max_bytes=MAX_ARCHIVE_BYTES)


def _made(path: Path) -> Path:
    """``path``, made (with its parents) if it was not there."""
    path.mkdir(parents=True, exist_ok=True)
    return path


def unpack(shared: Path, caches: Path, *, max_bytes: int = MAX_ARCHIVE_BYTES) -> tuple[int, int]:
    """Unpack the archive ``shared/current.json`` names into ``caches`` (absent or empty); its
    files and bytes, (0, 0) when there is no archive. CompileCacheError when it is not taken."""
    pointer_file = shared / POINTER_FILE
    try:
        pointer = json.loads(pointer_file.read_text())
    except FileNotFoundError:
        return 0, 0
    except (OSError, ValueError) as exc:
        raise CompileCacheError(f"{pointer_file}: unreadable ({exc}); the workers compile from scratch") from None
    name = pointer.get("archive") if isinstance(pointer, dict) else None
    if not isinstance(name, str) or not _ARCHIVE_NAME.match(name) or pointer.get("sha256") != name[:-4]:
        raise CompileCacheError(f"{pointer_file}: names no archive of this form (<sha256>.tar); the workers compile "
                                "from scratch")
    if pointer.get("torch") != torch.__version__:
        raise CompileCacheError(f"{pointer_file}: caches of torch {pointer.get('torch')}, not {torch.__version__} as "
                                "here; the workers compile from scratch")
    archive = shared / name
    try:
        size = archive.stat().st_size
        if size > max_bytes:
            raise CompileCacheError(f"{archive}: {size} bytes, above the {max_bytes} taken")
        digest, _ = _digest(archive)
    except OSError as exc:
        raise CompileCacheError(f"{archive}: unreadable ({exc})") from None
    if digest != pointer["sha256"]:
        raise CompileCacheError(f"{archive}: its bytes do not match the digest {pointer_file} names (torn or "
                                "corrupt); the workers compile from scratch")
    incoming = Path(tempfile.mkdtemp(dir=_made(caches.parent), prefix=".inductor-incoming-"))
    try:
        files, unpacked = _extract(archive, incoming, max_bytes)
        with contextlib.suppress(OSError):
            caches.rmdir()  # empty (or absent): an unpack fills only caches that hold nothing
        try:
            os.rename(incoming, caches)
        except OSError as exc:
            raise CompileCacheError(f"{caches}: not empty any more ({exc}); kept as it is") from None
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    return files, unpacked


def _extract(archive: Path, into: Path, max_bytes: int) -> tuple[int, int]:
    """Extract ``archive``'s regular files and folders into ``into``; their count and bytes."""
    try:
        with tarfile.open(archive, mode="r:") as tar:
            members = tar.getmembers()
            for member in members:
                if not (member.isfile() or member.isdir()):
                    raise CompileCacheError(f"{archive}: {member.name!r} is neither a file nor a folder")
                if member.name.startswith("/") or ".." in PurePosixPath(member.name).parts:
                    raise CompileCacheError(f"{archive}: {member.name!r} is not a path inside the caches")
            total = sum(m.size for m in members if m.isfile())
            if total > max_bytes:
                raise CompileCacheError(f"{archive}: {total} bytes unpacked, above the {max_bytes} taken")
            tar.extractall(into, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise CompileCacheError(f"{archive}: cannot be unpacked ({exc}); the workers compile from scratch") from None
    return sum(1 for m in members if m.isfile()), total


def _shared_files(caches: Path) -> list[Path]:
    """The regular files under ``caches`` that are shared (none when it is absent)."""
    found = []
    for root, dirs, names in os.walk(caches):
        if Path(root) == caches:
            dirs[:] = [d for d in dirs if d not in LEFT_OUT]
        found.extend(Path(root, name) for name in names if Path(root, name).is_file()
                     and not Path(root, name).is_symlink())
    return sorted(found)


def _fingerprint(caches: Path) -> int | None:
    """A hash of the shared files' names, sizes and times; None when there are none."""
    entries = []
    for path in _shared_files(caches):
        with contextlib.suppress(FileNotFoundError):
            info = path.stat()
            entries.append((str(path), info.st_size, info.st_mtime_ns))
    return hash(tuple(entries)) if entries else None


def _pointed(shared: Path) -> str | None:
    """The archive ``shared/current.json`` names now, if any."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads((shared / POINTER_FILE).read_text()).get("archive")
    return None


def _digest(path: Path) -> tuple[str, int]:
    """SHA-256 of the file at ``path`` (hex) and its size."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            sha.update(chunk)
            size += len(chunk)
    return sha.hexdigest(), size
