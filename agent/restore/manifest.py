"""Snapshot metadata -> the entries one rank restores, and each tensor entry's stored chunks.

The metadata is read into torchsnapshot's own classes (``SnapshotMetadata`` and its entry
classes' ``from_yaml_obj``) and checked once (:mod:`agent.restore.metadata_checks`): everything downstream
trusts what passed. This module picks a rank's entries and turns tensor entries into boxes of bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torchsnapshot.manifest import (
    ChunkedTensorEntry,
    DictEntry,
    DTensorEntry,
    Entry,
    ListEntry,
    ObjectEntry,
    OrderedDictEntry,
    PrimitiveEntry,
    ShardedTensorEntry,
    SnapshotMetadata,
    TensorEntry,
)
from torchsnapshot.manifest_utils import is_fully_replicated_entry
from torchsnapshot.serialization import Serializer, string_to_dtype

from agent.errors import RestoreError
from agent.restore.locations import check_locations
from agent.restore.metadata_checks import check_metadata

METADATA_FILE = ".snapshot_metadata"
TENSOR_ENTRY_TYPES = (TensorEntry, ChunkedTensorEntry, DTensorEntry, ShardedTensorEntry)
ENTRY_TYPES: dict[str, type[Entry]] = {
    "list": ListEntry, "dict": DictEntry, "OrderedDict": OrderedDictEntry, "Tensor": TensorEntry,
    "ShardedTensor": ShardedTensorEntry, "ChunkedTensor": ChunkedTensorEntry, "DTensor": DTensorEntry,
    "object": ObjectEntry, **dict.fromkeys(PrimitiveEntry.supported_types, PrimitiveEntry),
}
"""torchsnapshot's entry class for each ``type`` a manifest entry names."""


@dataclass(frozen=True)
class StoredChunk:
    """A row-major block of a global tensor, stored contiguously in one file.

    ``offsets``/``sizes`` place the block in the global tensor; ``byte_offset`` is where it
    starts in ``location`` (relative to the snapshot directory).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    location: str
    byte_offset: int
    byte_length: int
    dtype: torch.dtype
    serializer: str

    @property
    def raw(self) -> bool:
        """Whether the bytes are the tensor's memory as is (else a torch.save payload)."""
        return self.serializer == Serializer.BUFFER_PROTOCOL.value


