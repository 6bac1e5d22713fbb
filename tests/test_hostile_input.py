"""Hostile checkpoints are refused, never executed: pickles that would run code (in DCP's
metadata, a DCP byte item, a torchsnapshot object, a tensor archive's data.pkl), tensor archives
whose sizes lie, and manifests that name files outside the snapshot. Each crafted checkpoint is
a real one (written by dcp.save or torchsnapshot) with its metadata or one item rewritten."""

from __future__ import annotations

import io
import os
import pickle
import re
import struct
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torchsnapshot
from conftest import REPO, worker_env
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torchsnapshot.manifest import SnapshotMetadata

import agent
from agent import RestoreError
from agent.checkpoint.checksums import data_files, digest_file, digest_files, write_checksums
from agent.checkpoint.verify import check_snapshot
from agent.prefetch import node_share
from agent.restore.dcp_reader import FastStorageReader

SECRET = torch.full((16,), 7777.0)
"""Bytes outside the checkpoint that a crafted one tries to read into the weights."""


class Touch:
    """Pickles as a call of ``Path.touch``: unpickling it creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.touch, (self.marker,)


class Benign:
    """A harmless object that safe loading still refuses: it is not plain data."""

    def __init__(self, value: int) -> None:
        self.value = value


# --- DCP: metadata, byte items ---------------------------------------------------------------


def dcp_checkpoint(path: Path, **extra: object) -> Path:
    dcp.save({"w": torch.arange(16.0), "v": torch.ones(4), **extra}, checkpoint_id=path)
    return path


def rewrite_dcp_metadata(path: Path, edit) -> None:
    """Load DCP's metadata (the test trusts what it wrote), edit it, write it back."""
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def dcp_state() -> dict:
    return {"w": torch.zeros(16), "v": torch.zeros(4)}


def test_dcp_metadata_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = dcp_checkpoint(tmp_path / "ckpt")
    rewrite_dcp_metadata(path, lambda metadata: metadata.planner_data.update(evil=Touch(marker)))
    with pytest.raises(RestoreError, match=r"ckpt/\.metadata: DCP metadata names pathlib\.Path\.touch, which safe "
                                           r"loading refuses .*trust_pickles=True"):
        agent.restore(path, dcp_state())
    with pytest.raises(BaseException, match=r"DCP metadata names pathlib\.Path\.touch"):  # DCP wraps it
        dcp.load(dcp_state(), storage_reader=FastStorageReader(path))
    assert not marker.exists()
    agent.restore(path, dcp_state(), trust_pickles=True)
    assert marker.exists()  # the payload is live: only the refusal kept it from running


def test_dcp_metadata_with_other_classes_loads_when_trusted(tmp_path):
    path = dcp_checkpoint(tmp_path / "ckpt")
    rewrite_dcp_metadata(path, lambda metadata: metadata.planner_data.update(note=Benign(1)))
    with pytest.raises(RestoreError, match=r"names test_hostile_input\.Benign, which safe loading refuses"):
        agent.restore(path, dcp_state())
    state = dcp_state()
    agent.restore(path, state, trust_pickles=True)
    assert torch.equal(state["w"], torch.arange(16.0))


def test_dcp_byte_item_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    path = dcp_checkpoint(tmp_path / "ckpt", extra=Touch(marker))
    state = {**dcp_state(), "extra": None}
    with pytest.raises(RestoreError, match=r"ckpt/__0_0\.distcp: 'extra' is a pickled object that safe loading "
                                           r"refuses .*trust_pickles=True"):
        agent.restore(path, state)
    with pytest.raises(BaseException, match=r"'extra' is a pickled object that safe loading refuses"):
        dcp.load({**dcp_state(), "extra": None}, storage_reader=FastStorageReader(path))
    assert not marker.exists()
    agent.restore(path, state, trust_pickles=True)
    assert marker.exists()


