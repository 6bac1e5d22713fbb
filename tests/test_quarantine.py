"""Quarantine: a committed snapshot found damaged at a restore is set aside on every rank's
agreement (real gloo ranks, real snapshots), never restored or counted again, its step saved
anew, and shown by `torchrevive list`; a restore that fails for another reason, or a memory
tier snapshot, is left as it is."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchsnapshot
from conftest import REPO, TORCHREVIVE, worker_env
from distributed import run_ranks
from torch import nn

from agent.checkpoint import Checkpointer
from agent.checkpoint.checksums import CHECKSUMS_FILE
from agent.checkpoint.dirs import committed_snapshots, is_committed, list_quarantined
from agent.checkpoint.fallback import restore_first_good
from agent.checkpoint.quarantine import quarantine_reason
from agent.errors import RestoreError
from agent.events import EventLog, read_events
from agent.restore.manifest import load_metadata, stored_tensor


def rank_state(rank: int, step: int) -> dict:
    """Each rank's own tensor (not replicated): each rank writes, reads and checks only its own file."""
    torch.manual_seed(1000 * step + rank)
    return {"state": torchsnapshot.StateDict(t=torch.randn(64 << 10), step=step)}


def flip_a_byte_of(snapshot: Path, key: str) -> Path:
    """Flip the last byte of the file that holds manifest ``key``; that file."""
    [chunk, *_] = stored_tensor(load_metadata(snapshot).manifest[key]).chunks
    path = snapshot / chunk.location
    with open(path, "r+b") as f:
        f.seek(-1, 2)
        byte = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    return path


def restore_into_fresh(root: str, rank: int, events: str) -> tuple[int | None, dict]:
    target = {"state": torchsnapshot.StateDict(t=torch.zeros(64 << 10), step=-1)}
    step = Checkpointer(root, verify="full", events=EventLog(Path(events))).restore(target)
    return step, target


def quarantine_on_two_ranks(rank: int, world_size: int, root: str) -> None:
    ckpt = Checkpointer(root, keep=2)
    for step in (10, 20):
        ckpt.save(step, rank_state(rank, step))
    ckpt.wait()
    dist.barrier()
    if rank == 0:  # only rank 1's file is damaged: rank 1 alone finds it, rank 0 restores fine
        flip_a_byte_of(Path(root) / "step_20", "1/state/t")
    dist.barrier()

    with pytest.warns(UserWarning, match="falling back from .*step_20: .*do not match their checksum"):
        step, target = restore_into_fresh(root, rank, f"{root}/events-{rank}.jsonl")
    assert step == 10 and torch.equal(target["state"]["t"], rank_state(rank, 10)["state"]["t"])
    dist.barrier()  # rank 0 quarantines before it meets the others again
    assert [p.name for _, p in list_quarantined(Path(root))] == ["step_20.quarantined"]
    assert [s for s, _ in committed_snapshots(Path(root))] == [10]

    # a second restore never tries the quarantined snapshot: no fallback at all
    step, _ = restore_into_fresh(root, rank, f"{root}/again-{rank}.jsonl")
    assert step == 10
    assert [e["event"] for e in read_events(Path(f"{root}/again-{rank}.jsonl"))] == ["restore_done"]

    # training goes on: step 20 is saved anew (a committed snapshot of step 20 no longer exists)
    trainer = Checkpointer(root, keep=2)
    assert trainer.restore({"state": torchsnapshot.StateDict(t=torch.zeros(64 << 10), step=-1)}) == 10
    for step in (20, 30, 40):
        trainer.save(step, rank_state(rank, step))
    trainer.wait()
    dist.barrier()
    # keep=2: the newest good ones, and step 10 (this job restored from it); the damaged one stays aside
    assert [s for s, _ in committed_snapshots(Path(root))] == [10, 30, 40]
    assert [p.name for _, p in list_quarantined(Path(root))] == ["step_20.quarantined"]
    step, target = restore_into_fresh(root, rank, f"{root}/last-{rank}.jsonl")
    assert step == 40 and torch.equal(target["state"]["t"], rank_state(rank, 40)["state"]["t"])


def test_a_damaged_snapshot_is_quarantined_and_training_goes_on(tmp_path):
    root = tmp_path / "ckpt"
    run_ranks(2, quarantine_on_two_ranks, str(root), timeout_s=300)
    quarantined = root / "step_20.quarantined"
    assert not is_committed(quarantined) and (quarantined / ".snapshot_metadata").is_file()  # kept as evidence
    assert "do not match their checksum" in quarantine_reason(quarantined)
    [event] = [e for e in read_events(root / "events-0.jsonl") if e["event"] == "snapshot_quarantined"]
    assert event["snapshot"] == str(root / "step_20") and event["moved_to"] == str(quarantined)
    assert event["step"] == 20 and "do not match their checksum" in event["reason"]
    assert not any(e["event"] == "snapshot_quarantined" for e in read_events(root / "events-1.jsonl"))

    listing = subprocess.run([*TORCHREVIVE, "list", str(root)], cwd=REPO, env=worker_env(), capture_output=True,
                             text=True, timeout=60)
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[-1]) for r in rows if r[0] != "reason:"] == [
        ("10", "committed", str(root / "step_10")), ("20", "quarantined", str(quarantined)),
        ("30", "committed", str(root / "step_30")), ("40", "committed", str(root / "step_40"))]
    reason = listing.stdout.splitlines()[3]
    assert reason.split()[0] == "reason:" and "do not match their checksum" in reason


