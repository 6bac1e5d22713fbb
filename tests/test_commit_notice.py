"""The commit notice a node's local rank 0 leaves its agent: each commit replaces it, keeping the
time of the one before, so that the agent can tell when the next is due."""

from __future__ import annotations

import json
import threading
import time

import pytest
from torch import nn

from agent.checkpoint import Checkpointer
from agent.checkpoint.checkpointer import PACE_TOLD_AFTER
from agent.commit_notice import RESTORE_TIER, CommitNotice, read_notice, tell_pace, write_notice
from agent.events import EventLog, read_events


def test_each_commit_replaces_the_notice_and_keeps_the_previous_time(tmp_path):
    path = tmp_path / "notice.json"
    assert read_notice(path) is None  # nothing committed yet
    write_notice(path, step=10, tier="memory")
    first = read_notice(path)
    assert first is not None and first.step == 10 and first.previous_at is None and first.next_due is None
    write_notice(path, step=50, tier="storage")
    second = read_notice(path)
    assert second is not None and (second.step, second.tier, second.previous_at) == (50, "storage", first.at)
    assert second.next_due == second.at + (second.at - first.at)
    assert [p.name for p in tmp_path.iterdir()] == ["notice.json"]  # no temporary file left


def test_the_pace_given_once_is_kept_and_says_when_the_next_commit_is_due(tmp_path):
    path = tmp_path / "notice.json"
    write_notice(path, step=50, tier="storage", step_s=1.5, interval_steps=10)
    paced = read_notice(path)
    assert paced is not None and paced.next_due == paced.at + 15  # one commit is enough with a pace
    write_notice(path, step=60, tier="memory")  # the memory tier's writer knows no interval: it is kept
    memory = read_notice(path)
    assert memory is not None and (memory.step_s, memory.interval_steps, memory.previous_at) == (1.5, 10, paced.at)
    write_notice(path, step=50, tier=RESTORE_TIER)  # a round went back to step 50: it restarts the clock
    restored = read_notice(path)
    assert restored is not None and not restored.is_commit and restored.previous_at is None
    assert restored.next_due == restored.at + 15


def test_a_checkpointer_tells_its_pace_at_each_commit_and_restore(tmp_path):
    notice, model = tmp_path / "notice.json", nn.Linear(4, 4)
    ckpt = Checkpointer(tmp_path / "ckpt", interval_steps=3, staging=False, events=EventLog(tmp_path / "ev"),
                        commit_notice=str(notice))
    for step in range(1, 7):
        time.sleep(0.02)
        ckpt.maybe_save(step, {"model": model})
    committed = read_notice(notice)
    assert committed is not None and (committed.step, committed.tier, committed.interval_steps) == (6, "storage", 3)
    assert committed.step_s is not None and 0.02 <= committed.step_s < 1.0, committed
    restarted = Checkpointer(tmp_path / "ckpt", interval_steps=3, staging=False, events=EventLog(tmp_path / "ev"),
                             commit_notice=str(notice))
    assert restarted.restore({"model": model}) == 6
    restored = read_notice(notice)
    assert restored is not None and (restored.step, restored.tier, restored.step_s) == (6, RESTORE_TIER,
                                                                                        committed.step_s)
    assert restored.at > committed.at


def test_the_pace_told_keeps_a_commits_time_and_moves_a_restores(tmp_path):
    path = tmp_path / "notice.json"
    assert tell_pace(path, 0.5, step=3) is None and not path.exists()  # no notice: no commit to count from
    write_notice(path, step=40, tier="storage")
    write_notice(path, step=50, tier="memory", interval_steps=10)
    before = read_notice(path)
    assert tell_pace(path, 0.5, step=53) is None
    paced = read_notice(path)
    assert paced == CommitNotice(step=50, tier="memory", at=before.at, previous_at=before.previous_at, step_s=0.5,
                                 interval_steps=10)
    assert paced.next_due == before.at + 5  # an interval of steps after the commit
    # A round restored step 50 and has done 3 steps since: the next commit is 7 steps away, however
    # long the round's first step took.
    write_notice(path, step=50, tier=RESTORE_TIER)
    told_at = time.time()
    tell_pace(path, 0.5, step=53)
    restored = read_notice(path)
    assert (restored.step, restored.tier, restored.step_s) == (50, RESTORE_TIER, 0.5)
    assert told_at + 3.5 <= restored.next_due <= time.time() + 3.5