@dataclass(frozen=True)
class StoredTensor:
    """A tensor as stored: global shape, dtype, chunks, and whether every rank wrote the same."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[StoredChunk, ...]
    replicated: bool


def load_metadata(snapshot: Path) -> SnapshotMetadata:
    """Read and parse ``<snapshot>/.snapshot_metadata``; every file it names must lie inside
    ``snapshot`` (see :mod:`agent.restore.locations`)."""
    path = snapshot / METADATA_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        hint = "the directory does not exist" if not snapshot.exists() else "the snapshot is incomplete or not a snapshot"
        raise RestoreError(f"{path}: missing ({hint}); restore another snapshot") from None
    try:
        metadata = parse_metadata(text)
    except Exception as exc:  # the JSON or YAML parser, or an entry class, raises whatever it raises
        raise RestoreError(f"{path}: unreadable snapshot metadata ({type(exc).__name__}: {exc}); restore another snapshot") from exc
    check_metadata(metadata, named_in=path)
    stored_in = holders(metadata)
    check_locations(snapshot, {location: keys[0] for location, keys in stored_in.items()}, named_in=path)
    return metadata


def parse_metadata(text: str) -> SnapshotMetadata:
    """The metadata in ``text``. torchsnapshot writes it as JSON and reads it back with a YAML
    parser (JSON is YAML), which takes ~50x longer (docs/measurements.md#restore has the figures), paid
    by every rank at every restore. JSON is read as JSON here; other text (a snapshot an older
    torchsnapshot wrote as YAML) by torchsnapshot."""
    try:
        document = json.loads(text)
    except ValueError:
        return SnapshotMetadata.from_yaml(text)
    manifest: dict[str, Entry] = {}
    for path, entry in document["manifest"].items():
        kind = ENTRY_TYPES.get(entry["type"])
        if kind is None:
            raise ValueError(f"manifest entry {path!r} has the unknown type {entry['type']!r}")
        manifest[path] = kind.from_yaml_obj(entry)
    return SnapshotMetadata(**{**document, "manifest": manifest})


def manifest_for_rank(metadata: SnapshotMetadata, rank: int) -> dict[str, Entry]:
    """The entries ``rank`` restores, by logical path ("model/0.weight"): its own per-rank
    entries, the fully replicated ones (written once, by rank 0), and every sharded tensor with
    the shards of all ranks merged (each distinct box once), whichever ranks wrote it: a shard that
    several ranks hold is written by one of them (under FSDP2 over tensor parallelism, a parameter
    that TP leaves whole is held alike by every TP rank of a data-parallel shard).

    A rank that did not exist when the snapshot was written takes rank 0's per-rank entries
    (optimizer param groups, step counters: the same on every rank of a data- or fully-sharded-
    parallel job). torchsnapshot's own ``get_manifest_for_rank`` drops them for a new rank, and
    fails on fully replicated DTensors for ranks other than 0.
    """
    per_rank: list[dict[str, Entry]] = [{} for _ in range(metadata.world_size)]
    for path, entry in metadata.manifest.items():
        writer, _, logical_path = path.partition("/")
        per_rank[int(writer)][logical_path] = entry
    view = dict(per_rank[rank] if rank < metadata.world_size else per_rank[0])
    for logical_path, entry in per_rank[0].items():
        if is_fully_replicated_entry(entry):
            view.setdefault(logical_path, entry)
    sharded = {logical_path for manifest in per_rank for logical_path, entry in manifest.items()
               if isinstance(entry, (DTensorEntry, ShardedTensorEntry)) and not is_fully_replicated_entry(entry)}
    for logical_path in sharded:
        view[logical_path] = _merged(logical_path, per_rank)
    return view


def _merged(logical_path: str, per_rank: list[dict[str, Entry]]) -> Entry:
    first = next(m[logical_path] for m in per_rank if logical_path in m)
    shards = {}
    for manifest in per_rank:
        for shard in getattr(manifest.get(logical_path), "shards", []):
            shards.setdefault((tuple(shard.offsets), tuple(shard.sizes)), shard)
    ordered = [shards[box] for box in sorted(shards)]
    if isinstance(first, DTensorEntry):
        return DTensorEntry(shards=ordered, mesh=first.mesh, dim_map=first.dim_map)
    return ShardedTensorEntry(shards=ordered)


def stored_tensor(entry: Entry) -> StoredTensor:
    """The stored chunks of a tensor entry of any kind."""
    if isinstance(entry, TensorEntry):
        shape = tuple(entry.shape)
        return StoredTensor(shape, string_to_dtype(entry.dtype), (_chunk(entry, (0,) * len(shape), shape),), entry.replicated)
    if isinstance(entry, ChunkedTensorEntry):
        chunks = tuple(_chunk(c.tensor, tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        return StoredTensor(tuple(entry.shape), string_to_dtype(entry.dtype), chunks, entry.replicated)
    if isinstance(entry, (DTensorEntry, ShardedTensorEntry)):
        if not entry.shards:
            raise RestoreError("a sharded tensor with no stored shard (every shard was empty)")
        chunks = tuple(_chunk(s.tensor, tuple(s.offsets), tuple(s.sizes)) for s in entry.shards)
        return StoredTensor(_global_shape(chunks), chunks[0].dtype, chunks, False)
    raise AssertionError(f"not a tensor entry: {type(entry).__name__}")


def fitted(chunk: StoredChunk, file_size: int) -> StoredChunk:
    """The chunk with the length of a whole-file chunk filled in; ValueError when the file is too
    short to hold it."""
    if chunk.byte_length < 0:
        chunk = replace(chunk, byte_length=file_size - chunk.byte_offset)
    needed = chunk.byte_length if not chunk.raw else max(chunk.byte_length, math.prod(chunk.sizes) * chunk.dtype.itemsize)
    if chunk.byte_offset + needed > file_size:
        raise ValueError(f"truncated ({file_size} bytes; needs bytes {chunk.byte_offset}..{chunk.byte_offset + needed})")
    return chunk


def holders(metadata: SnapshotMetadata) -> dict[str, list[str]]:
    """File (relative location) -> the manifest keys stored in it."""
    found: dict[str, list[str]] = {}
    for key, entry in metadata.manifest.items():
        locations = [entry.location] if hasattr(entry, "location") else []
        if isinstance(entry, TENSOR_ENTRY_TYPES) and not isinstance(entry, TensorEntry):
            locations = [c.tensor.location for c in getattr(entry, "chunks", None) or entry.shards]
        for location in locations:
            found.setdefault(location, []).append(key)
    return found


def _global_shape(chunks: tuple[StoredChunk, ...]) -> tuple[int, ...]:
    return tuple(max(c.offsets[d] + c.sizes[d] for c in chunks) for d in range(len(chunks[0].offsets)))


def _chunk(entry: TensorEntry, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> StoredChunk:
    dtype = string_to_dtype(entry.dtype)
    if entry.byte_range is not None:
        start, end = entry.byte_range
    else:
        start, end = 0, -1  # the whole file; its size is checked when planning
    return StoredChunk(
        offsets=offsets,
        sizes=sizes,
        location=entry.location,
        byte_offset=start,
        byte_length=end - start if end >= 0 else -1,
        dtype=dtype,
        serializer=entry.serializer,
    )
