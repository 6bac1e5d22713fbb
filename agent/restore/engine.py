"""restore(): plan every rank-local read of a snapshot, check it, then execute it and hand the
state to each stateful's ``load_state_dict``."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torchsnapshot.flatten import flatten, inflate
from torchsnapshot.manifest import Entry, ObjectEntry, PrimitiveEntry
from torchsnapshot.manifest_utils import is_container_entry
from torchsnapshot.rng_state import RNGState

from agent.checkpoint.checksums import block_checks, load_checksums, sample
from agent.errors import RestoreError
from agent.restore.dcp_reader import FastStorageReader, is_dcp_checkpoint
from agent.restore.manifest import (
    METADATA_FILE,
    TENSOR_ENTRY_TYPES,
    StoredTensor,
    fitted,
    load_metadata,
    manifest_for_rank,
    stored_tensor,
)
from agent.restore.pickles import load_object
from agent.restore.plan import Box, CopyOp, CoverageError, chunk_box, plan_copies, stripe
from agent.restore.reader import (
    DEFAULT_PINNED_MB,
    SnapshotFiles,
    StorageReadError,
    byte_span,
    default_io_threads,
    read_ops,
)
from agent.restore.targets import (
    Destination,
    allocate,
    destination_of,
    is_tensor_value,
    optimizer_templates,
    template_for,
)

MAX_OP_BYTES = 16 << 20
"""Large copies are split into pieces of about this size so that threads share one big tensor."""
MIN_STRIPE_BYTES = 1 << 20
"""Replicated tensors smaller than this are read whole by every rank: a broadcast costs more."""


@dataclass(frozen=True)
class RestoreStats:
    """What one rank's restore did."""

    snapshot: str
    bytes_read: int
    seconds: float
    num_tensors: int
    bytes_exchanged: int = 0
    bytes_verified: int = 0

    @property
    def gbps(self) -> float:
        """Bytes read from storage per second, in GB/s (10^9)."""
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class _Stateful:
    key: str
    obj: Any
    containers: dict[str, Entry] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Plan:
    ops: list[CopyOp] = field(default_factory=list)
    targets: list[torch.Tensor] = field(default_factory=list)
    striped: list[torch.Tensor] = field(default_factory=list)
    objects: list[tuple[_Stateful, str, ObjectEntry]] = field(default_factory=list)
    holders: dict[str, str] = field(default_factory=dict)
    """file -> the first logical path read from it (for error messages)"""
    keys: list[str] = field(default_factory=list)
    """target -> the logical path it receives (for error messages)"""
    num_tensors: int = 0


