"""Snapshot metadata that torchsnapshot cannot have written is refused, once, where it is loaded.

The metadata is data from storage, damaged or crafted, and everything downstream trusts what
passes here: the plan's boxes and byte ranges, and the reader's positional reads straight into
tensor memory. So every field is checked for its type, and every chunk against its tensor (dtype,
rank, box inside the shape, byte range exactly the chunk's bytes, serializer), before a byte is
read. A refusal is one RestoreError naming the metadata file and the key, which the
Checkpointer's fallback catches to restore the previous snapshot.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
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
    """Refuse metadata that torchsnapshot cannot have written: a world size that is no number of
    ranks, a key that names no rank of it, a field of the wrong type, and a tensor whose chunks
    disagree with it (another dtype or rank, a box outside its shape, a byte range that is not
    the chunk's bytes, an unknown serializer). A refusal is a RestoreError naming ``named_in`` and
    the key, so that the caller falls back to another snapshot; no byte was read or copied."""
    world_size = metadata.world_size
    if type(world_size) is not int or not 0 < world_size <= MAX_INDEX:
        raise RestoreError(f"{named_in}: world_size {world_size!r} is not a number of ranks; the snapshot is "
                           "damaged or crafted: restore another one")
    sharded: dict[str, tuple[torch.dtype, int]] = {}
    for key, entry in metadata.manifest.items():
        try:
            logical_path = _logical_path(key, world_size)
            _check_entry(entry)
            if isinstance(entry, (DTensorEntry, ShardedTensorEntry)) and entry.shards:
                # manifest_for_rank merges every rank's shards of a path into one tensor
                kind = (string_to_dtype(entry.shards[0].tensor.dtype), len(entry.shards[0].sizes))
                seen = sharded.setdefault(logical_path, kind)
                _require(seen == kind, f"has shards of dtype {kind[0]} and {kind[1]} dimensions where another "
                                       f"rank's have {seen[0]} and {seen[1]}")
        except _Damaged as exc:
            raise RestoreError(f"{named_in}: {key!r} {exc}; the snapshot is damaged or crafted: restore another "
                               "one") from None


def _require(condition: bool, problem: str) -> None:
    if not condition:
        raise _Damaged(problem)


def _logical_path(key: Any, world_size: int) -> str:
    """The logical path of a manifest key "<writer rank>/<path>"."""
    _require(isinstance(key, str), "is not a key of the form <rank>/<path>")
    writer, _, logical_path = key.partition("/")
    _require(bool(_WRITER.fullmatch(writer)) and bool(logical_path), "is not a key of the form <rank>/<path>")
    _require(int(writer) < world_size, f"names rank {writer} of a snapshot written by {world_size} ranks")
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
            _require(all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, shape)),
                     f"has a chunk at offsets {chunk.offsets} of sizes {chunk.sizes} outside its shape {list(shape)}")
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
        _require(entry.serializer == Serializer.TORCH_SAVE.value, f"has serializer {entry.serializer!r}, not "
                                                                  "one torchsnapshot writes objects with")
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
    else:
        _require(isinstance(entry, ListEntry), f"has an entry of type {type(entry).__name__}")


def _check_piece(piece: Shard, dtype: torch.dtype, ndim: int) -> None:
    """A chunk or shard: its box has the tensor's rank, and its stored tensor is that box, of the
    tensor's dtype."""
    _require(isinstance(piece, Shard), "has a chunk that is not a box of the tensor")
    offsets, sizes = _sizes(piece.offsets, "offsets"), _sizes(piece.sizes, "sizes")
    _require(len(offsets) == len(sizes) == ndim,
             f"has a chunk with offsets {list(offsets)} and sizes {list(sizes)} in a tensor of {ndim} dimensions")
    _check_tensor(piece.tensor)
    _require(tuple(piece.tensor.shape) == sizes, f"has a chunk of sizes {list(sizes)} that stores a tensor of "
                                                 f"shape {piece.tensor.shape}")
    chunk_dtype = _dtype(piece.tensor.dtype)
    _require(chunk_dtype == dtype, f"has a chunk of dtype {chunk_dtype} in a tensor of dtype {dtype}")


def _check_tensor(entry: Any) -> None:
    """A stored tensor: fields of the right types, a known serializer, and a byte range that is
    its bytes (exactly, when they are its memory as is)."""
    _require(isinstance(entry, TensorEntry), "has a chunk that is not a stored tensor")
    _require(isinstance(entry.location, str), "has a location that is not a file name")
    _require(isinstance(entry.serializer, str) and entry.serializer in SERIALIZERS,
             f"has serializer {entry.serializer!r}, not one torchsnapshot writes")
    _require(type(entry.replicated) is bool, "has a 'replicated' that is neither true nor false")
    dtype, shape = _dtype(entry.dtype), _sizes(entry.shape, "shape")
    raw = entry.serializer == Serializer.BUFFER_PROTOCOL.value
    _require(not raw or dtype in BUFFER_PROTOCOL_SUPPORTED_DTYPES, f"stores {dtype} as raw bytes")
    if entry.byte_range is not None:
        byte_range = _sizes(entry.byte_range, "byte_range")
        _require(len(byte_range) == 2 and byte_range[0] <= byte_range[1],
                 f"has a byte_range {entry.byte_range} that is no range of bytes")
        nbytes = math.prod(shape) * dtype.itemsize
        _require(not raw or byte_range[1] - byte_range[0] == nbytes,
                 f"has a byte_range {list(byte_range)} of {byte_range[1] - byte_range[0]} bytes for a {dtype} tensor "
                 f"of shape {list(shape)} ({nbytes} bytes)")


def _sizes(values: Any, what: str) -> tuple[int, ...]:
    """``values`` (sizes, offsets or byte positions) as a tuple, when it is a list of ints from 0
    to MAX_INDEX."""
    _require(isinstance(values, (list, tuple)) and all(type(v) is int and 0 <= v <= MAX_INDEX for v in values),
             f"has {what} {values!r:.80}, not a list of sizes")
    return tuple(values)


def _dtype(name: Any) -> torch.dtype:
    if isinstance(name, str):
        try:
            return string_to_dtype(name)
        except ValueError:
            pass
    raise _Damaged(f"has dtype {name!r:.40}, not one torchsnapshot writes")


def _listed(values: Any, what: str) -> Sequence[Any]:
    _require(isinstance(values, list), f"has {what} that are not a list")
    return values
