"""The reader on real files: dense and strided copies, files that shrink while being read, no
memory charged against the commit limit, and the pinned staging budget."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchsnapshot
from conftest import REPO, worker_env
from torch import nn

import agent
from agent import RestoreError
from agent.checkpoint import Checkpointer
from agent.checkpoint.checksums import ChecksumError, block_checks, load_checksums
from agent.restore.manifest import StoredChunk, StoredTensor, load_metadata, manifest_for_rank, stored_tensor
from agent.restore.plan import Box, plan_copies
from agent.restore.reader import SnapshotFiles, read_ops, staging_layout


def stored_in_files(root: Path, values: torch.Tensor, boxes: list[Box], rng: random.Random) -> StoredTensor:
    """Write each box of ``values`` at a random offset of one of two files, as torchsnapshot does."""
    chunks, files = [], {"a": bytearray(), "b": bytearray()}
    for box in boxes:
        name = rng.choice("ab")
        files[name] += bytes(rng.randrange(256) for _ in range(rng.randrange(8)))  # unaligned offsets
        block = values[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].contiguous()
        chunks.append(StoredChunk(box.offsets, box.sizes, name, len(files[name]), block.numel() * 4, values.dtype,
                                  "buffer_protocol"))
        files[name] += block.numpy().tobytes()
    for name, data in files.items():
        (root / name).write_bytes(data)
    return StoredTensor(tuple(values.shape), values.dtype, tuple(chunks), False)


def read_boxes(root: Path, stored: StoredTensor, targets: list[Box], destinations: list[torch.Tensor], *,
               io_threads: int, max_op_bytes: int) -> None:
    files = SnapshotFiles(root)
    try:
        read_ops(plan_copies(stored, targets, max_op_bytes=max_op_bytes), destinations, files, io_threads=io_threads)
    finally:
        files.close()


def cuts(size: int, rng: random.Random) -> list[Box]:
    points = sorted({0, size, *(rng.randrange(1, size) for _ in range(rng.randrange(3)) if size > 1)})
    return [Box((lo,), (hi - lo,)) for lo, hi in zip(points, points[1:])]


def grid(shape: tuple[int, ...], rng: random.Random) -> list[Box]:
    boxes = [Box((), ())]
    for size in shape:
        boxes = [Box((*b.offsets, *c.offsets), (*b.sizes, *c.sizes)) for b in boxes for c in cuts(size, rng)]
    return boxes


@pytest.mark.parametrize("seed", range(12))
def test_random_boxes_into_dense_and_strided_destinations(tmp_path, seed):
    """Stored in one grid, restored in another (dense runs, rows of columns, transposed
    destinations): every element lands where plain slicing puts it."""
    rng = random.Random(seed)
    shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(0, 2))) + (rng.choice([rng.randint(1, 40), 300]),)
    values = torch.randn(shape)
    stored = stored_in_files(tmp_path, values, grid(shape, rng), rng)
    targets = grid(shape, rng)
    destinations = [torch.zeros(tuple(reversed(b.sizes))).permute(*reversed(range(len(shape))))
                     if rng.random() < 0.3 else torch.zeros(b.sizes) for b in targets]
    read_boxes(tmp_path, stored, targets, destinations, io_threads=rng.choice([1, 3]), max_op_bytes=1 << 12)
    for box, got in zip(targets, destinations):
        assert torch.equal(got, values[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])


@pytest.mark.parametrize("shape, columns", [((3000, 200), (3, 173)), ((6, 40_000), (5, 900))])
def test_column_blocks_of_many_rows_and_of_long_rows(tmp_path, shape, columns):
    values = torch.randn(shape)
    stored = stored_in_files(tmp_path, values, [Box((0, 0), shape)], random.Random(0))
    target = Box((0, columns[0]), (shape[0], columns[1] - columns[0]))
    destination = torch.zeros(target.sizes)
    read_boxes(tmp_path, stored, [target], [destination], io_threads=2, max_op_bytes=1 << 16)
    assert torch.equal(destination, values[:, columns[0] : columns[1]])


@pytest.mark.parametrize("columns", [(0, 40), (3, 13)])
def test_a_file_truncated_before_a_dense_or_a_strided_copy_raises_naming_it(tmp_path, columns):
    """Dense copies read (a short read), strided ones map: the file's size is checked first."""
    values = torch.randn(100, 40)
    stored = stored_in_files(tmp_path, values, [Box((0, 0), (100, 40))], random.Random(0))
    location = stored.chunks[0].location
    ops = plan_copies(stored, [Box((0, columns[0]), (100, columns[1] - columns[0]))], max_op_bytes=1 << 20)
    os.truncate(tmp_path / location, (tmp_path / location).stat().st_size // 2)
    files = SnapshotFiles(tmp_path)
    try:
        with pytest.raises(RestoreError, match=rf"{tmp_path / location}: .*\(truncated while being restored\)"):
            read_ops(ops, [torch.zeros(100, columns[1] - columns[0])], files, io_threads=1)
    finally:
        files.close()


class Truncating:
    """A stateful whose ``state_dict`` (called while the restore plans, after the files of the
    statefuls before it were sized) truncates a file: the file shrinks under the restore."""

    def __init__(self, victim: Path | None = None) -> None:
        self.victim = victim

    def state_dict(self) -> dict:
        if self.victim is not None:
            with open(self.victim, "r+b") as f:
                f.truncate(self.victim.stat().st_size // 2)
        return {"n": 1}

    def load_state_dict(self, state: dict) -> None:
        raise AssertionError("a failed restore loads no state")


def location_of(snapshot: Path, logical_path: str) -> Path:
    [chunk] = stored_tensor(manifest_for_rank(load_metadata(snapshot), 0)[logical_path]).chunks
    return snapshot / chunk.location


def test_a_file_truncated_during_the_read_raises_naming_the_file_and_key(tmp_path):
    torch.manual_seed(0)
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"model": nn.Linear(512, 512), "hook": Truncating()})
    victim = location_of(tmp_path / "s", "model/weight")
    with pytest.raises(RestoreError, match=rf"{victim}: ends at byte \d+, before bytes \d+\.\.\d+ could be read "
                                           r"\(truncated while being restored\); it holds 'model/"):
        agent.restore(tmp_path / "s", {"model": nn.Linear(512, 512), "hook": Truncating(victim)})


