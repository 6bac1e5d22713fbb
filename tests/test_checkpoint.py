"""Checkpointer: save through torchsnapshot, commit marker, latest(), retention, fallback, and
real processes killed in the middle of a save."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torchsnapshot
from conftest import REPO, worker_env
from torch import nn

from agent.checkpoint import Checkpointer, CheckpointError
from agent.errors import RestoreError
from agent.checkpoint.dirs import is_committed, list_snapshots
from agent.events import EventLog, read_events


def state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Linear(64, 32)
    return {"model": model, "progress": torchsnapshot.StateDict(step=seed)}


def weights(app: dict) -> torch.Tensor:
    return app["model"].weight.detach().clone()


@pytest.mark.parametrize("staging", [False, True])
def test_save_commit_latest_restore(tmp_path, staging):
    ckpt = Checkpointer(tmp_path, interval_steps=5, keep=3, staging=staging)
    assert ckpt.latest() is None and ckpt.restore(state(0)) is None
    saved = state(7)
    assert not ckpt.maybe_save(3, saved) and ckpt.maybe_save(5, saved)
    ckpt.wait()
    assert ckpt.latest() == tmp_path / "step_5" and is_committed(tmp_path / "step_5")
    target = state(1)
    assert ckpt.restore(target) == 5
    assert torch.equal(weights(target), weights(saved)) and target["progress"]["step"] == 7


def test_retention_keeps_the_newest_committed(tmp_path):
    ckpt = Checkpointer(tmp_path, keep=2, staging=False)
    leftover = tmp_path / "step_1"
    leftover.mkdir(parents=True)  # an uncommitted leftover of a crashed save
    for step in (2, 3, 4, 5):
        ckpt.save(step, state(step))
    assert [s for s, _ in list_snapshots(tmp_path)] == [4, 5]


def test_a_committed_snapshot_is_never_overwritten(tmp_path):
    """A step saved again (training went back past its snapshot) is skipped, not raised: a job whose
    restore fell back to an older snapshot must not crash at every pass through that step."""
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(1, state(1))
    with pytest.warns(UserWarning, match="skipping the save of step 1: .*step_1 is committed already"):
        assert not ckpt.save(1, state(2))
    target = state(0)
    assert ckpt.restore(target) == 1 and torch.equal(weights(target), weights(state(1)))


def test_a_save_due_before_a_round_began_and_never_committed_is_taken_at_its_first_step(tmp_path):
    """An in-process round that ended at step 10's end (Round.step_done raises before that step's
    maybe_save), or while step 10's save was written, goes on from memory in the next round: that
    round's first maybe_save saves, or a later restore would go back to step 5."""
    log = tmp_path / "events.jsonl"
    first_round = Checkpointer(tmp_path / "ckpt", interval_steps=5, staging=False, events=EventLog(log))
    for step in range(1, 10):
        first_round.maybe_save(step, state(step))
    assert first_round.latest() == tmp_path / "ckpt" / "step_5"
    next_round = Checkpointer(tmp_path / "ckpt", interval_steps=5, staging=False, events=EventLog(log))
    assert next_round.maybe_save(11, state(11))  # its first call: step 10's save was missed
    assert next_round.latest() == tmp_path / "ckpt" / "step_11"
    assert not next_round.maybe_save(12, state(12))  # only the first call looks back
    [caught_up] = [e for e in read_events(log) if e["event"] == "save_caught_up"]
    assert (caught_up["step"], caught_up["missed"]) == (11, 10)
    # Nothing missed: a round that began past a committed save, or before the first one was due.
    assert not Checkpointer(tmp_path / "ckpt", interval_steps=5, staging=False).maybe_save(12, state(12))
    assert not Checkpointer(tmp_path / "fresh", interval_steps=5, staging=False).maybe_save(4, state(4))
    # Missed, but the next save is due within half an interval: that one is left to save it.
    assert not Checkpointer(tmp_path / "ckpt", interval_steps=10, staging=False).maybe_save(27, state(27))
    assert [s for s, _ in list_snapshots(tmp_path / "ckpt")] == [5, 11]


