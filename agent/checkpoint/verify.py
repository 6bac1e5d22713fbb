"""`torchrevive verify`: check a whole snapshot on storage, without restoring it.

Every file the metadata names must exist and hold its chunks' bytes; when the snapshot has a
checksum record (committed by the Checkpointer), every block of every file must match it. A plain
torchsnapshot snapshot has no record: only its structure is checked, and the report says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent.checkpoint.checksums import ChecksumError, Checksums, check_sizes, load_checksums, verify_blocks
from agent.errors import RestoreError
from agent.restore.manifest import (
    TENSOR_ENTRY_TYPES,
    fitted,
    holders,
    load_metadata,
    stored_tensor,
)


@dataclass(frozen=True)
class CheckReport:
    """What a check covered."""

    files: int
    bytes_checked: int
    checksummed: bool


def check_snapshot(path: Path, *, threads: int = 4, progress: Callable[[int], None] | None = None,
                   on_total: Callable[[int], None] | None = None) -> CheckReport:
    """Check ``path``; raise RestoreError (ChecksumError for bad bytes) naming the first bad file
    and what it holds. ``on_total`` learns the bytes that will be hashed, before any is."""
    structure = check_structure(path)
    if structure.checksums is None:
        return CheckReport(len(structure.stored_in), 0, checksummed=False)
    if on_total is not None:
        on_total(structure.checksums.total_bytes)
    wanted = {name: range(len(digest.blocks)) for name, digest in structure.checksums.files.items()}
    checked = verify_blocks(path, structure.checksums, wanted, structure.describe, threads=threads, progress=progress)
    return CheckReport(len(wanted), checked, checksummed=True)


@dataclass(frozen=True)
class Structure:
    """A snapshot whose structure checked out: which keys each file holds, its checksum record."""

    stored_in: dict[str, list[str]]
    checksums: Checksums | None

    def describe(self, location: str) -> str:
        """What a file holds, for an error message."""
        keys = self.stored_in.get(location, [])
        held = f"'{keys[0]}'" + (f" and {len(keys) - 1} more" if len(keys) > 1 else "") if keys else "no manifest key"
        return f"it holds {held}"


def check_structure(path: Path) -> Structure:
    """What can be checked without reading the data (file sizes only, no hashing): the metadata
    loads, every file it names is there and long enough for its chunks, and with a checksum
    record, the record covers every such file and each file it lists has its committed size.
    RestoreError (ChecksumError against the record) naming the first bad file."""
    metadata = load_metadata(path)
    for key, entry in metadata.manifest.items():
        if not isinstance(entry, TENSOR_ENTRY_TYPES) or not getattr(entry, "shards", True):
            continue
        for chunk in stored_tensor(entry).chunks:
            location = path / chunk.location
            try:
                fitted(chunk, location.stat().st_size)
            except FileNotFoundError:
                raise RestoreError(f"{location}: missing, needed by '{key}'") from None
            except ValueError as exc:
                raise RestoreError(f"{location}: {exc} for '{key}'") from None
    structure = Structure(holders(metadata), load_checksums(path))
    if structure.checksums is not None:
        missing = sorted(set(structure.stored_in) - set(structure.checksums.files))
        if missing:
            raise ChecksumError(f"{path / missing[0]}: has no checksum; {structure.describe(missing[0])}")
        check_sizes(path, structure.checksums, structure.checksums.files, structure.describe)
    return structure