def restore(
    path: str | Path,
    app_state: Mapping[str, Any],
    *,
    io_threads: int | None = None,
    replicated: Literal["all", "stripe"] = "all",
    trust_pickles: bool = False,
    strict: bool = True,
    verify: Literal["off", "sample", "full"] = "sample",
    pinned_mb: int = DEFAULT_PINNED_MB,
) -> RestoreStats:
    """Restore a torchsnapshot snapshot (or a DCP checkpoint directory) into ``app_state``,
    resharded to this process group.

    Each rank reads only the bytes of its own boxes, with ``io_threads`` threads (default:
    :func:`default_io_threads`) of positional reads straight into the destination tensors; CUDA
    destinations are staged through at most ``pinned_mb`` MiB of pinned host memory.
    ``replicated="stripe"`` (with an initialized process group) reads each replicated tensor
    once per cluster, a stripe per rank, and exchanges the stripes. Pickled objects load with
    ``weights_only`` semantics unless ``trust_pickles``. When the snapshot has checksums (one
    committed by the Checkpointer), every file's size is checked first, and ``verify="full"``
    checks every block this rank reads, ``"sample"`` one block in 32, ``"off"`` none; the block
    checks run beside the copies (in the same pool, so a cold block is read from storage once).

    A DCP checkpoint is planned by DCP itself (``dcp.load`` with :class:`FastStorageReader`):
    ``app_state`` holds state dicts or Statefuls as for ``dcp.load``; its metadata and byte items
    load as data unless ``trust_pickles``, and the checksum and stripe options do not apply.

    Statefuls load as with torchsnapshot: by key, an ``RNGState`` last; in a stateful other than a
    module or an optimizer, a tensor of another shape or dtype than stored is replaced.

    Errors: a missing or damaged snapshot, a key or shape or dtype that does not match, raise
    RestoreError naming the file and key. All of that is checked before the first byte is
    copied, so after such an error the destination is untouched. An I/O failure during the copy
    itself (a file vanishing mid-read), a block failing its checksum or a torch.save chunk that
    does not hold its tensor can leave tensors partly overwritten; then no ``load_state_dict``
    has been called. Damaged or crafted metadata is always a RestoreError, and no copy ever
    writes past its destination."""
    started = time.perf_counter()
    root = Path(path)
    if is_dcp_checkpoint(root) and not (root / METADATA_FILE).exists():
        return _restore_dcp(root, app_state, io_threads=io_threads, trust_pickles=trust_pickles, started=started)
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    striping = replicated == "stripe" and world_size > 1
    plan = _Plan()
    with _together(striping, root):
        manifest = manifest_for_rank(load_metadata(root), rank)
        files = SnapshotFiles(root)
        try:
            statefuls = [
                _plan_stateful(key, obj, manifest, files, plan, striping=striping, rank=rank, world_size=world_size,
                               strict=strict)
                for key, obj in app_state.items()
            ]
            checks, verified = _block_checks(root, plan, verify) if verify != "off" else ([], 0)
            for stateful, logical_path, entry in plan.objects:
                stateful.values[logical_path] = _load_object(logical_path, entry, files, trust_pickles)
            # The state dicts hold the destination tensors themselves: built now, before any byte is copied.
            state_dicts = [(stateful, _inflated(root, stateful)) for stateful in sorted(statefuls, key=_load_order)]
            bytes_read = _read(root, plan, files, checks, io_threads=io_threads or default_io_threads(),
                               pinned_bytes=pinned_mb << 20)
        finally:
            files.close()
    exchanged = _exchange_stripes(plan.striped, world_size)
    for stateful, state_dict in state_dicts:
        if isinstance(stateful.obj, torch.nn.Module):
            stateful.obj.load_state_dict(state_dict, strict=strict)
        else:
            stateful.obj.load_state_dict(state_dict)
    return RestoreStats(str(root), bytes_read, time.perf_counter() - started, plan.num_tensors, exchanged, verified)


def _read(root: Path, plan: _Plan, files: SnapshotFiles, checks: list, *, io_threads: int, pinned_bytes: int) -> int:
    """Execute the plan; an I/O failure names the file and what it holds."""
    try:
        return read_ops(plan.ops, plan.targets, files, io_threads=io_threads, pinned_bytes=pinned_bytes, checks=checks)
    except StorageReadError as exc:
        held = plan.keys[exc.target] if exc.target is not None else plan.holders.get(exc.location, "?")
        raise RestoreError(f"{exc}; it holds '{held}': destination tensors may be partly overwritten and no state "
                           "was loaded: restore again or from another snapshot") from exc
    except OSError as exc:
        raise RestoreError(f"{root}: reading failed mid-restore ({exc}); destination tensors may be partly "
                           "overwritten and no state was loaded: restore again or from another snapshot") from exc