def test_dcp_byte_items_of_plain_data_load_and_others_when_trusted(tmp_path):
    path = dcp_checkpoint(tmp_path / "ckpt", step=7, note=Benign(3))
    state = {**dcp_state(), "step": 0}
    agent.restore(path, state)
    assert state["step"] == 7 and torch.equal(state["w"], torch.arange(16.0))
    with pytest.raises(RestoreError, match=r"'note' is a pickled object that safe loading refuses"):
        agent.restore(path, {**dcp_state(), "note": None})
    state = {**dcp_state(), "note": None}
    agent.restore(path, state, trust_pickles=True)
    assert state["note"].value == 3


# --- DCP: the tensor archive (torch.save zip) of one item ----------------------------------------


def rewrite_item(path: Path, fqn: str, craft) -> None:
    """Replace item ``fqn``'s archive by ``craft(archive)`` appended to its file, followed by
    SECRET's bytes (as another item would follow it), and point the metadata at it."""
    with open(path / ".metadata", "rb") as f:
        index, info = next((i, s) for i, s in pickle.load(f).storage_data.items() if i.fqn == fqn)
    file = path / info.relative_path
    archive = file.read_bytes()[info.offset : info.offset + info.length]
    crafted = craft(archive)
    offset = file.stat().st_size
    with open(file, "ab") as f:
        f.write(crafted + SECRET.numpy().tobytes())
    moved = _StorageInfo(info.relative_path, offset, len(crafted))
    rewrite_dcp_metadata(path, lambda metadata: metadata.storage_data.__setitem__(index, moved))


