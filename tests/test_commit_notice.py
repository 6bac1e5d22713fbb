"""The commit notice a node's local rank 0 leaves its agent: each commit replaces it, keeping the
time of the one before, so that the agent can tell when the next is due."""

from __future__ import annotations

from agent.commit_notice import read_notice, write_notice


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