@contextmanager
def _together(enabled: bool, root: Path) -> Iterator[None]:
    """With ``enabled`` (a striped restore, whose stripe exchange is a sequence of collectives),
    every rank learns whether the block failed on any rank before any rank goes on: a rank-local
    failure (a checksum mismatch in its stripe) raises RestoreError on every rank, so all ranks
    leave the restore together and meet again in the caller's next collective (the
    Checkpointer's fallback) instead of in mismatched ones."""
    if not enabled:
        yield
        return
    try:
        yield
    except RestoreError as exc:
        _all_errors(str(exc))
        raise
    except Exception as exc:  # not a RestoreError: the caller's fallback would not catch it on this rank alone
        _all_errors(f"{type(exc).__name__}: {exc}")
        raise RestoreError(f"{root}: restoring this rank's share failed ({type(exc).__name__}: {exc})") from exc
    failed = [(rank, error) for rank, error in enumerate(_all_errors(None)) if error is not None]
    if failed:
        rank, error = failed[0]
        raise RestoreError(f"{root}: rank {rank} failed to restore its share ({error}); no rank exchanged stripes "
                           "or loaded state: restore again or from another snapshot")


def _all_errors(error: str | None) -> list[str | None]:
    """Every rank's error (None for success), in rank order."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def _restore_dcp(root: Path, app_state: Mapping[str, Any], *, io_threads: int | None, trust_pickles: bool,
                 started: float) -> RestoreStats:
    """A DCP checkpoint: DCP's own planning (resharding included) with the fast reader."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = FastStorageReader(root, io_threads=io_threads, trust_pickles=trust_pickles)
    reader.read_metadata()  # a refused or damaged metadata file raises here, not inside dcp.load's own error
    try:
        dcp.load(app_state if isinstance(app_state, dict) else dict(app_state), storage_reader=reader)
    except CheckpointException as exc:  # each rank's exception, wrapped: the first of ours says it best
        ours = next((failure for failure, _ in exc.failures.values() if isinstance(failure, RestoreError)), None)
        raise (ours or RestoreError(f"{root}: DCP load failed: {exc}")) from exc
    except (RuntimeError, ValueError, KeyError) as exc:
        raise RestoreError(f"{root}: DCP load failed: {exc}") from exc
    return RestoreStats(str(root), reader.bytes_read, time.perf_counter() - started, reader.tensors_read)


def _block_checks(root: Path, plan: _Plan, mode: str) -> tuple[list, int]:
    """The checksum checks of the blocks the plan reads (all of them, or a sample), to run beside
    the copies, and the bytes they cover. File sizes are checked at once."""
    checksums = load_checksums(root)
    if checksums is None:
        return [], 0
    wanted: dict[str, set[int]] = {}
    for op in plan.ops:
        wanted.setdefault(op.chunk.location, set()).update(checksums.blocks_of(op.chunk.location, *byte_span(op)))
    for _, _, entry in plan.objects:
        size = checksums.files[entry.location].size if entry.location in checksums.files else 0
        wanted.setdefault(entry.location, set()).update(checksums.blocks_of(entry.location, 0, size))
    if mode == "sample":
        wanted = {location: set(sample(location, blocks)) for location, blocks in wanted.items()}
    checks = block_checks(root, checksums, wanted, lambda location: f"it holds '{plan.holders.get(location, '?')}': "
                          "the snapshot is damaged, restore another one")
    covered = sum(hi - lo for location, blocks in wanted.items() for lo, hi in
                  (checksums.block_range(location, block) for block in blocks))
    return checks, covered