def test_a_checked_block_truncated_after_the_size_check_is_reported_as_truncated(tmp_path):
    ckpt = Checkpointer(tmp_path / "ckpt", staging=False)
    ckpt.save(1, {"model": nn.Linear(1024, 1024)})
    snapshot = ckpt.latest()
    checksums = load_checksums(snapshot)
    victim = max(checksums.files, key=lambda location: checksums.files[location].size)
    checks = block_checks(snapshot, checksums, {victim: [0]}, lambda location: f"it holds {location}")
    (snapshot / victim).write_bytes((snapshot / victim).read_bytes()[:1000])
    [(_, check)] = checks
    with pytest.raises(ChecksumError, match=rf"{snapshot / victim}: ends at byte 1000, before \d+ \(truncated"):
        check()


def test_mappings_of_snapshot_files_are_read_only_and_shared(tmp_path):
    (tmp_path / "data").write_bytes(bytes(1 << 16))
    files = SnapshotFiles(tmp_path)
    try:
        with files.mapped("data", 1 << 16):
            maps = Path("/proc/self/maps").read_text().splitlines()
        [line] = [line for line in maps if line.endswith(str(tmp_path / "data"))]
        assert line.split()[1] == "r--s", line  # no write permission: nothing charged to the commit limit
    finally:
        files.close()


RESTORE_UNDER_DATA_LIMIT = """
import resource, sys
import torch
from torch import nn
import agent
torch.manual_seed(0)
expected = nn.Linear(8192, 8192, bias=False).weight  # 256 MiB
model = nn.Linear(8192, 8192, bias=False)
data = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmData:"))
# RLIMIT_DATA counts private writable mappings (as the commit limit does), not read-only ones.
resource.setrlimit(resource.RLIMIT_DATA, (data + (128 << 20), resource.RLIM_INFINITY))
agent.restore(sys.argv[1], {"model": model}, io_threads=2, verify="off")
assert torch.equal(model.weight, expected)
print("restored")
"""


