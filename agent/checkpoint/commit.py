"""Commit: once every rank's files are durable, rank 0 writes the checksum record and the commit
marker into the save's own directory and renames it to ``step_<N>``; the snapshot is committed
the moment that rename is durable.

Every rank brings only what it wrote (digests computed from its write buffers), so the work is
proportional to a rank's own bytes: no rank lists the directory, re-reads a file, or opens one
that another rank wrote. Two collectives on the save's process group: the gather of every rank's
outcome, and rank 0's verdict. Every rank returns the same verdict. Before it commits, rank 0
checks the metadata it wrote (from its write buffer) as a restore will: a snapshot no restore could
read fails its save, and the previous snapshot stays the latest.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from agent.checkpoint.checksums import write_checksums
from agent.checkpoint.collectives import from_rank0, gather, rank
from agent.checkpoint.dirs import COMMIT_MARKER, fenced_round
from agent.checkpoint.durable import fsync_dir, write_file
from agent.checkpoint.write import WriteRecord
from agent.restore.manifest import METADATA_FILE, parse_metadata
from agent.restore.metadata_checks import metadata_problem


@dataclass(frozen=True)
class Commit:
    """One save to commit: its step, where it was written, where it goes, and its round."""

    step: int
    written: Path
    final: Path
    round: int | None


def commit(save: Commit, record: WriteRecord, group: dist.ProcessGroup | None,
           on_committed: Callable[[int], None]) -> str | None:
    """Commit ``save`` on every rank of ``group``; None when committed, else the error (the
    written directory is then removed, and the previous snapshot stays the latest). Rank 0 calls
    ``on_committed(bytes)`` the moment the commit is durable, before telling the others: a node
    killed after the commit still leaves its record."""

    def on_rank0(files: dict[str, Any], world_size: int) -> str | None:
        error = metadata_refused(save.written, record.metadata) or _commit_on_rank0(save, files, world_size=world_size)
        if error is None:
            on_committed(sum(d.size for d in files.values()))
        return error

    verdict = agree_and_commit(record.error, record.files, group, on_rank0)
    if verdict is not None and rank(group) == 0:
        shutil.rmtree(save.written, ignore_errors=True)
    return verdict


def agree_and_commit(error: str | None, files: Mapping[str, Any], group: dist.ProcessGroup | None,
                     commit_on_rank0: Callable[[dict[str, Any], int], str | None]) -> str | None:
    """Gather every rank's outcome (its error, the files it wrote); when no rank failed, rank 0
    commits with ``commit_on_rank0(every rank's files, world size)``. Every rank returns rank 0's
    verdict: None when committed, else the first error."""
    outcomes = gather((error, dict(files)), group)
    error = next((e for e, _ in outcomes if e), None)
    if rank(group) == 0 and error is None:
        error = commit_on_rank0({name: d for _, written in outcomes for name, d in written.items()}, len(outcomes))
    return from_rank0(error, group)


def _commit_on_rank0(save: Commit, files: dict[str, Any], *, world_size: int) -> str | None:
    try:
        write_checksums(save.written, files)
        marker = {"step": save.step, "world_size": world_size, "round": save.round, "committed_at": time.time()}
        write_file(save.written / COMMIT_MARKER, json.dumps(marker))
        if (stale := _stale(save)) is not None:
            return stale
        os.rename(save.written, save.final)  # refused (ENOTEMPTY) over an existing snapshot
        fsync_dir(save.final.parent)
    except OSError as exc:  # ENOENT when a newer round's fence moved the directory aside since the check
        return _stale(save) or f"committing {save.written}: {exc}"
    return None


def metadata_refused(written: Path, metadata: bytes | None) -> str | None:
    """Why the metadata rank 0 wrote into ``written`` may not be committed, else None: a snapshot
    that no restore could read (say, shards whose offsets overlap) fails its save instead of
    becoming the latest."""
    where = written / METADATA_FILE
    if metadata is None:
        return f"{where}: torchsnapshot wrote no metadata"
    try:
        problem = metadata_problem(parse_metadata(metadata.decode()))
    except Exception as exc:  # the parser, or an entry class, raises whatever it raises
        problem = f"unreadable ({type(exc).__name__}: {exc})"
    return None if problem is None else f"{where}: {problem}"


def _stale(save: Commit) -> str | None:
    """Why this save's round may not commit (a newer round exists), else None."""
    newest = fenced_round(save.final.parent)
    if save.round is None or newest is None or newest <= save.round:
        return None
    return (f"round {save.round} is stale (the job is in round {newest}): its save of step {save.step} is not "
            "committed")