def model(width: int) -> dict:
    torch.manual_seed(width)
    return {"model": nn.Linear(width, 8)}


def test_a_restore_into_another_model_quarantines_nothing(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False, events=EventLog(tmp_path / "events.jsonl"))
    ckpt.save(1, model(16))
    ckpt.save(2, model(16))
    with pytest.warns(UserWarning, match="falling back"), pytest.raises(RestoreError, match="no committed snapshot"):
        ckpt.restore(model(32))  # the user's state is of another shape: not the snapshots' fault
    assert [s for s, _ in committed_snapshots(tmp_path)] == [1, 2] and list_quarantined(tmp_path) == []
    assert not any(e["event"] == "snapshot_quarantined" for e in read_events(tmp_path / "events.jsonl"))


@pytest.mark.parametrize("damage", ["metadata", "truncated"])
def test_structural_damage_is_quarantined(tmp_path, damage):
    ckpt = Checkpointer(tmp_path, staging=False, verify="off")  # found by rank 0's check, not by hashing
    ckpt.save(1, model(16))
    ckpt.save(2, model(16))
    snapshot = tmp_path / "step_2"
    if damage == "metadata":
        (snapshot / ".snapshot_metadata").write_text("{not yaml: [")
    else:
        [chunk, *_] = stored_tensor(load_metadata(snapshot).manifest["0/model/weight"]).chunks
        with open(snapshot / chunk.location, "r+b") as f:
            f.truncate(3)
    with pytest.warns(UserWarning, match="falling back"):
        assert ckpt.restore(model(16)) == 1
    assert [p.name for _, p in list_quarantined(tmp_path)] == ["step_2.quarantined"]
    ckpt.save(2, model(16))  # the step is saved anew
    assert [s for s, _ in committed_snapshots(tmp_path)] == [1, 2]


def rewrite_checksum_record(snapshot: Path, change) -> None:
    record_path = snapshot / CHECKSUMS_FILE
    record = json.loads(record_path.read_text())
    change(record)
    record_path.write_text(json.dumps(record))


def no_block_size(record: dict) -> None:
    record["block_bytes"] = 0


def a_block_missing(record: dict) -> None:
    name = next(iter(record["files"]))
    record["files"][name]["blocks"] = record["files"][name]["blocks"][:-1]


@pytest.mark.parametrize("change", [no_block_size, a_block_missing])
def test_a_malformed_checksum_record_is_damage_never_a_crash(tmp_path, change):
    ckpt = Checkpointer(tmp_path, staging=False, verify="full")
    ckpt.save(1, model(16))
    ckpt.save(2, model(16))
    rewrite_checksum_record(tmp_path / "step_2", change)
    with pytest.warns(UserWarning, match="falling back from .*step_2: .*malformed checksum record"):
        assert ckpt.restore(model(16)) == 1
    assert [p.name for _, p in list_quarantined(tmp_path)] == ["step_2.quarantined"]


def another_algorithm(snapshot: Path) -> None:
    rewrite_checksum_record(snapshot, lambda record: record.update(algorithm="xxh128"))


def unreadable_record(snapshot: Path) -> None:
    (snapshot / CHECKSUMS_FILE).unlink()
    (snapshot / CHECKSUMS_FILE).mkdir()  # reading it is an OSError (EISDIR), as an I/O error would be


@pytest.mark.parametrize("make_unreadable", [another_algorithm, unreadable_record])
def test_a_snapshot_unreadable_for_a_reason_other_than_damage_is_left_in_place(tmp_path, make_unreadable):
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(1, model(16))
    ckpt.save(2, model(16))
    make_unreadable(tmp_path / "step_2")
    with pytest.warns(UserWarning, match="falling back from .*step_2"):
        assert ckpt.restore(model(16)) == 1
    assert list_quarantined(tmp_path) == [] and is_committed(tmp_path / "step_2")


def test_a_second_damaged_save_of_a_step_is_kept_beside_the_first(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(1, model(16))
    for _ in range(2):
        ckpt.save(2, model(16))
        (tmp_path / "step_2" / ".snapshot_metadata").unlink()
        with pytest.warns(UserWarning, match="falling back"):
            assert Checkpointer(tmp_path, staging=False).restore(model(16)) == 1
    assert [p.name for _, p in list_quarantined(tmp_path)] == ["step_2.quarantined", "step_2.quarantined.1"]


def test_a_memory_tier_snapshot_is_never_quarantined(tmp_path):
    memory, storage = tmp_path / "memory", tmp_path / "storage"
    Checkpointer(memory / "r1", staging=False).save(2, model(16))
    Checkpointer(storage, staging=False).save(1, model(16))
    in_memory = memory / "r1" / "step_2"
    flip_a_byte_of(in_memory, "0/model/weight")
    with pytest.warns(UserWarning, match="do not match their checksum"):
        restored, _ = restore_first_good([in_memory, storage / "step_1"], model(16), {"verify": "full"},
                                         EventLog(tmp_path / "events.jsonl"), fully_verified=memory)
    assert restored == storage / "step_1"
    assert is_committed(in_memory) and list_quarantined(memory / "r1") == []