def test_every_rank_catches_up_together(tmp_path):
    Checkpointer(tmp_path, interval_steps=5, staging=False).save(5, state(5))
    from distributed import run_ranks

    run_ranks(2, catch_up_after_a_round_ended, str(tmp_path))
    assert [s for s, _ in list_snapshots(tmp_path)] == [5, 11] and is_committed(tmp_path / "step_11")


def catch_up_after_a_round_ended(rank: int, world_size: int, root: str) -> None:
    """Both ranks decide on rank 0's listing and save step 11 together (one rank alone would wait
    in the save's collectives)."""
    assert Checkpointer(Path(root), interval_steps=5, staging=False).maybe_save(11, state(11))


def test_damaged_latest_falls_back_to_the_previous(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(1, state(1))
    ckpt.save(2, state(2))
    data = max((p for p in (tmp_path / "step_2").rglob("*") if p.is_file() and not p.name.startswith(".")),
               key=lambda p: p.stat().st_size)
    with open(data, "r+b") as f:
        f.truncate(10)
    target = state(0)
    with pytest.warns(UserWarning, match="falling back from .*step_2: .*truncated"):
        assert ckpt.restore(target) == 1
    assert torch.equal(weights(target), weights(state(1)))


def test_no_snapshot_restores_is_an_error(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(1, state(1))
    (tmp_path / "step_1" / ".snapshot_metadata").unlink()
    with pytest.warns(UserWarning), pytest.raises(RestoreError, match="no committed snapshot restores"):
        ckpt.restore(state(0))


KILLER = textwrap.dedent("""
    import os, signal, sys
    import torch, torchsnapshot
    from torch import nn
    import agent.checkpoint.checkpointer as checkpointer
    import agent.checkpoint.commit as commit
    from agent.checkpoint.write import DurableFSPlugin
    root, point = sys.argv[1], sys.argv[2]
    ckpt = checkpointer.Checkpointer(root, staging=point != "sync-before-data")
    torch.manual_seed(1)
    ckpt.save(1, {"model": nn.Linear(64, 32)})
    ckpt.wait()
    die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
    if point.endswith("before-data"):
        torchsnapshot.Snapshot.take = die
    elif point == "mid-data":  # the second file written kills the process
        write, written = DurableFSPlugin._write_durably, []
        def write_then_die(self, relative, buf):
            if written:
                die()
            write(self, relative, buf)
            written.append(relative)
        DurableFSPlugin._write_durably = write_then_die
    elif point == "before-marker":
        commit.write_checksums = die
    elif point == "before-rename":  # the marker is durable, the directory not yet renamed
        commit._stale = die
    elif point == "after-commit":
        checkpointer.prune = die
    big = {"model": nn.Linear(64, 32), "big": torchsnapshot.StateDict(t=torch.randn(512, 4096))}
    ckpt.save(2, big)
    ckpt.wait()
    print("not killed", flush=True)
""")


@pytest.mark.parametrize("point", ["before-data", "sync-before-data", "mid-data", "before-marker", "before-rename",
                                   "after-commit"])
def test_kill_during_save_keeps_the_last_committed_snapshot(tmp_path, point):
    proc = subprocess.run([sys.executable, "-c", KILLER, str(tmp_path), point], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    ckpt = Checkpointer(tmp_path, staging=False)
    if point == "after-commit":  # killed after the commit: the snapshot is there, whole
        assert ckpt.latest() == tmp_path / "step_2"
        target = {"model": nn.Linear(64, 32), "big": torchsnapshot.StateDict(t=torch.zeros(512, 4096))}
        assert ckpt.restore(target) == 2 and target["big"]["t"].abs().sum() > 0
        return
    assert ckpt.latest() == tmp_path / "step_1"
    assert not (tmp_path / "step_2").exists()
    target = {"model": nn.Linear(64, 32)}
    assert ckpt.restore(target) == 1
    torch.manual_seed(1)
    assert torch.equal(weights(target), nn.Linear(64, 32).weight.detach())
    # the next save of step 2 commits, and the dead save's leftover is gone
    ckpt.save(2, {"model": nn.Linear(64, 32)})
    assert ckpt.latest() == tmp_path / "step_2"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == ["step_1", "step_2"]


def test_from_env_reads_the_job_config(tmp_path, monkeypatch):
    config = tmp_path / "job.yaml"
    config.write_text(f"checkpoint: {{dir: {tmp_path / 'ck'}, interval_steps: 7, keep: 4, staging: false}}\n"
                      "restore: {io_threads: 2}\n")
    monkeypatch.setenv("TORCHREVIVE_CONFIG", str(config))
    monkeypatch.delenv("TORCHREVIVE_CHECKPOINT_DIR", raising=False)
    ckpt = Checkpointer.from_env()
    assert (ckpt.root, ckpt.interval_steps, ckpt.keep, ckpt.staging) == (tmp_path / "ck", 7, 4, False)
    assert ckpt.restore_options["io_threads"] == 2
    monkeypatch.delenv("TORCHREVIVE_CONFIG")
    with pytest.raises(CheckpointError, match="set checkpoint.dir"):
        Checkpointer.from_env()


def fsdp_save(rank: int, world_size: int, root: str) -> None:
    from test_restore_reshard import build

    model, optim = build(seed=0)
    model(torch.randn(4, 10)).sum().backward()
    optim.step()
    ckpt = Checkpointer(root, keep=1, staging=True)
    ckpt.save(10, {"model": model, "optim": optim})
    ckpt.wait()
    torch.save({k: v.full_tensor() for k, v in model.state_dict().items()}, f"{root}/reference-{rank}.pt")


def fsdp_restore(rank: int, world_size: int, root: str) -> None:
    from test_restore_reshard import build

    model, optim = build(seed=1)
    assert Checkpointer(root).restore({"model": model, "optim": optim}) == 10
    reference = torch.load(f"{root}/reference-0.pt", weights_only=True)
    torch.testing.assert_close({k: v.full_tensor() for k, v in model.state_dict().items()}, reference, rtol=0, atol=0)
    assert len(optim.state) == len(list(model.parameters()))


def test_fsdp2_state_through_the_checkpointer_two_to_three_ranks(tmp_path):
    from distributed import run_ranks

    run_ranks(2, fsdp_save, str(tmp_path))
    assert is_committed(tmp_path / "step_10")
    run_ranks(3, fsdp_restore, str(tmp_path))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=REPO, env=worker_env(),
                          capture_output=True, text=True, timeout=60)


def test_list_and_inspect_show_each_snapshot_and_its_state(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False)
    ckpt.save(3, {"model": nn.Linear(64, 32), "extra": torchsnapshot.StateDict(h=torch.zeros(10, dtype=torch.float16))})
    (tmp_path / "step_4").mkdir()  # a save that died before torchsnapshot wrote its metadata
    listing = cli("list", str(tmp_path))
    assert listing.returncode == 0, listing.stderr
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[2]) for r in rows] == [("3", "committed", "1"), ("4", "incomplete", "-")]
    shown = cli("inspect", str(tmp_path / "step_3"))
    assert shown.returncode == 0, shown.stderr
    assert "step        3" in shown.stdout and "committed   yes" in shown.stdout
    assert "tensors     3 (0 sharded, 0 replicated)" in shown.stdout
    assert "float32           2 tensors     8.1 KiB" in shown.stdout
    assert "float16           1 tensors" in shown.stdout
    missing = cli("inspect", str(tmp_path / "step_4"))
    assert missing.returncode == 1 and "step_4/.snapshot_metadata: missing" in missing.stderr


def test_the_earlier_name_of_staging_is_accepted_with_a_deprecation_warning(tmp_path):
    with pytest.warns(DeprecationWarning, match=r"Checkpointer\(async_save=...\) is deprecated"):
        checkpointer = Checkpointer(tmp_path, async_save=False, round=None)
    assert checkpointer.staging is False
