"""The checkpoint directory's protocol files: the fence only grows (a stale leader is refused,
concurrent leaders never lower it), and every marker and fence change is durable before what
depends on it (seen in the system calls, under strace)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import REPO, worker_env
from torch import nn

from agent.checkpoint import Checkpointer
from agent.checkpoint.dirs import fence_path, fenced_round, write_fence
from agent.errors import StaleRoundError


def test_a_lower_round_never_lowers_the_fence(tmp_path):
    write_fence(tmp_path, 5)
    with pytest.raises(StaleRoundError, match=rf"{fence_path(tmp_path, 5)}: the job is in round 5; this leader's "
                                              r"round 3 is older"):
        write_fence(tmp_path, 3)
    assert fenced_round(tmp_path) == 5
    write_fence(tmp_path, 5)  # the same round again: nothing changes
    write_fence(tmp_path, 6)
    assert fenced_round(tmp_path) == 6


def test_round_0_starts_a_new_run_of_the_job(tmp_path):
    """A resubmitted job's rendezvous counts from round 0 again: it takes the directory over."""
    for round in (3, 7):
        write_fence(tmp_path, round)
    write_fence(tmp_path, 0)
    assert fenced_round(tmp_path) == 0
    write_fence(tmp_path, 1)
    assert fenced_round(tmp_path) == 1


def test_concurrent_leaders_never_lower_the_fence(tmp_path):
    rounds = list(range(1, 151))
    errors: list[BaseException] = []
    seen: list[int] = []
    writing = threading.Event()

    def leader(seed: int) -> None:
        order = rounds[:]
        random.Random(seed).shuffle(order)
        for round in order:
            try:
                write_fence(tmp_path, round)
            except StaleRoundError:
                pass  # refused: a newer round is recorded
            except BaseException as exc:  # noqa: BLE001  (any other failure fails the test)
                errors.append(exc)

    def reader() -> None:
        while writing.is_set():
            seen.append(fenced_round(tmp_path) or 0)

    writing.set()
    watcher = threading.Thread(target=reader)
    watcher.start()
    leaders = [threading.Thread(target=leader, args=(seed,)) for seed in range(6)]
    for thread in leaders:
        thread.start()
    for thread in leaders:
        thread.join()
    writing.clear()
    watcher.join()
    assert errors == []
    assert fenced_round(tmp_path) == max(rounds)
    assert seen == sorted(seen), "a reader saw the fence go down"
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".torchrevive_round")]) <= 2 + len(leaders)


TRACED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from agent.checkpoint.dirs import write_fence
    from agent.checkpoint.retention import prune
    root = Path(sys.argv[1])
    write_fence(root, 4)
    prune(root, keep=1, protected=())
""")


def test_the_fence_and_the_uncommit_are_durable_before_what_follows(tmp_path):
    """Under strace: the fence file's directory is fsync'ed after it is created; retention
    fsyncs a snapshot's directory after unlinking its commit marker, before removing anything
    else of it (a power loss mid-removal must not leave a committed-looking, half-removed one)."""
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, staging=False)
    torch.manual_seed(0)
    for step in (1, 2):
        ckpt.save(step, {"model": nn.Linear(8, 8)})
    trace = tmp_path / "trace"
    done = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e",
                           "trace=openat,unlink,unlinkat,rmdir,fsync", sys.executable, "-c", TRACED, str(root)],
                          cwd=REPO, env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [line.split(None, 1)[1] for line in trace.read_text().splitlines() if " " in line]

    def index(pattern: str, after: int = -1) -> int:
        """The first call after ``after`` that matches; len(calls) when none does."""
        return next((i for i, call in enumerate(calls) if i > after and re.search(pattern, call)), len(calls))

    def fsync_of_dir(path: str, after: int) -> int:
        opened = index(rf'^openat\(AT_FDCWD, "{re.escape(path)}", [A-Z_|]*O_DIRECTORY.* = (\d+)$', after)
        if opened == len(calls):
            return opened
        fd = re.search(r"= (\d+)$", calls[opened]).group(1)
        return index(rf"^fsync\({fd}\)", opened)

    created = index(rf'^openat\(AT_FDCWD, "{re.escape(str(fence_path(root, 4)))}", .*O_CREAT')
    assert created < fsync_of_dir(str(root), created) < len(calls)
    marker = str(root / "step_1" / ".torchrevive_commit")
    unlinked = index(rf'^unlink(at)?\((AT_FDCWD, )?"{re.escape(marker)}"')
    synced = fsync_of_dir(str(root / "step_1"), unlinked)
    removals = [i for i, call in enumerate(calls) if i > unlinked and call.startswith(("unlink", "rmdir"))]
    assert removals and synced < removals[0], calls[unlinked:]
    assert not (root / "step_1").exists() and (root / "step_2").exists()
