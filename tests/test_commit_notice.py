"""The commit notice a node's local rank 0 leaves its agent: each commit replaces it, keeping the
time of the one before, so that the agent can tell when the next is due."""

from __future__ import annotations

import json
import threading
import time

import pytest
from torch import nn

from agent.checkpoint import Checkpointer
from agent.commit_notice import RESTORE_TIER, read_notice, write_notice
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