def _plan_stateful(
    key: str, obj: Any, manifest: dict[str, Entry], files: SnapshotFiles, plan: _Plan, *,
    striping: bool, rank: int, world_size: int, strict: bool,
) -> _Stateful:
    container_manifest, flattened = flatten(obj.state_dict(), prefix=key)
    prefix = next((p for p in container_manifest if "/" not in p), key)
    entries = {p: e for p, e in manifest.items() if p == prefix or p.startswith(prefix + "/")}
    if not entries:
        held = sorted({p.split("/")[0] for p in manifest})
        raise RestoreError(f"{files.path('')}: app_state key '{key}' is not in the snapshot (it holds {held})")
    if strict and isinstance(obj, torch.nn.Module):
        missing = sorted(p for p, v in flattened.items() if is_tensor_value(v) and p not in entries)
        if missing:
            raise RestoreError(f"{files.path('')}: '{missing[0]}' is not in the snapshot ({len(missing)} such keys); "
                               "the snapshot is of another model, or pass strict=False")
    templates = optimizer_templates(obj) if isinstance(obj, torch.optim.Optimizer) else []
    stateful = _Stateful(key, obj)
    for logical_path, entry in entries.items():
        if is_container_entry(entry):
            stateful.containers[logical_path] = entry
        elif isinstance(entry, TENSOR_ENTRY_TYPES):
            try:
                stored = stored_tensor(entry)
            except RestoreError as exc:
                raise RestoreError(f"{files.path(METADATA_FILE)}: '{logical_path}': {exc}; the snapshot is damaged or "
                                   "crafted: restore another one") from None
            value = flattened.get(logical_path)
            if not is_tensor_value(value) or _replaced(obj, value, stored):
                value = _allocated(logical_path, stored, template_for(logical_path, templates), files)
            stateful.values[logical_path] = value
            _plan_tensor(logical_path, stored, destination_of(value), files, plan,
                         striping=striping, rank=rank, world_size=world_size)
        elif isinstance(entry, PrimitiveEntry):
            stateful.values[logical_path] = entry.get_value()
        elif isinstance(entry, ObjectEntry):
            plan.objects.append((stateful, logical_path, entry))
            plan.holders.setdefault(entry.location, logical_path)
        else:
            raise RestoreError(f"{files.path('')}: '{logical_path}' has an entry of type {entry.type!r} that this "
                               "version of torchrevive cannot restore")
    return stateful


def _inflated(root: Path, stateful: _Stateful) -> Any:
    """The stateful's state dict, its containers rebuilt as the metadata describes them."""
    try:
        return inflate(stateful.containers, stateful.values, prefix=stateful.key)
    except Exception as exc:  # torchsnapshot's inflate raises whatever containers that do not fit make it hit
        raise RestoreError(f"{root / METADATA_FILE}: the containers of '{stateful.key}' do not fit its values "
                           f"({type(exc).__name__}: {exc}); the snapshot is damaged or crafted: restore another one"
                           ) from exc


def _load_order(stateful: _Stateful) -> tuple[bool, str]:
    """torchsnapshot's order: by key, and an RNGState last, so that a ``load_state_dict`` that draws
    random numbers cannot move the generator away from the state restored."""
    return isinstance(stateful.obj, RNGState), stateful.key


def _replaced(obj: Any, value: Any, stored: StoredTensor) -> bool:
    """Whether a plain destination tensor of another shape or dtype gets a new tensor as stored,
    as torchsnapshot does: in any stateful but a module or an optimizer (whose state of another
    shape or dtype is another model's, a RestoreError)."""
    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        return False
    dest = destination_of(value)
    return dest.is_plain and (dest.shape, dest.dtype) != (stored.shape, stored.dtype)


def _plan_tensor(
    logical_path: str, stored: StoredTensor, dest: Destination, files: SnapshotFiles, plan: _Plan, *,
    striping: bool, rank: int, world_size: int,
) -> None:
    where = files.path(stored.chunks[0].location)
    if stored.shape != dest.shape:
        raise RestoreError(f"{where}: '{logical_path}' has shape {list(stored.shape)} in the snapshot but "
                           f"{list(dest.shape)} in the destination; the snapshot is of another model")
    if stored.dtype != dest.dtype:
        raise RestoreError(f"{where}: '{logical_path}' has dtype {stored.dtype} in the snapshot but "
                           f"{dest.dtype} in the destination; cast the model or restore a matching snapshot")
    boxes, local_tensors = dest.boxes, dest.local_tensors
    if (
        striping and stored.replicated and dest.is_plain and dest.value.is_contiguous()
        and len(stored.shape) > 0 and stored.shape[0] >= world_size
        and dest.value.numel() * dest.value.element_size() >= MIN_STRIPE_BYTES
    ):
        mine = stripe(stored.shape, rank, world_size)
        boxes, local_tensors = (mine,), (dest.value[mine.offsets[0] : mine.offsets[0] + mine.sizes[0]],)
        plan.striped.append(dest.value)
    # Only the files this rank reads must be here: a node restoring a memory snapshot pulled those.
    stored = _with_checked_files(logical_path, _overlapping(stored, boxes), files)
    try:
        ops = plan_copies(stored, boxes, max_op_bytes=MAX_OP_BYTES)
    except CoverageError as exc:
        raise RestoreError(f"{where}: '{logical_path}': {exc}; the snapshot's metadata is damaged") from exc
    for chunk in stored.chunks:
        plan.holders.setdefault(chunk.location, logical_path)
    base = len(plan.targets)
    plan.targets.extend(local_tensors)
    plan.keys.extend(logical_path for _ in local_tensors)
    plan.ops.extend(CopyOp(op.chunk, op.target + base, op.src_start, op.dst_start, op.sizes) for op in ops)
    plan.num_tensors += 1


