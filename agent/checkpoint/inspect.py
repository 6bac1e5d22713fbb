"""What a snapshot holds, for `torchrevive inspect` and `torchrevive list`: read from its metadata
and files only, nothing restored."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from torchsnapshot.manifest import DTensorEntry, ObjectEntry, ShardedTensorEntry
from torchsnapshot.manifest_utils import is_fully_replicated_entry

from agent.checkpoint.checksums import load_checksums
from agent.restore.manifest import TENSOR_ENTRY_TYPES, load_metadata, stored_tensor
from agent.checkpoint.dirs import is_committed, step_of


@dataclass
class SnapshotSummary:
    """A snapshot at a glance. Tensor counts and bytes are per logical tensor (global size)."""

    path: Path
    step: int | None
    committed: bool
    world_size: int
    size_bytes: int
    tensors_by_dtype: Counter = field(default_factory=Counter)
    bytes_by_dtype: Counter = field(default_factory=Counter)
    sharded_tensors: int = 0
    replicated_tensors: int = 0
    objects: int = 0
    checksummed_files: int | None = None
    """Files with block checksums (None: the snapshot has no checksum record)."""


def summarize(path: Path) -> SnapshotSummary:
    """Summarize one snapshot directory (written by the Checkpointer or plain torchsnapshot)."""
    metadata = load_metadata(path)
    summary = SnapshotSummary(
        path=path,
        step=step_of(path),
        committed=is_committed(path),
        world_size=metadata.world_size,
        size_bytes=sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        checksummed_files=len(checksums.files) if (checksums := load_checksums(path)) else None,
    )
    seen: set[str] = set()
    for key, entry in metadata.manifest.items():
        logical_path = key.partition("/")[2]
        if isinstance(entry, ObjectEntry):
            summary.objects += 1
        if not isinstance(entry, TENSOR_ENTRY_TYPES) or logical_path in seen or not getattr(entry, "shards", True):
            continue  # (a rank whose shard was empty stored none)
        seen.add(logical_path)  # a sharded tensor appears once per rank that wrote a shard
        stored = stored_tensor(entry)
        name = str(stored.dtype).removeprefix("torch.")
        summary.tensors_by_dtype[name] += 1
        summary.bytes_by_dtype[name] += math.prod(stored.shape) * stored.dtype.itemsize
        if isinstance(entry, (DTensorEntry, ShardedTensorEntry)) and not is_fully_replicated_entry(entry):
            summary.sharded_tensors += 1
        elif is_fully_replicated_entry(entry):
            summary.replicated_tensors += 1
    return summary

