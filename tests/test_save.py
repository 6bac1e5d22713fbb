"""The staged save: a copy on the training thread, the write and commit in the background, commit
work proportional to what each rank wrote (counted with strace), fencing of stale rounds, and a
failure on one rank only raised on every rank, on real gloo process groups."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torchsnapshot
from conftest import REPO, TORCHREVIVE, worker_env
from distributed import run_ranks
from torch import nn

import agent
from agent.checkpoint import Checkpointer, CheckpointError
from agent.checkpoint.dirs import list_partial, write_fence
from agent.events import EventLog, read_events


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "progress": torchsnapshot.StateDict(step=seed)}


def test_the_save_returns_after_the_copy_and_later_changes_do_not_leak_in(tmp_path):
    log = tmp_path / "events.jsonl"
    ckpt = Checkpointer(tmp_path / "ckpt", events=EventLog(log))
    app = model_state(1)
    expected = {k: v.clone() for k, v in app["model"].state_dict().items()}
    assert ckpt.save(1, app)
    with torch.no_grad():  # training goes on while the snapshot is written
        for p in app["model"].parameters():
            p.add_(1.0)
    app["progress"]["step"] = 99
    ckpt.wait()
    target = model_state(2)
    assert Checkpointer(tmp_path / "ckpt", staging=False).restore(target) == 1
    torch.testing.assert_close(target["model"].state_dict(), expected, rtol=0, atol=0)
    assert target["progress"]["step"] == 1
    ckpt.save(2, app)
    ckpt.wait()
    started = [e for e in read_events(log) if e["event"] == "save_started"]
    committed = [e for e in read_events(log) if e["event"] == "save_committed"]
    # the buffers are allocated once: the same bytes staged at every save, about the state's size
    state_bytes = sum(t.numel() * t.element_size() for t in app["model"].state_dict().values()) * 3
    assert started[0]["staged_bytes"] == started[1]["staged_bytes"] >= state_bytes
    assert [e["step"] for e in committed] == [1, 2] and all(e["seconds"] > 0 for e in committed)


class CountedDraws(torchsnapshot.StateDict):
    """A stateful whose ``state_dict`` draws from the RNG (as some samplers' do) and counts its calls."""

    calls = 0

    def state_dict(self) -> dict:
        CountedDraws.calls += 1
        torch.rand(1)
        return super().state_dict()


@pytest.mark.parametrize("staging", [True, False], ids=["staged", "synchronous"])
def test_a_save_reads_each_state_dict_once_and_leaves_the_rng_as_it_saved_it(tmp_path, staging):
    torch.manual_seed(7)
    app = {"draws": CountedDraws(n=1), "rng": torchsnapshot.RNGState()}
    before = torch.get_rng_state()
    CountedDraws.calls = 0
    ckpt = Checkpointer(tmp_path / "ckpt", staging=staging)
    ckpt.save(1, app)
    ckpt.wait()
    assert CountedDraws.calls == 1
    # Saving moved neither the RNG nor what was saved of it (read first, put back after the others).
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(8)
    Checkpointer(tmp_path / "ckpt").restore({"draws": CountedDraws(n=0), "rng": torchsnapshot.RNGState()})
    assert torch.equal(torch.get_rng_state(), before)


def ddp_save_and_read_back(rank: int, world_size: int, root: str) -> None:
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)))
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 32)).sum().backward()
    optim.step()
    app = {"model": model, "optim": optim, "progress": torchsnapshot.StateDict(rank=rank)}
    ckpt = Checkpointer(root)
    ckpt.save(5, app)
    ckpt.wait()
    # What plain torchsnapshot makes of the same state, told (as its docs advise for DDP) that the
    # optimizer's state is replicated too.
    torchsnapshot.Snapshot.take(f"{root}/direct", app, replicated=["optim/**"])

    staged_manifest = torchsnapshot.Snapshot(f"{root}/step_5").get_manifest()
    direct_manifest = torchsnapshot.Snapshot(f"{root}/direct").get_manifest()
    assert {k: (type(v).__name__, getattr(v, "replicated", None)) for k, v in staged_manifest.items()} == \
        {k: (type(v).__name__, getattr(v, "replicated", None)) for k, v in direct_manifest.items()}
    assert staged_manifest["0/model/module.0.weight"].replicated  # DDP state is written once, as torchsnapshot does
    assert staged_manifest["0/optim/state/0/exp_avg"].replicated  # and so is the state of its optimizer

    for read in ("torchrevive", "torchsnapshot"):
        torch.manual_seed(1)
        fresh_model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 8)))
        fresh = {"model": fresh_model, "optim": torch.optim.Adam(fresh_model.parameters()),
                 "progress": torchsnapshot.StateDict(rank=-1)}
        fresh["model"](torch.randn(4, 32)).sum().backward()
        fresh["optim"].step()
        if read == "torchrevive":
            agent.restore(f"{root}/step_5", fresh)
        else:
            torchsnapshot.Snapshot(f"{root}/step_5").restore(fresh)
        torch.testing.assert_close(fresh["model"].state_dict(), model.state_dict(), rtol=0, atol=0)
        torch.testing.assert_close(fresh["optim"].state_dict(), optim.state_dict(), rtol=0, atol=0)
        assert fresh["progress"]["rank"] == rank