def test_a_node_that_joined_tells_its_rounds_pace_before_any_commit(tmp_path):
    """A joined node's agent has no notice before its round's restore, and the first commit may be
    far off: the training thread tells the pace after a few steps, or that agent could not tell
    when the commit is due, and would admit the next joining node at once."""
    notice, model = tmp_path / "notice.json", nn.Linear(4, 4)
    ckpt = Checkpointer(tmp_path / "ckpt", interval_steps=100, staging=False, events=EventLog(tmp_path / "ev"),
                        commit_notice=str(notice))
    assert ckpt.restore({"model": model}) is None
    restored = read_notice(notice)
    assert restored is not None and (restored.step, restored.tier, restored.step_s) == (0, RESTORE_TIER, None)
    assert restored.next_due is None  # the pace is unknown
    for step in range(1, PACE_TOLD_AFTER + 1):  # PACE_TOLD_AFTER calls: one step time fewer
        time.sleep(0.02)
        ckpt.maybe_save(step, {"model": model})
        assert read_notice(notice).step_s is None
    time.sleep(0.02)
    told_at = time.time()
    ckpt.maybe_save(PACE_TOLD_AFTER + 1, {"model": model})
    paced = read_notice(notice)
    assert paced is not None and (paced.step, paced.tier) == (0, RESTORE_TIER)
    assert 0.02 <= paced.step_s < 1.0
    steps_left = 100 - (PACE_TOLD_AFTER + 1)
    assert told_at + steps_left * paced.step_s <= paced.next_due <= time.time() + steps_left * paced.step_s


def test_an_unreadable_notice_is_no_notice(tmp_path):
    path = tmp_path / "notice.json"
    for text in ("", "{", '{"step": "x"}', "[]"):
        path.write_text(text)
        assert read_notice(path) is None


def test_concurrent_writers_never_fail_and_leave_one_whole_notice(tmp_path):
    """A node's storage save and memory save may tell of their commits at the same moment."""
    path = tmp_path / "notice.json"
    errors: list[BaseException] = []

    def tell(tier: str) -> None:
        for step in range(300):
            try:
                assert write_notice(path, step=step, tier=tier) is None
            except BaseException as exc:  # noqa: BLE001  (any failure fails the test)
                errors.append(exc)

    writers = [threading.Thread(target=tell, args=(tier,)) for tier in ("storage", "memory")]
    for thread in writers:
        thread.start()
    for thread in writers:
        thread.join()
    assert errors == []
    final = json.loads(path.read_text())
    assert final["step"] == 299 and final["tier"] in ("storage", "memory")
    assert [p.name for p in tmp_path.iterdir()] == ["notice.json"]  # no temporary file left


def test_a_notice_that_cannot_be_written_leaves_the_save_committed(tmp_path):
    (tmp_path / "not-a-dir").write_text("")
    notice = tmp_path / "not-a-dir" / "notice.json"
    log = tmp_path / "events.jsonl"
    ckpt = Checkpointer(tmp_path / "ckpt", staging=False, events=EventLog(log), commit_notice=str(notice))
    with pytest.warns(UserWarning, match=rf"{notice}: cannot record the commit of step 1 \(storage\)"):
        ckpt.save(1, {"model": nn.Linear(4, 4)})
    assert ckpt.latest() == tmp_path / "ckpt" / "step_1"
    [failed] = [e for e in read_events(log) if e["event"] == "commit_notice_failed"]
    assert failed["step"] == 1 and str(notice) in failed["error"]