def with_data_pkl(archive: bytes, data_pkl: bytes, comment: bytes = b"") -> bytes:
    """The archive with its data.pkl replaced (every other entry as written by torch.save)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(archive)) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, data_pkl if info.filename.endswith("/data.pkl") else src.read(info))
        dst.comment = comment
    return out.getvalue()


def data_pkl_of(archive: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(archive)) as src:
        return src.read(next(n for n in src.namelist() if n.endswith("/data.pkl")))


def reaching_past_the_item(archive: bytes) -> bytes:
    """The archive, its tensor moved (storage offset) to the bytes right after the item, and its
    directory claiming a storage that long: what follows the item would be read as the tensor."""
    original = data_pkl_of(archive)
    assert original.count(b"QK\x00") == 1  # BINPERSID (the storage), then BININT1 0: the storage offset
    comment = b""
    for _ in range(4):  # pad with a zip comment until the end of the item is a whole element away
        crafted = with_data_pkl(archive, original, comment)
        with zipfile.ZipFile(io.BytesIO(crafted)) as z:
            entry = next(i for i in z.infolist() if "/data/" in i.filename)
        header = crafted[entry.header_offset : entry.header_offset + 30]
        data_start = entry.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
            int.from_bytes(header[28:30], "little")
        if (len(crafted) - data_start) % 4 == 0:
            break
        comment += b" "
    offset = (len(crafted) - data_start) // 4
    assert offset < 256
    crafted = with_data_pkl(archive, original.replace(b"QK\x00", b"QK" + bytes([offset])), comment)
    record = crafted.rindex(entry.filename.encode()) - 46  # the entry's record in the central directory
    assert crafted[record : record + 4] == b"PK\x01\x02"
    claimed = struct.pack("<II", (offset + 16) * 4, (offset + 16) * 4)  # compressed and uncompressed sizes
    return crafted[: record + 20] + claimed + crafted[record + 28 :]


class HugeStorage:
    """Pickles as ``torch.UntypedStorage(2**62)``: an allocation nobody paid for in bytes."""

    def __reduce__(self) -> tuple:
        return torch.UntypedStorage, (1 << 62,)


@pytest.mark.parametrize("case", ["runs code", "allocates", "reads past the item"])
def test_crafted_tensor_archives_are_refused(tmp_path, case):
    marker = tmp_path / "pwned"
    path = dcp_checkpoint(tmp_path / "ckpt")
    craft = {
        "runs code": lambda archive: with_data_pkl(archive, pickle.dumps(Touch(marker), protocol=2)),
        "allocates": lambda archive: with_data_pkl(archive, pickle.dumps(HugeStorage(), protocol=2)),
        "reads past the item": reaching_past_the_item,
    }[case]
    rewrite_item(path, "w", craft)
    for trust in (False, True):  # an archive's data.pkl is never unpickled beyond a tensor's recipe
        state = dcp_state()
        with pytest.raises(RestoreError, match=r"ckpt/__0_0\.distcp \(w\): "):
            agent.restore(path, state, trust_pickles=trust)
        assert not marker.exists()
        assert not torch.equal(state["w"], SECRET)


def claiming_a_huge_data_pkl(archive: bytes) -> bytes:
    """The archive with its directory claiming a data.pkl of 2 GiB."""
    name = next(n for n in zipfile.ZipFile(io.BytesIO(archive)).namelist() if n.endswith("/data.pkl"))
    record = archive.rindex(name.encode()) - 46  # the entry's record in the central directory
    assert archive[record : record + 4] == b"PK\x01\x02"
    return archive[: record + 20] + struct.pack("<II", 0x7FFFFFFF, 0x7FFFFFFF) + archive[record + 28 :]


def test_an_archive_claiming_a_huge_data_pkl_costs_no_memory(tmp_path):
    path = tmp_path / "ckpt"
    dcp.save({"big": torch.arange(20_000.0)}, checkpoint_id=path)  # over 64 KiB: parsed in place, not copied
    rewrite_item(path, "big", claiming_a_huge_data_pkl)
    tracemalloc.start()
    try:
        with pytest.raises(RestoreError, match=r"\(big\): not a torch\.save tensor archive"):
            agent.restore(path, {"big": torch.zeros(20_000)})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20


def test_an_untouched_archive_still_reads_after_the_rewrite(tmp_path):
    """The crafting helpers change only what each case says: the original archive, moved the same
    way, restores."""
    path = dcp_checkpoint(tmp_path / "ckpt")
    rewrite_item(path, "w", lambda archive: with_data_pkl(archive, data_pkl_of(archive)))
    state = dcp_state()
    agent.restore(path, state)
    assert torch.equal(state["w"], torch.arange(16.0))


# --- torchsnapshot: objects and manifest locations ---------------------------------------------


def test_torchsnapshot_object_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    torchsnapshot.Snapshot.take(str(tmp_path / "snap"), {"s": torchsnapshot.StateDict(thing=Touch(marker))})
    with pytest.raises(RestoreError, match=r"snap/0/s/thing: 's/thing' is a pickled .*Touch that safe loading "
                                           r"refuses .*trust_pickles=True"):
        agent.restore(tmp_path / "snap", {"s": torchsnapshot.StateDict(thing=None)})
    assert not marker.exists()
    agent.restore(tmp_path / "snap", {"s": torchsnapshot.StateDict(thing=None)}, trust_pickles=True)
    assert marker.exists()


def snapshot_reading(tmp_path: Path, location: str) -> Path:
    """A real snapshot whose tensor 's/w' is said to be stored at ``location``."""
    snap = tmp_path / "snap"
    torchsnapshot.Snapshot.take(str(snap), {"s": torchsnapshot.StateDict(w=torch.arange(16.0), v=torch.ones(4))})
    metadata = SnapshotMetadata.from_yaml((snap / ".snapshot_metadata").read_text())
    metadata.manifest["0/s/w"].location = location
    metadata.manifest["0/s/w"].byte_range = [0, 64]
    (snap / ".snapshot_metadata").write_text(metadata.to_yaml())
    return snap


def outside_file(tmp_path: Path) -> Path:
    path = tmp_path / "outside.bin"
    path.write_bytes(SECRET.numpy().tobytes())
    return path


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink"])
def test_manifest_locations_outside_the_snapshot_are_refused(tmp_path, kind):
    outside = outside_file(tmp_path)
    location = {"absolute": str(outside), "dotdot": "../outside.bin", "symlink": "batched/evil"}[kind]
    snap = snapshot_reading(tmp_path, location)
    if kind == "symlink":
        os.symlink(outside, snap / "batched" / "evil")
    refusal = rf"snap/\.snapshot_metadata: '0/s/w' is stored at '{location}', .*restore another one"
    state = torchsnapshot.StateDict(w=torch.zeros(16), v=torch.zeros(4))
    with pytest.raises(RestoreError, match=refusal):
        agent.restore(snap, {"s": state})
    assert torch.equal(state["w"], torch.zeros(16))
    with pytest.raises(RestoreError, match=refusal):  # the agent's prefetch never reads it either
        node_share(snap, [0], 1)
    with pytest.raises(RestoreError, match=refusal):  # nor does `torchrevive verify`
        check_snapshot(snap)


def test_symlinks_inside_the_snapshot_are_followed(tmp_path):
    snap = snapshot_reading(tmp_path, "batched/alias")
    os.symlink(next((snap / "batched").iterdir()).name, snap / "batched" / "alias")
    os.symlink(snap, tmp_path / "latest")
    state = torchsnapshot.StateDict(w=torch.zeros(16), v=torch.zeros(4))
    agent.restore(tmp_path / "latest", {"s": state})
    assert torch.equal(state["w"], torch.arange(16.0))


def test_checksum_record_naming_a_file_outside_is_refused(tmp_path):
    outside = outside_file(tmp_path)
    snap = tmp_path / "snap"
    torchsnapshot.Snapshot.take(str(snap), {"s": torchsnapshot.StateDict(w=torch.arange(16.0))})
    digests = digest_files(snap, data_files(snap))
    write_checksums(snap, {**digests, "../outside.bin": digest_file(outside)})  # a record that matches it
    with pytest.raises(RestoreError, match=r"\.torchrevive_checksums\.json: 'files' is stored at '\.\./outside\.bin', "
                                           r"a path with '\.\.'"):
        check_snapshot(snap)


# --- DCP: a data file shorter than its metadata says, before or while it is read ------------------

TRUNCATED_DCP = """
import os, sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
import agent
from agent.restore.dcp_reader import FastStorageReader

