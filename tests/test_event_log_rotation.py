"""The event log rotates at a size, once per rotation however many processes append to it, and
reads back whole, its rotated files included."""

from __future__ import annotations

import multiprocessing
import os

from agent import events
from agent.events import EventLog, read_events, rotated

WRITERS, EVENTS_EACH, LIMIT = 8, 300, 1024


def append(path: str, writer: int, limits: tuple[int, int] | None = None) -> None:
    """Append EVENTS_EACH events as ``writer``; ``limits``: the rotation size and files kept to set
    first (in a process of its own)."""
    if limits is not None:
        events.ROTATE_AT_BYTES, events.ROTATED_KEPT = limits
    log = EventLog(path, writer=writer)
    for seq in range(EVENTS_EACH):
        log.record("tick", seq=seq)


def test_several_processes_rotate_the_log_once_per_limit_and_lose_nothing(tmp_path):
    log = tmp_path / "events.jsonl"
    # Spawned, not forked: a fork of this process, whose earlier tests left gRPC threads, can abort.
    spawn = multiprocessing.get_context("spawn")
    writers = [spawn.Process(target=append, args=(str(log), writer, (LIMIT, 10_000)))  # keep all: all read back
               for writer in range(WRITERS)]
    for process in writers:
        process.start()
    for process in writers:
        process.join(120)
        assert process.exitcode == 0
    files = sorted(tmp_path.glob("events.jsonl.*[0-9]"))
    assert len(files) > 10
    # A file is rotated only once it outgrew the limit: never a fresh one a second writer rotated again.
    assert [f.name for f in files if f.stat().st_size < LIMIT] == []
    read = read_events(log)
    assert len(read) == WRITERS * EVENTS_EACH
    for writer in range(WRITERS):  # each writer's events whole, in its order, across the files
        assert [e["seq"] for e in read if e["writer"] == writer] == list(range(EVENTS_EACH))


def test_only_the_newest_rotated_files_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(events, "ROTATE_AT_BYTES", 1024)
    monkeypatch.setattr(events, "ROTATED_KEPT", 2)
    log = tmp_path / "events.jsonl"
    append(str(log), 0)
    assert rotated(log, 2).exists() and not rotated(log, 3).exists()
    seqs = [e["seq"] for e in read_events(log)]
    assert seqs == list(range(seqs[0], EVENTS_EACH)) and seqs[0] > 0  # the newest, in order


def test_a_writer_late_to_rotate_leaves_the_new_log_alone(tmp_path, monkeypatch):
    # A writer found the log full, and another rotated it first: the late one must not rotate
    # the new log (nearly empty) as well.
    monkeypatch.setattr(events, "ROTATE_AT_BYTES", 200)
    log = tmp_path / "events.jsonl"
    EventLog(log).record("first", pad="x" * 100)
    late = os.open(log, os.O_WRONLY | os.O_APPEND)  # the late writer's descriptor on the full log
    try:
        EventLog(log).record("second", pad="x" * 100)  # over the limit: rotated
        EventLog(log).record("third")
        events._rotate(log, late)
    finally:
        os.close(late)
    assert [e["event"] for e in read_events(rotated(log, 1))] == ["first", "second"]
    assert [e["event"] for e in read_events(log)] == ["first", "second", "third"]
    assert not rotated(log, 2).exists()