def test_a_staged_ddp_and_adam_snapshot_reads_back_through_both_restores(tmp_path):
    run_ranks(2, ddp_save_and_read_back, str(tmp_path))


def replicated_patterns_of_mixed_state(rank: int, world_size: int) -> None:
    from agent.checkpoint.compat import replicated_patterns

    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    local = nn.Linear(4, 4)  # not DDP: its parameters may differ between ranks
    app = {"model": ddp, "local": local, "optim": torch.optim.Adam(ddp.parameters()),
           "local_optim": torch.optim.SGD(local.parameters()),
           "mixed_optim": torch.optim.SGD([*ddp.parameters(), *local.parameters()])}
    assert sorted(replicated_patterns(app)) == ["model/**", "optim/**"]


def test_only_an_optimizer_of_ddp_parameters_alone_is_replicated():
    run_ranks(1, replicated_patterns_of_mixed_state)


COUNTED_SAVE = textwrap.dedent("""
    import os, sys
    import torch, torchsnapshot
    sys.path.insert(0, "tests")
    from distributed import run_ranks
    from agent.checkpoint import Checkpointer

    def save(rank, world_size, root):
        with open(f"{root}/pid-{os.getpid()}", "w") as f:
            f.write(str(rank))
        torch.manual_seed(rank)  # each rank's own state: every rank writes its own files
        state = torchsnapshot.StateDict(**{f"t{i}": torch.randn(64 << 10) for i in range(6)})
        ckpt = Checkpointer(f"{root}/ckpt")
        ckpt.save(1, {"state": state})  # staged: the write and the commit run in the background
        ckpt.wait()

    if __name__ == "__main__":
        run_ranks(4, save, sys.argv[1])
""")


