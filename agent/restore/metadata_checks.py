"""Snapshot metadata that torchsnapshot cannot have written is refused, once, where it is loaded.

The metadata is data from storage, damaged or crafted, and everything downstream trusts what
passes here: the plan's boxes and byte ranges, and the reader's positional reads straight into
tensor memory. So every field is checked for its type, and every chunk against its tensor (dtype,
rank, box inside the shape, byte range exactly the chunk's bytes, serializer), and the chunks of
each tensor against each other (they tile it: no element stored twice or never), before a byte is
read. A refusal is one RestoreError naming the metadata file and the key, which the
Checkpointer's fallback catches to restore the previous snapshot.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    Shard,
    ShardedTensorEntry,
    SnapshotMetadata,
    TensorEntry,
)
from torchsnapshot.manifest_utils import is_fully_replicated_entry
from torchsnapshot.serialization import BUFFER_PROTOCOL_SUPPORTED_DTYPES, Serializer, string_to_dtype

from agent.errors import RestoreError

SERIALIZERS = frozenset({Serializer.BUFFER_PROTOCOL.value, Serializer.TORCH_SAVE.value})
"""The serializers torchsnapshot writes tensors and objects with."""
MAX_INDEX = 1 << 62
"""Sizes, offsets and byte positions above this are no real tensor's (torch's are int64)."""
_WRITER = re.compile(r"[0-9]+")


class _Damaged(ValueError):
    """What is wrong with one manifest entry (becomes a RestoreError naming the file and key)."""


def check_metadata(metadata: SnapshotMetadata, *, named_in: Path) -> None:
    """Refuse metadata that torchsnapshot cannot have written (see :func:`metadata_problem`) with
    a RestoreError naming ``named_in`` and the key, so that the caller falls back to another
    snapshot; no byte was read or copied."""
    problem = metadata_problem(metadata)
    if problem is not None:
        raise RestoreError(f"{named_in}: {problem}; the snapshot is damaged or crafted: restore another one")


def metadata_problem(metadata: SnapshotMetadata) -> str | None:
    """What torchsnapshot cannot have written in ``metadata``, naming the key, else None: a world
    size that is no number of ranks, a key that names no rank of it, a field of the wrong type,
    a tensor whose chunks disagree with it (another dtype or rank, a box outside its shape, a
    byte range that is not the chunk's bytes, an unknown serializer), or whose chunks (every
    rank's distinct boxes for a sharded one) do not tile it: two overlap, or some elements are in
    none."""
    world_size = metadata.world_size
    if type(world_size) is not int or not 0 < world_size <= MAX_INDEX:
        return f"world_size {world_size!r} is not a number of ranks"
    sharded: dict[str, tuple[torch.dtype, int]] = {}
    shards_of: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], _Piece]] = {}
    for key, entry in metadata.manifest.items():
        try:
            logical_path = _logical_path(key, world_size)
            _check_entry(entry)
            if isinstance(entry, (DTensorEntry, ShardedTensorEntry)) and entry.shards:
                # manifest_for_rank merges every rank's shards of a path into one tensor
                kind = (string_to_dtype(entry.shards[0].tensor.dtype), len(entry.shards[0].sizes))
                seen = sharded.setdefault(logical_path, kind)
                if seen != kind:
                    raise _Damaged(f"has shards of dtype {kind[0]} and {kind[1]} dimensions where another "
                                   f"rank's have {seen[0]} and {seen[1]}")
                if not is_fully_replicated_entry(entry):  # merged as manifest_for_rank does: each box once
                    boxes = shards_of.setdefault(logical_path, {})
                    for shard in entry.shards:
                        piece = _Piece(f"rank {key.partition('/')[0]}'s shard", tuple(shard.offsets), tuple(shard.sizes))
                        boxes.setdefault((piece.offsets, piece.sizes), piece)
            elif isinstance(entry, ChunkedTensorEntry):
                _check_tiling([_Piece("a chunk", tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks],
                              tuple(entry.shape))
        except _Damaged as exc:
            return f"{key!r} {exc}"
    for logical_path, boxes in shards_of.items():
        pieces = list(boxes.values())
        extent = tuple(max(p.offsets[d] + p.sizes[d] for p in pieces) for d in range(len(pieces[0].offsets)))
        try:
            _check_tiling(pieces, extent)
        except _Damaged as exc:
            return f"the sharded tensor '{logical_path}' {exc}"
    return None


@dataclass(frozen=True)
class _Piece:
    """One stored box of a tensor, and whose it is (for the message)."""

    owner: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def overlaps(self, other: _Piece) -> bool:
        return all(max(a, b) < min(a + n, b + m)
                   for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes))


def _check_tiling(pieces: list[_Piece], shape: tuple[int, ...]) -> None:
    """The pieces (inside ``shape``, checked already) hold every element of it exactly once. A
    sweep along dimension 0: a piece is compared only with those whose rows it shares (for shards
    along dimension 0, the one before it)."""
    stored = sum(math.prod(p.sizes) for p in pieces)
    ordered = sorted((p for p in pieces if math.prod(p.sizes)), key=lambda p: p.offsets)
    if len(shape) > 0:
        open_pieces: list[_Piece] = []
        for piece in ordered:
            open_pieces = [p for p in open_pieces if p.offsets[0] + p.sizes[0] > piece.offsets[0]]
            for other in open_pieces:
                if other.overlaps(piece):
                    raise _Damaged(f"has {other.owner} at offsets {list(other.offsets)} of sizes {list(other.sizes)} "
                                   f"and {piece.owner} at offsets {list(piece.offsets)} of sizes "
                                   f"{list(piece.sizes)}, which overlap")
            open_pieces.append(piece)
    if stored != math.prod(shape):
        raise _Damaged(f"has chunks holding {stored} of its {math.prod(shape)} elements (shape {list(shape)})")


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise _Damaged(problem)


def _logical_path(key: Any, world_size: int) -> str:
    """The logical path of a manifest key "<writer rank>/<path>"."""
    _require(isinstance(key, str), "is not a key of the form <rank>/<path>")
    writer, _, logical_path = key.partition("/")
    _require(bool(_WRITER.fullmatch(writer)) and bool(logical_path), "is not a key of the form <rank>/<path>")
    if int(writer) >= world_size:
        raise _Damaged(f"names rank {writer} of a snapshot written by {world_size} ranks")
    return logical_path


def _check_entry(entry: Entry) -> None:
    if isinstance(entry, TensorEntry):
        _check_tensor(entry)
    elif isinstance(entry, ChunkedTensorEntry):
        _require(type(entry.replicated) is bool, "has a 'replicated' that is neither true nor false")
        shape = _sizes(entry.shape, "shape")
        dtype = _dtype(entry.dtype)
        _require(bool(_listed(entry.chunks, "chunks")), "is a chunked tensor without chunks")
        for chunk in entry.chunks:
            _check_piece(chunk, dtype, len(shape))
            if not all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)):
                raise _Damaged(f"has a chunk at offsets {chunk.offsets} of sizes {chunk.sizes} outside its shape "
                               f"{list(shape)}")
    elif isinstance(entry, (DTensorEntry, ShardedTensorEntry)):
        shards = _listed(entry.shards, "shards")
        if shards:  # torchsnapshot's parser makes each a Shard holding a TensorEntry
            dtype, ndim = _dtype(shards[0].tensor.dtype), len(_sizes(shards[0].sizes, "sizes"))
            for shard in shards:
                _check_piece(shard, dtype, ndim)
        if isinstance(entry, DTensorEntry):
            _require(isinstance(entry.dim_map, list) and all(
                isinstance(dims, list) and dims and all(type(d) is int for d in dims) for dims in entry.dim_map),
                "has a 'dim_map' that is not a list of lists of mesh dimensions")
    elif isinstance(entry, ObjectEntry):
        _require(isinstance(entry.location, str), "has a location that is not a file name")
        if entry.serializer != Serializer.TORCH_SAVE.value:
            raise _Damaged(f"has serializer {entry.serializer!r}, not one torchsnapshot writes objects with")
        _require(type(entry.replicated) is bool, "has a 'replicated' that is neither true nor false")
    elif isinstance(entry, PrimitiveEntry):
        _require(isinstance(entry.serialized_value, str) and type(entry.replicated) is bool,
                 "is a primitive with fields of the wrong types")
        try:
            entry.get_value()
        except Exception as exc:  # int(), base64 and struct raise what a damaged value makes them hit
            raise _Damaged(f"holds no {entry.type} ({type(exc).__name__}: {exc})") from None
    elif isinstance(entry, (DictEntry, OrderedDictEntry)):
        _require(isinstance(entry.keys, list) and all(isinstance(k, (str, int)) for k in entry.keys),
                 "is a dict whose keys are not a list of names")
    elif not isinstance(entry, ListEntry):
        raise _Damaged(f"has an entry of type {type(entry).__name__}")


def _check_piece(piece: Shard, dtype: torch.dtype, ndim: int) -> None:
    """A chunk or shard: its box has the tensor's rank, and its stored tensor is that box, of the
    tensor's dtype."""
    _require(isinstance(piece, Shard), "has a chunk that is not a box of the tensor")
    offsets, sizes = _sizes(piece.offsets, "offsets"), _sizes(piece.sizes, "sizes")
    if not len(offsets) == len(sizes) == ndim:
        raise _Damaged(f"has a chunk with offsets {list(offsets)} and sizes {list(sizes)} in a tensor of {ndim} "
                       "dimensions")
    _check_tensor(piece.tensor)
    if tuple(piece.tensor.shape) != sizes:
        raise _Damaged(f"has a chunk of sizes {list(sizes)} that stores a tensor of shape {piece.tensor.shape}")
    chunk_dtype = _dtype(piece.tensor.dtype)
    if chunk_dtype != dtype:
        raise _Damaged(f"has a chunk of dtype {chunk_dtype} in a tensor of dtype {dtype}")


def _check_tensor(entry: Any) -> None:
    """A stored tensor: fields of the right types, a known serializer, and a byte range that is
    its bytes (exactly, when they are its memory as is)."""
    _require(isinstance(entry, TensorEntry), "has a chunk that is not a stored tensor")
    _require(isinstance(entry.location, str), "has a location that is not a file name")
    if not (isinstance(entry.serializer, str) and entry.serializer in SERIALIZERS):
        raise _Damaged(f"has serializer {entry.serializer!r}, not one torchsnapshot writes")
    _require(type(entry.replicated) is bool, "has a 'replicated' that is neither true nor false")
    dtype, shape = _dtype(entry.dtype), _sizes(entry.shape, "shape")
    raw = entry.serializer == Serializer.BUFFER_PROTOCOL.value
    if raw and dtype not in BUFFER_PROTOCOL_SUPPORTED_DTYPES:
        raise _Damaged(f"stores {dtype} as raw bytes")
    if entry.byte_range is not None:
        byte_range = _sizes(entry.byte_range, "byte_range")
        if not (len(byte_range) == 2 and byte_range[0] <= byte_range[1]):
            raise _Damaged(f"has a byte_range {entry.byte_range} that is no range of bytes")
        nbytes = math.prod(shape) * dtype.itemsize
        if raw and byte_range[1] - byte_range[0] != nbytes:
            raise _Damaged(f"has a byte_range {list(byte_range)} of {byte_range[1] - byte_range[0]} bytes for a "
                           f"{dtype} tensor of shape {list(shape)} ({nbytes} bytes)")


def _sizes(values: Any, what: str) -> tuple[int, ...]:
    """``values`` (sizes, offsets or byte positions) as a tuple, when it is a list of ints from 0
    to MAX_INDEX."""
    if not (isinstance(values, (list, tuple)) and all(type(v) is int and 0 <= v <= MAX_INDEX for v in values)):
        raise _Damaged(f"has {what} {values!r:.80}, not a list of sizes")
    return tuple(values)


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, str):
        try:
            return string_to_dtype(name)
        except ValueError:
            pass
    raise _Damaged(f"has dtype {name!r:.40}, not one torchsnapshot writes")


def _listed(values: Any, what: str) -> Sequence[Any]:
    if not isinstance(values, list):
        raise _Damaged(f"has {what} that are not a list")
    return values