path, victim, when = sys.argv[1:]


class Truncating(DefaultLoadPlanner):
    # Byte items load first: the file was mapped to read this one, and shrinks before the tensors are read.
    def load_bytes(self, read_item, value):
        super().load_bytes(read_item, value)
        os.truncate(victim, 0)


state = {"w": torch.zeros(4096), "step": 0}
try:
    if when == "before":
        os.truncate(victim, os.path.getsize(victim) // 2)
        agent.restore(path, state)
    else:
        dcp.load(state, storage_reader=FastStorageReader(path), planner=Truncating())
except agent.RestoreError as exc:
    print("refused: RestoreError", exc)
except CheckpointException as exc:  # DCP wraps the reader's error in its own
    [(failure, _)] = exc.failures.values()
    print("refused:", type(failure).__name__, failure)
"""


@pytest.mark.parametrize("when, refusal", [
    ("before", r" \(w\): bytes \d+\.\.\d+ lie outside the \d+ bytes that hold them; the checkpoint is damaged"),
    ("during", r": 0 bytes, \d+ needed \(truncated while being restored\), for 'w'; the checkpoint is damaged"),
])
def test_a_dcp_file_truncated_before_or_while_it_is_read_raises_naming_it(tmp_path, when, refusal):
    """A mapping touched past the end of its file raises SIGBUS, which kills the rank (so the
    restore runs in a process of its own): each file's size is checked with the metadata, and
    again before each item is read."""
    path = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4096.0), "step": 7}, storage_writer=dcp.FileSystemWriter(path, thread_count=1))
    [victim] = path.glob("*.distcp")
    done = subprocess.run([sys.executable, "-c", TRUNCATED_DCP, str(path), str(victim), when], cwd=REPO,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the restore died (exit {done.returncode}): {done.stderr[-2000:]}"
    assert re.search(rf"refused: RestoreError {re.escape(str(victim))}{refusal}: restore another one", done.stdout), \
        done.stdout + done.stderr