def test_each_rank_opens_and_fsyncs_only_the_files_it_wrote(tmp_path):
    """4 ranks under strace: every file of the snapshot is opened by exactly one rank, the one
    that wrote it; no rank reads a snapshot file back; fsyncs are about one per file written."""
    script = tmp_path / "counted_save.py"
    script.write_text(COUNTED_SAVE)
    trace = tmp_path / "trace"
    done = subprocess.run(["strace", "-f", "-qq", "-ff", "-e", "trace=openat,fsync,fdatasync,clone,clone3", "-o",
                           str(trace), sys.executable, str(script), str(tmp_path)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = {int(log.suffix[1:]): log.read_text().splitlines() for log in trace.parent.glob("trace.*")}
    ranks = {int(p.name.removeprefix("pid-")): int(p.read_text()) for p in tmp_path.glob("pid-*")}
    process_of = _threads_to_processes(logs)
    snapshot = tmp_path / "ckpt" / "step_1"
    files = {str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()}
    opened_by: dict[str, list[int]] = defaultdict(list)
    fsyncs: dict[int, int] = defaultdict(int)
    written: dict[int, int] = defaultdict(int)
    ckpt_dir = re.escape(str(tmp_path / "ckpt"))
    open_call = re.compile(rf'openat\(AT_FDCWD, "{ckpt_dir}/step_1(?:\.r-\.partial)?/([^"]+)", ([A-Z_|]+).*= \d+$')
    for tid, lines in logs.items():
        rank = ranks.get(process_of.get(tid, tid))
        for line in lines:
            if rank is not None and line.startswith(("fsync(", "fdatasync(")):
                fsyncs[rank] += 1
            if (match := open_call.match(line)) and "O_DIRECTORY" not in match.group(2):
                assert rank is not None, f"a process that is no rank opened {match.group(1)}"
                assert "O_WRONLY" in match.group(2) or "O_RDWR" in match.group(2), \
                    f"rank {rank} read {match.group(1)} back"
                opened_by[match.group(1)].append(rank)
                written[rank] += 1
    assert len(ranks) == 4 and set(ranks.values()) == {0, 1, 2, 3}
    data_files = files - {".torchrevive_commit", ".torchrevive_checksums.json", ".snapshot_metadata"}
    assert len(data_files) >= 4 and all(len(opened_by[f]) == 1 for f in data_files), dict(opened_by)
    assert {opened_by[f][0] for f in data_files} == {0, 1, 2, 3}  # every rank wrote its own share
    for rank in range(4):  # one fsync per file it wrote, plus its directories
        assert written[rank] <= fsyncs[rank] <= written[rank] + 4, (rank, written[rank], fsyncs[rank])
    assert sum(fsyncs.values()) <= len(files) + 4 * 4


def _threads_to_processes(logs: dict[int, list[str]]) -> dict[int, int]:
    """Thread id -> the id of its process, from the clone calls in per-thread strace logs."""
    parent: dict[int, int] = {}
    for tid, lines in logs.items():
        for line in lines:
            if line.startswith("clone") and "CLONE_THREAD" in line and (child := re.search(r"= (\d+)$", line)):
                parent[int(child.group(1))] = tid
    process_of = {}
    for tid in logs:
        root = tid
        while root in parent:
            root = parent[root]
        process_of[tid] = root
    return process_of


def test_a_stale_round_never_commits(tmp_path):
    Checkpointer(tmp_path, round=3, staging=False).save(1, model_state(1))
    write_fence(tmp_path, 4)  # the job moved on to round 4 while a node of round 3 was frozen
    stale = Checkpointer(tmp_path, round=3)
    stale.save(2, model_state(2))
    with pytest.raises(CheckpointError, match=r"step_2: saving step 2 failed \(round 3 is stale \(the job is in "
                                              r"round 4\).*step_1 stays the latest"):
        stale.wait()
    assert not (tmp_path / "step_2").exists() and list_partial(tmp_path) == []
    with pytest.raises(CheckpointError, match="round 3 is stale"):
        Checkpointer(tmp_path, round=3, staging=False).save(2, model_state(2))
    current = Checkpointer(tmp_path, round=4, staging=False)
    current.save(2, model_state(2))
    assert current.latest() == tmp_path / "step_2"


def test_a_fence_that_moves_between_the_check_and_the_rename_still_stops_the_commit(tmp_path, monkeypatch):
    from agent.checkpoint import commit as commit_module

    checked = commit_module._stale

    def leader_moves_on_right_after_the_check(save):
        verdict = checked(save)  # round 3 is current here...
        write_fence(tmp_path, 4)  # ...and the next round's leader records round 4 before the rename
        return verdict

    monkeypatch.setattr(commit_module, "_stale", leader_moves_on_right_after_the_check)
    with pytest.raises(CheckpointError, match=r"round 3 is stale \(the job is in round 4\)"):
        Checkpointer(tmp_path, round=3, staging=False).save(1, model_state(1))
    assert not (tmp_path / "step_1").exists() and list_partial(tmp_path) == []


def test_list_shows_a_dead_save_as_incomplete_and_retention_removes_it(tmp_path):
    Checkpointer(tmp_path, round=1, staging=False).save(1, model_state(1))
    dead = tmp_path / "step_2.r1.partial"
    shutil.copytree(tmp_path / "step_1", dead)  # a save of round 1 whose node died before the rename
    listing = subprocess.run([*TORCHREVIVE, "list", str(tmp_path)], cwd=REPO, env=worker_env(), capture_output=True,
                             text=True, timeout=60)
    rows = [line.split() for line in listing.stdout.splitlines()[1:]]
    assert [(r[0], r[1], r[-1]) for r in rows] == [("1", "committed", str(tmp_path / "step_1")),
                                                   ("2", "incomplete", str(dead))]
    Checkpointer(tmp_path, round=2, staging=False).save(3, model_state(3))
    assert not dead.exists() and (tmp_path / "step_1").exists()


def save_with_a_full_disk_on_rank_1(rank: int, world_size: int, root: str, staging: bool) -> None:
    import resource
    import signal

    ckpt = Checkpointer(root, staging=staging)
    ckpt.save(1, model_state(rank))
    ckpt.wait()
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
    big = {"state": torchsnapshot.StateDict(t=torch.randn(256 << 10))}  # 1 MiB on every rank
    started = time.monotonic()
    with pytest.raises(CheckpointError) as failure:
        ckpt.save(2, big)
        ckpt.save(3, big)  # with staging, the failure of step 2 is raised here, at the next save
    assert time.monotonic() - started < 60  # not the collective timeout
    message = str(failure.value)
    assert "saving step 2 failed (writing " in message and "File too large" in message, message
    assert f"{root}/step_1 stays the latest committed one" in message
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    dist.barrier()
    assert ckpt.latest() == Path(root) / "step_1" and not (Path(root) / "step_2").exists()
    ckpt.save(3, big)  # the disk has room again: saving works again
    ckpt.wait()
    assert ckpt.latest() == Path(root) / "step_3"


@pytest.mark.parametrize("staging", [True, False], ids=["staged", "sync"])
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank(tmp_path, staging):
    run_ranks(3, save_with_a_full_disk_on_rank_1, str(tmp_path), staging)
    assert [p.name for p in sorted(tmp_path.iterdir())] == ["step_1", "step_3"]
    marker = json.loads((tmp_path / "step_3" / ".torchrevive_commit").read_text())
    assert marker["world_size"] == 3


def test_on_busy_skip_skips_a_save_while_the_previous_one_is_written(tmp_path, monkeypatch):
    import agent.checkpoint.checkpointer as checkpointer

    release = threading.Event()
    write = checkpointer.write_snapshot

    def held_write(*args, **kwargs):  # the writer holds until the test lets it go
        release.wait(timeout=60)
        return write(*args, **kwargs)

    monkeypatch.setattr(checkpointer, "write_snapshot", held_write)
    log = tmp_path / "events.jsonl"
    ckpt = Checkpointer(tmp_path / "ckpt", on_busy="skip", events=EventLog(log))
    app = model_state(1)
    assert ckpt.save(1, app)
    with pytest.warns(UserWarning, match="skipping the save of step 2: step 1 is still being written"):
        assert not ckpt.save(2, app)
    release.set()
    ckpt.wait()
    assert ckpt.latest() == tmp_path / "ckpt" / "step_1" and not (tmp_path / "ckpt" / "step_2").exists()
    assert [e for e in read_events(log) if e["event"] == "save_skipped"][0]["busy_with"] == 1
    assert ckpt.save(3, app)  # nothing in flight: saves again
    ckpt.wait()
    assert ckpt.latest() == tmp_path / "ckpt" / "step_3"


@pytest.mark.parametrize("staging", [True, False])
def test_snapshot_files_are_written_by_threads_that_yield_the_cpu_to_training(tmp_path, monkeypatch, staging):
    import os

    from agent.checkpoint import write

    priorities: dict[int, tuple[int, int]] = {}
    real_write = write.DurableFSPlugin._write_durably

    def noting_priority(plugin, relative, buf):
        real_write(plugin, relative, buf)
        thread = threading.get_native_id()
        priorities[thread] = (os.sched_getscheduler(thread), os.getpriority(os.PRIO_PROCESS, thread))

    monkeypatch.setattr(write.DurableFSPlugin, "_write_durably", noting_priority)
    expected = {"idle": (os.SCHED_IDLE, 0), 10: (os.SCHED_OTHER, 10), 0: (os.SCHED_OTHER, 0)}
    for priority, policy_and_nice in expected.items():
        priorities.clear()
        checkpointer = Checkpointer(tmp_path / f"priority{priority}", staging=staging, writer_nice=priority, round=None)
        checkpointer.save(1, {"model": nn.Linear(300, 300)})
        checkpointer.wait()
        assert priorities and set(priorities.values()) == {policy_and_nice}, (priority, priorities)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # training's thread is untouched
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == 0  # training's thread is untouched


@pytest.mark.parametrize("preset, expected", [(None, 3), ("5", 5)])
def test_write_threads_caps_torchsnapshot_writes_in_flight_unless_the_environment_says(preset, expected):
    """In a fresh process: the knob is process-wide, read by torchsnapshot from the environment."""
    env = worker_env()
    env.pop("TORCHSNAPSHOT_MAX_PER_RANK_IO_CONCURRENCY_OVERRIDE", None)
    if preset is not None:
        env["TORCHSNAPSHOT_MAX_PER_RANK_IO_CONCURRENCY_OVERRIDE"] = preset
    code = ("from agent.checkpoint import Checkpointer; from torchsnapshot import knobs; "
            "Checkpointer('/nonexistent', write_threads=3, round=None); print(knobs.get_max_per_rank_io_concurrency())")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == expected