def test_restore_charges_no_private_writable_memory_for_the_files(tmp_path):
    """Under a data limit far below the snapshot's size the restore still works: the snapshot's
    bytes are never in a private writable mapping (which ``vm.overcommit_memory=2`` refuses)."""
    torch.manual_seed(0)
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"model": nn.Linear(8192, 8192, bias=False)})
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(RESTORE_UNDER_DATA_LIMIT), str(tmp_path / "s")],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "restored" in done.stdout, done.stdout + done.stderr


@pytest.mark.parametrize("pinned_mb", [1, 3, 16, 256, 4096])
@pytest.mark.parametrize("io_threads", [1, 4, 32])
def test_pinned_staging_stays_within_its_budget(pinned_mb, io_threads):
    count, buffer_bytes = staging_layout(pinned_mb << 20, io_threads)
    assert count * buffer_bytes <= pinned_mb << 20
    assert count >= 2 and buffer_bytes & (buffer_bytes - 1) == 0 and buffer_bytes <= 16 << 20
    assert count == 2 * io_threads or count * buffer_bytes > (pinned_mb << 20) // 2  # two a thread, or half the budget


RESTORE_UNDER_FILE_LIMIT = """
import os, resource, sys
import torch
import torchsnapshot
import agent
tensors = int(sys.argv[2])
state = torchsnapshot.StateDict({f"t{i}": torch.zeros(256) for i in range(tensors)})
open_now = len(os.listdir("/proc/self/fd"))
limit = open_now + tensors // 2  # fewer descriptors than the snapshot has files
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
agent.restore(sys.argv[1], {"s": state}, io_threads=4, verify="off")
assert all(torch.equal(state[f"t{i}"], torch.full((256,), float(i))) for i in range(tensors))
print("restored under a limit of", limit, "descriptors")
"""


def test_a_snapshot_of_more_files_than_descriptors_restores(tmp_path, monkeypatch):
    """Each reading thread keeps its descriptor of each file for the next copy, but never more
    than a share of RLIMIT_NOFILE: a snapshot of many files (one a tensor, unbatched) restores
    under a limit below its number of files."""
    monkeypatch.setenv("TORCHSNAPSHOT_DISABLE_BATCHING", "1")
    tensors = 120
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"s": torchsnapshot.StateDict(
        {f"t{i}": torch.full((256,), float(i)) for i in range(tensors)})})
    assert sum(1 for _ in (tmp_path / "s").rglob("t*")) == tensors
    done = subprocess.run([sys.executable, "-c", RESTORE_UNDER_FILE_LIMIT, str(tmp_path / "s"), str(tensors)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "restored" in done.stdout, done.stdout + done.stderr[-3000:]


def test_descriptors_kept_open_stay_within_the_budget(tmp_path):
    """Reading 40 files with 4 threads keeps at most ``max_open`` descriptors and mappings open
    between copies, and every copy still lands."""
    values = torch.arange(40 * 64, dtype=torch.float32).reshape(40, 64)
    for i in range(40):
        (tmp_path / f"f{i}").write_bytes(values[i].numpy().tobytes())
    chunks = tuple(StoredChunk((i, 0), (1, 64), f"f{i}", 0, 256, torch.float32, "buffer_protocol") for i in range(40))
    stored = StoredTensor((40, 64), torch.float32, chunks, False)
    strided = [Box((i, 8), (1, 8)) for i in range(0, 40, 2)]  # through mappings
    dense = [Box((i, 0), (1, 64)) for i in range(1, 40, 2)]  # through descriptors
    destinations = [torch.zeros(b.sizes) for b in strided + dense]
    files = SnapshotFiles(tmp_path, max_open=6)
    open_before = len(os.listdir("/proc/self/fd"))
    try:
        read_ops(plan_copies(stored, strided + dense, max_op_bytes=1 << 20), destinations, files, io_threads=4)
        assert len(os.listdir("/proc/self/fd")) - open_before <= 6  # a mapping holds a descriptor of its own
    finally:
        files.close()
    for box, got in zip(strided + dense, destinations):
        assert torch.equal(got, values[box.offsets[0] : box.offsets[0] + 1, box.offsets[1] : box.offsets[1] + box.sizes[1]])