def _allocated(logical_path: str, stored: StoredTensor, template: torch.Tensor | None, files: SnapshotFiles) -> torch.Tensor:
    """A new destination as stored (see :func:`allocate`); RestoreError when memory refuses it."""
    try:
        return allocate(stored, template)
    except RuntimeError as exc:  # the stored shape is checked against the files' bytes, not against memory
        raise RestoreError(f"{files.path(METADATA_FILE)}: '{logical_path}' of shape {list(stored.shape)} cannot be "
                           f"allocated ({exc})") from exc


def _overlapping(stored: StoredTensor, boxes: tuple[Box, ...]) -> StoredTensor:
    """``stored`` with only the chunks that overlap one of ``boxes``."""
    chunks = tuple(c for c in stored.chunks if any(box.intersect(chunk_box(c)) is not None for box in boxes))
    return StoredTensor(stored.shape, stored.dtype, chunks, stored.replicated)


def _with_checked_files(logical_path: str, stored: StoredTensor, files: SnapshotFiles) -> StoredTensor:
    """Check each chunk's file holds its bytes, and fill in the length of whole-file chunks."""
    chunks = []
    for chunk in stored.chunks:
        try:
            chunks.append(fitted(chunk, files.size(chunk.location)))
        except FileNotFoundError:
            raise RestoreError(f"{files.path(chunk.location)}: missing, needed by '{logical_path}'; the snapshot "
                               "is damaged: restore another one") from None
        except OSError as exc:
            raise RestoreError(f"{files.path(chunk.location)}: cannot be read ({exc.strerror}), needed by "
                               f"'{logical_path}'; the snapshot is damaged: restore another one") from None
        except ValueError as exc:
            raise RestoreError(f"{files.path(chunk.location)}: {exc} for '{logical_path}'; the snapshot is damaged: "
                               "restore another one") from None
    return StoredTensor(stored.shape, stored.dtype, tuple(chunks), stored.replicated)


def _load_object(logical_path: str, entry: ObjectEntry, files: SnapshotFiles, trust_pickles: bool) -> Any:
    path = files.path(entry.location)
    try:
        payload = path.read_bytes()
    except FileNotFoundError:
        raise RestoreError(f"{path}: missing, needed by '{logical_path}'; the snapshot is damaged: restore another one") from None
    except OSError as exc:
        raise RestoreError(f"{path}: cannot be read ({exc.strerror}), needed by '{logical_path}'; the snapshot is "
                           "damaged: restore another one") from None
    return load_object(payload, where=path, key=logical_path, kind=entry.obj_type, trust_pickles=trust_pickles)


def _exchange_stripes(tensors: list[torch.Tensor], world_size: int) -> int:
    """Each rank read one stripe of every striped tensor; broadcast each stripe from its reader."""
    exchanged = 0
    for tensor in tensors:
        for owner in range(world_size):
            box = stripe(tuple(tensor.shape), owner, world_size)
            part = tensor[box.offsets[0] : box.offsets[0] + box.sizes[0]]
            dist.broadcast(part, src=owner)
            exchanged += part.numel() * part.element_size()
    return exchanged
