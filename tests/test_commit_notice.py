"""The commit notice a node's local rank 0 leaves its agent: each commit replaces it, keeping the
time of the one before, so that the agent can tell when the next is due."""

from __future__ import annotations

import json
import threading

import pytest
from torch import nn

from agent.checkpoint import Checkpointer
from agent.commit_notice import read_notice, write_notice
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
