"""Hostile checkpoints are refused, never executed: manifests that name files outside the
snapshot. Each crafted checkpoint is a real one (written by torchsnapshot) with its metadata
rewritten."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchsnapshot
from torchsnapshot.manifest import SnapshotMetadata

import agent
from agent import RestoreError
from agent.checkpoint.checksums import data_files, digest_file, digest_files, write_checksums
from agent.checkpoint.verify import check_snapshot
from agent.prefetch import node_share

SECRET = torch.full((16,), 7777.0)
"""Bytes outside the checkpoint that a crafted one tries to read into the weights."""


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
