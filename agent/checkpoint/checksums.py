"""Block checksums of a snapshot's files: computed when a snapshot is committed, checked by
restore (``verify``) and by ``torchrevive verify``.

Each file is cut into blocks of ``block_bytes``; each block's xxh3-64 digest is kept in
``<snapshot>/.torchrevive_checksums.json``, with the file's size. Blocks rather than whole files,
so that a rank that restores a slice of a large file checks only the blocks it reads.
"""

from __future__ import annotations

import functools
import json
import mmap
import os
import threading
import zlib
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import xxhash

from agent.errors import RestoreError, SnapshotUnreadableError
from agent.restore.locations import check_locations

CHECKSUMS_FILE = ".torchrevive_checksums.json"
ALGORITHM = "xxh3_64"
BLOCK_BYTES = 4 << 20
SAMPLE_EVERY = 32
"""``verify="sample"`` checks one block in this many (and every file's size)."""


class ChecksumError(RestoreError):
    """A snapshot file is missing, truncated, or its bytes do not match their checksum."""


@dataclass(frozen=True)
class FileDigest:
    """One file's size and the digests of its blocks, in order."""

    size: int
    blocks: tuple[str, ...]


@dataclass(frozen=True)
class Checksums:
    """A snapshot's checksum record: relative file path -> FileDigest."""

    block_bytes: int
    files: dict[str, FileDigest]

    def blocks_of(self, location: str, start: int, end: int) -> range:
        """The indexes of the blocks holding bytes ``start``..``end`` (exclusive) of a file."""
        if end <= start:
            return range(0)
        return range(start // self.block_bytes, (end - 1) // self.block_bytes + 1)

    def block_range(self, location: str, block: int) -> tuple[int, int]:
        """The bytes ``lo``..``hi`` (exclusive) of a file that block ``block`` covers."""
        lo = block * self.block_bytes
        return lo, min(lo + self.block_bytes, self.files[location].size)

    @property
    def total_bytes(self) -> int:
        return sum(d.size for d in self.files.values())


def data_files(root: Path, *, skip: Iterable[str] = ()) -> list[str]:
    """Every file of a snapshot directory, relative and sorted, but the checksum record and ``skip``."""
    excluded = {CHECKSUMS_FILE, *skip}
    found = []
    for directory, _, names in os.walk(root):
        for name in names:
            relative = os.path.relpath(os.path.join(directory, name), root)
            if relative not in excluded:
                found.append(relative)
    return sorted(found)


def digest_file(path: Path, block_bytes: int = BLOCK_BYTES) -> FileDigest:
    """Hash a file block by block (mmap'ed: no copy through Python buffers)."""
    if path.stat().st_size == 0:
        return FileDigest(0, ())
    with _mapped(path) as view:
        return digest_buffer(view, block_bytes)


def digest_buffer(view: memoryview, block_bytes: int = BLOCK_BYTES) -> FileDigest:
    """The digest of a file's bytes held in memory (the writer's buffer, or a mapping)."""
    size = len(view)
    return FileDigest(size, tuple(_digest(view, lo, min(lo + block_bytes, size)) for lo in range(0, size, block_bytes)))


def digest_files(root: Path, relatives: Iterable[str], *, threads: int = 4) -> dict[str, FileDigest]:
    """Digest several files of ``root`` in parallel (xxhash releases the GIL)."""
    relatives = list(relatives)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return dict(zip(relatives, pool.map(lambda r: digest_file(root / r), relatives)))


def write_checksums(root: Path, files: dict[str, FileDigest], *, block_bytes: int = BLOCK_BYTES) -> None:
    """Write the record: a temporary file, fsync'ed, renamed into place (the commit marker written
    next fsyncs the directory once for both)."""
    record = {
        "algorithm": ALGORITHM,
        "block_bytes": block_bytes,
        "files": {name: {"size": d.size, "blocks": list(d.blocks)} for name, d in sorted(files.items())},
    }
    tmp = root / (CHECKSUMS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / CHECKSUMS_FILE)


def load_checksums(root: Path) -> Checksums | None:
    """The snapshot's checksum record, or None when it has none (a plain torchsnapshot snapshot)."""
    path = root / CHECKSUMS_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SnapshotUnreadableError(f"{path}: cannot read the checksum record ({exc}); retry once the storage "
                                      "answers") from exc
    except ValueError as exc:
        raise ChecksumError(f"{path}: unreadable checksum record ({exc}); the snapshot is damaged") from exc
    algorithm = record.get("algorithm") if isinstance(record, dict) else None
    if algorithm != ALGORITHM:
        raise SnapshotUnreadableError(f"{path}: checksums use {algorithm!r}; this torchrevive reads {ALGORITHM} "
                                      "(a newer torchrevive wrote it? restore it with that version)")
    try:
        files = {str(name): FileDigest(int(d["size"]), tuple(str(b) for b in d["blocks"]))
                 for name, d in record["files"].items()}
        block_bytes = int(record["block_bytes"])
        if block_bytes <= 0:
            raise ValueError(f"block_bytes {block_bytes} is not positive")
        for name, digest in files.items():
            if digest.size < 0 or len(digest.blocks) != -(-digest.size // block_bytes):
                raise ValueError(f"'{name}' has {len(digest.blocks)} block checksums for {digest.size} bytes")
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ChecksumError(f"{path}: malformed checksum record ({type(exc).__name__}: {exc}); the snapshot is "
                            "damaged") from None
    check_locations(root, dict.fromkeys(files, "files"), named_in=path)
    return Checksums(block_bytes, files)


def sample(location: str, blocks: Iterable[int]) -> list[int]:
    """The blocks ``verify="sample"`` checks: one in SAMPLE_EVERY, at a per-file phase so that
    small files are sampled too (each with probability 1/SAMPLE_EVERY)."""
    phase = zlib.crc32(location.encode()) % SAMPLE_EVERY
    return [b for b in blocks if b % SAMPLE_EVERY == phase]


def check_sizes(root: Path, checksums: Checksums, locations: Iterable[str], describe: Callable[[str], str]) -> None:
    """Every file is present at its recorded size (a cheap check that catches truncation)."""
    for location in locations:
        expected = checksums.files.get(location)
        if expected is None:
            raise ChecksumError(f"{root / location}: not in the checksum record; {describe(location)}")
        try:
            size = (root / location).stat().st_size
        except FileNotFoundError:
            raise ChecksumError(f"{root / location}: missing; {describe(location)}") from None
        if size != expected.size:
            raise ChecksumError(f"{root / location}: {size} bytes, {expected.size} when committed (truncated or "
                                f"rewritten); {describe(location)}")


def block_checks(
    root: Path,
    checksums: Checksums,
    wanted: dict[str, Iterable[int]],
    describe: Callable[[str], str],
    *,
    progress: Callable[[int], None] | None = None,
) -> list[tuple[tuple[str, int], Callable[[], int]]]:
    """One check per wanted block, keyed by (file, byte offset) so that a reader can run each
    beside the copies of the same bytes; a check returns the bytes it hashed, or raises
    ChecksumError naming the file, the byte range and (through ``describe``) what it holds.
    File sizes are checked here, at once."""
    check_sizes(root, checksums, wanted, describe)

    def check(location: str, block: int) -> int:
        lo, hi = checksums.block_range(location, block)
        with _read_block(root / location, lo, hi, describe(location)) as view:
            actual = xxhash.xxh3_64_hexdigest(view)
        if actual != checksums.files[location].blocks[block]:
            raise ChecksumError(f"{root / location}: bytes {lo}..{hi} do not match their checksum; "
                                f"{describe(location)}")
        if progress is not None:
            progress(hi - lo)
        return hi - lo

    return [((location, block * checksums.block_bytes), functools.partial(check, location, block))
            for location, blocks in sorted(wanted.items()) for block in sorted(set(blocks))]


def verify_blocks(
    root: Path,
    checksums: Checksums,
    wanted: dict[str, Iterable[int]],
    describe: Callable[[str], str],
    *,
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Check the ``wanted`` blocks of each file (see :func:`block_checks`); bytes checked."""
    checks = [check for _, check in block_checks(root, checksums, wanted, describe, progress=progress)]
    if not checks:
        return 0
    pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="torchrevive-verify")
    try:
        return sum(pool.map(lambda check: check(), checks))  # raises the first bad block's error, in file order
    finally:
        pool.shutdown(cancel_futures=True)


@contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """A read-only view of a whole file, mmap'ed."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapping, memoryview(mapping) as view:
        yield view


_block_buffers = threading.local()


@contextmanager
def _read_block(path: Path, lo: int, hi: int, what: str) -> Iterator[memoryview]:
    """Bytes ``lo``..``hi`` of a file, read into this thread's reused buffer. Read rather than
    mapped: a file truncated since its size was checked is a ChecksumError, not a SIGBUS."""
    buffer = getattr(_block_buffers, "buffer", None)
    if buffer is None or len(buffer) < hi - lo:
        buffer = _block_buffers.buffer = bytearray(hi - lo)
    with memoryview(buffer)[: hi - lo] as view, open(path, "rb", buffering=0) as f:
        done = 0
        while done < hi - lo and (got := os.preadv(f.fileno(), [view[done:]], lo + done)):
            done += got
        if done < hi - lo:
            raise ChecksumError(f"{path}: ends at byte {lo + done}, before {hi} (truncated while being checked); "
                                f"{what}")
        yield view


def _digest(view: memoryview, lo: int, hi: int) -> str:
    with view[lo:hi] as block:
        return xxhash.xxh3_64_hexdigest(block)
