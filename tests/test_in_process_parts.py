"""The parts of in-process recovery on their own: the regroup channel, cutting a round's
connections, and healing replicated state from the rank holding the newest step (real gloo ranks)."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import NamedTuple

import pytest
import torch
import torchsnapshot
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import agent
from agent import regroup
from agent.elastic_sampler import ElasticSampler
from agent.epoll_registrations import Registration, fire_once_more, registrations
from agent.errors import RestoreError
from agent.events import EventLog
from agent.heal import SPLIT_BYTES, heal
from agent.resilient import Round, RoundEnded, _leave_process_group, _LeaveWatcher
from agent.round_sockets import RoundConnections, open_sockets
from agent.worker import WorkerContext
from tests.distributed import run_ranks


def test_the_channel_carries_leave_left_and_handover_and_reads_malformed_files_as_absent(tmp_path):
    assert regroup.leave_requested(tmp_path) is None
    regroup.request_leave(tmp_path, 4)
    assert regroup.leave_requested(tmp_path) == regroup.LeaveRequest(round=4, finish_step_s=0.0)
    regroup.request_leave(tmp_path, 4, finish_step_s=2.5)
    assert regroup.leave_requested(tmp_path) == regroup.LeaveRequest(round=4, finish_step_s=2.5)
    regroup.post_left(tmp_path, 1, regroup.Left(round=4, reason="asked by the agent", step=17, pid=123))
    assert regroup.read_left(tmp_path, 1) == regroup.Left(round=4, reason="asked by the agent", step=17, pid=123)
    regroup.post_left(tmp_path, 1, regroup.Left(round=4, reason="", step=17, pid=123, healed=True))
    assert regroup.read_left(tmp_path, 1).healed
    (tmp_path / "left-1.json").write_text('{"round": 4, "reason": "", "step": 17, "pid": 123, "healed": "yes"}')
    assert regroup.read_left(tmp_path, 1).healed is False  # only a true heals from memory: else prefetch
    assert regroup.read_left(tmp_path, 0) is None
    regroup.hand_over(tmp_path, 1, 5, {"RANK": "2", "WORLD_SIZE": "3"})
    assert regroup.read_handover(tmp_path, 1, after=4) == (5, {"RANK": "2", "WORLD_SIZE": "3"})
    assert regroup.read_handover(tmp_path, 1, after=5) is None  # not a later round than the worker's
    regroup.post_taken(tmp_path, 1, 5)
    assert regroup.took_round(tmp_path, [0, 1], 5) == {1} and regroup.took_round(tmp_path, [1], 4) == set()
    for finish in ('"2"', "-1", "NaN", "Infinity", "true"):  # a request all the same, to leave at once
        (tmp_path / "leave.json").write_text(f'{{"round": 4, "finish_step_s": {finish}}}')
        assert regroup.leave_requested(tmp_path) == regroup.LeaveRequest(round=4, finish_step_s=0.0), finish
    for name, text in [("leave.json", '{"round": "4"}'), ("left-1.json", '{"round": 4, "step": "x", "pid": 1, '
                                                                      '"reason": ""}'),
                       ("handover-1.json", '{"round": 9, "env": {"RANK": 2}}'), ("left-1.json", "not json"),
                       ("taken-1.json", '{"round": "5"}')]:
        (tmp_path / name).write_text(text)
    assert regroup.leave_requested(tmp_path) is None
    assert regroup.read_left(tmp_path, 1) is None
    assert regroup.read_handover(tmp_path, 1, after=4) is None
    assert regroup.took_round(tmp_path, [1], 5) == set()


def test_cutting_a_rounds_connections_spares_listeners_and_older_connections():
    listener = socket.create_server(("127.0.0.1", 0))
    older = socket.create_connection(listener.getsockname())
    older_peer, _ = listener.accept()
    before = open_sockets()
    newer = socket.create_connection(listener.getsockname())
    newer_peer, _ = listener.accept()
    try:
        # The round's own: its client end and the accepted end both; the listener and the older pair stay.
        round_connections = RoundConnections(before)
        assert round_connections.shut(socket.SHUT_RDWR) == 2
        round_connections.release()
        newer_peer.settimeout(5)
        assert newer_peer.recv(1) == b""  # the peer sees the connection end at once
        older.sendall(b"x")
        assert older_peer.recv(1) == b"x"
        late = socket.create_connection(listener.getsockname())  # the listener still accepts
        late.close()
    finally:
        for s in (listener, older, older_peer, newer, newer_peer):
            s.close()


class RoundConnection(NamedTuple):
    """A connection of a round's, as the fixture below opens it."""

    connections: RoundConnections
    mine: socket.socket
    """This round's end of the connection (cut with the round)."""
    peer: socket.socket
    """Its peer's end (not the round's: another process's, say)."""


@pytest.fixture
def round_connection() -> Iterator[RoundConnection]:
    """A TCP connection opened during a round, both ends with a 5 s timeout, and the round's
    connections; closed and released after the test."""
    listener = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    connections = RoundConnections(open_sockets() - {os.readlink(f"/proc/self/fd/{mine.fileno()}")})
    mine.settimeout(5)
    peer.settimeout(5)
    try:
        yield RoundConnection(connections, mine, peer)
    finally:
        connections.release()
        for s in (listener, mine, peer):
            s.close()


def test_a_round_is_cut_for_reading_first_and_held_open_so_that_sends_under_way_still_go_out(round_connection):
    """What keeps gloo from losing a send (agent.round_sockets): cut for reading, a connection ends
    every read at once yet still takes what this process sends, and stays open after its owner
    closed it; cut for writing, its peer is told, in order."""
    connections, mine, peer = round_connection
    assert connections.shut(socket.SHUT_RD) == 1  # the peer's end is another process's, say
    assert mine.recv(1) == b""  # this process's reads end at once
    mine.sendall(b"x")  # while its sends still go out
    mine.close()  # its owner closes it (gloo, on that end of file)
    peer.sendall(b"y")  # the peer still sending is not reset
    assert peer.recv(1) == b"x"
    left = threading.Event()
    left.set()  # the round's threads left: no wait before the writing side goes too
    connections.cut(left)
    assert peer.recv(1) == b""  # told in order
    connections.release()


def _round_whose_steps_take(seconds: float | None, healed: bool = True) -> tuple[Round, threading.Event]:
    """Round 3 of a worker, its last step timed at ``seconds`` (None: no step done yet); ``healed``:
    its training function called ``heal`` (its state lives on in memory across rounds)."""
    leave = threading.Event()
    round = Round(replace(WorkerContext.from_env({}), round=3), 0, None, EventLog(None), leave)
    if healed:
        round.app_state = {}
    if seconds is not None:
        round.step_done(1)
        time.sleep(seconds)
        round.step_done(2)
    return round, leave


@contextmanager
def _asked_to_leave(tmp_path, connections: RoundConnections, step_s: float, finish_step_s: float) -> Iterator[Round]:
    """A round whose steps take ``step_s``, once its watcher has seen the agent's request to leave
    that allows ``finish_step_s`` for the step in flight; the watcher is stopped after."""
    round, leave = _round_whose_steps_take(step_s)
    watcher = _LeaveWatcher(str(tmp_path), round, leave, connections, "gloo")
    try:
        regroup.request_leave(tmp_path, 3, finish_step_s=finish_step_s)
        assert leave.wait(10)
        yield round
    finally:
        watcher.stop()


def test_a_leave_that_allows_the_step_to_finish_ends_the_round_at_its_end_without_a_cut(tmp_path, round_connection):
    """A join: nobody was lost, so the step in flight completes (its work is kept) and the round
    ends at step_done; the round's connections are not cut under it."""
    connections, _, peer = round_connection
    with _asked_to_leave(tmp_path, connections, step_s=1.0, finish_step_s=30.0) as round:
        peer.settimeout(0.3)
        with pytest.raises(TimeoutError):
            peer.recv(1)  # still connected while the step runs (it has about 1 s left)
        with pytest.raises(RoundEnded, match="at the end of step 3"):
            round.step_done(3)
    assert round.held_step == 3 and not round.cut
    with pytest.raises(TimeoutError):
        peer.recv(1)  # the watcher left the connections to run_resilient


@pytest.mark.parametrize("finish_step_s, uncut_for_s", [(0.0, 0.0), (1.0, 0.2)],
                         ids=["a loss: at once", "a step run past what was allowed"])
def test_a_leave_cuts_the_rounds_connections_when_the_step_may_not_or_did_not_finish(
        tmp_path, round_connection, finish_step_s, uncut_for_s):
    connections, _, peer = round_connection
    # Let finish, the step gets 0.2 s left and a 0.5 s margin; it never ends here.
    with _asked_to_leave(tmp_path, connections, step_s=0.2, finish_step_s=finish_step_s) as round:
        if uncut_for_s:
            peer.settimeout(uncut_for_s)
            with pytest.raises(TimeoutError):
                peer.recv(1)
            peer.settimeout(5)
        assert peer.recv(1) == b""  # cut: a training thread blocked in a collective errors out
        assert round.cut


def test_a_request_to_leave_at_once_ends_the_wait_for_a_step_to_finish(tmp_path, round_connection):
    """A node lost while the survivors finish their step for a join: they are cut at once."""
    connections, _, peer = round_connection
    with _asked_to_leave(tmp_path, connections, step_s=1.0, finish_step_s=30.0) as round:
        regroup.request_leave(tmp_path, 3)
        peer.settimeout(1.0)  # the step would have had about 1.5 s
        assert peer.recv(1) == b""
        assert round.cut


def test_the_step_in_flight_is_let_finish_only_when_it_is_expected_to_end_in_the_time_allowed():
    untimed, _ = _round_whose_steps_take(None)
    assert untimed.time_to_finish_step(30.0) == 0.0  # nothing to expect it from: at once
    round, _ = _round_whose_steps_take(1.0)
    # What it has left (about 1 s) and half a step, far from the 30 s allowed; a loaded machine
    # stretches the sleep that times the step (a clean-clone run measured above 1.6 s).
    assert 1.0 < round.time_to_finish_step(30.0) < 2.5
    assert round.time_to_finish_step(1.2) == 1.2
    assert round.time_to_finish_step(0.1) == 0.0  # it would run about 1 s more
    assert round.time_to_finish_step(0.0) == 0.0
    not_healed, _ = _round_whose_steps_take(0.1, healed=False)
    assert not_healed.time_to_finish_step(30.0) == 0.0  # its step would be thrown away: at once


def test_a_cut_connection_wakes_an_event_loop_that_leaves_it_unread_once_more_then_no_more():
    """gloo's event loop busy-waits on a connection whose bytes are for a buffer not registered yet:
    its handler reads nothing. A cut connection (readable, hung up) would wake such a loop at every
    tick for as long as the process group that owns it lives. Quieted, it wakes the loop once more,
    with the loop's own data, then never; the registration stays for its owner to remove."""
    listener = socket.create_server(("127.0.0.1", 0))
    mine = socket.create_connection(listener.getsockname())
    peer, _ = listener.accept()
    connections = RoundConnections(open_sockets() - {os.readlink(f"/proc/self/fd/{mine.fileno()}")})
    loop = select.epoll()
    try:
        loop.register(mine.fileno(), select.EPOLLIN)
        [watched] = [r for r in registrations() if r.epoll_fd == loop.fileno()]
        assert (watched.fd, watched.inode) == (mine.fileno(), os.fstat(mine.fileno()).st_ino)
        peer.sendall(b"bytes for a buffer this side never registers")
        assert connections.shut(socket.SHUT_RDWR) == 1
        assert all(loop.poll(0.05) for _ in range(5))  # a handler that reads nothing: woken at every tick
        assert connections.quiet() == 1
        [(fd, events)] = loop.poll(0.05)
        assert fd == mine.fileno() and events & select.EPOLLHUP  # once more, as the loop registered it
        assert loop.poll(0.05) == [] and loop.poll(0.05) == []  # then no more
        loop.unregister(mine.fileno())  # its owner removes it as usual
        connections.release()
    finally:
        for s in (loop, listener, mine, peer):
            s.close()


def test_a_registration_whose_descriptor_now_names_another_file_is_left_alone():
    loop = select.epoll()
    first, second = socket.socketpair()
    try:
        loop.register(first.fileno(), select.EPOLLIN)
        [watched] = [r for r in registrations() if r.epoll_fd == loop.fileno()]
        other_file = Registration(watched.epoll_fd, watched.fd, watched.events, watched.data,
                                  os.fstat(second.fileno()).st_ino)
        assert not fire_once_more(other_file)
        second.sendall(b"x")
        assert loop.poll(0.05) and loop.poll(0.05)  # still armed as its owner left it
    finally:
        for s in (loop, first, second):
            s.close()


def _a_round_after_a_failed_init(rank: int, world_size: int) -> None:
    # The next round's store, hosted by rank 0 (its port told over the current group).
    next_store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [next_store.port if next_store else None]
    dist.broadcast_object_list(port, src=0)
    _leave_process_group("gloo")  # the round ends on both ranks
    if rank == 1:  # a round whose group never formed here (its peers left meanwhile)
        alone = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1))
        with pytest.raises(dist.DistError):
            dist.init_process_group("gloo", store=alone, rank=0, world_size=2, timeout=timedelta(seconds=1))
        _leave_process_group("gloo")
    store = next_store or TCPStore("127.0.0.1", port[0], world_size, is_master=False)
    # Both name the group alike (else gloo waits for the other's keys: the job hung until the timeout).
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=30))
    assert dist.group.WORLD.group_name == "0"
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == world_size


def test_a_worker_whose_group_failed_to_form_enters_the_next_round_with_its_peers():
    run_ranks(2, _a_round_after_a_failed_init, timeout_s=120)


def test_a_rank_that_changed_since_the_last_round_shards_and_saves_as_its_new_rank(tmp_path):
    run_ranks(2, _a_round_with_ranks_swapped, str(tmp_path), timeout_s=120)
    restored = nn.Linear(6, 4, bias=False)
    agent.restore(tmp_path / "snapshot", {"layer": restored})
    assert torch.equal(restored.weight.detach(), _ROWS)


_ROWS = torch.arange(24.0).reshape(4, 6)


def _a_round_with_ranks_swapped(rank: int, world_size: int, out: str) -> None:
    """Two rounds of the same world size whose processes swap ranks (a node lost, another joined):
    DTensor's caches, keyed by mesh equality, must not give the second round's parameters the
    first round's mesh, or each process saves its new shard at its old rank's offsets."""
    next_store = TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [next_store.port if next_store else None]
    dist.broadcast_object_list(port, src=0)
    for round, my_rank in enumerate((rank, world_size - 1 - rank)):
        if round:
            store = next_store or TCPStore("127.0.0.1", port[0], world_size, is_master=False)
            dist.init_process_group("gloo", store=store, rank=my_rank, world_size=world_size)
        mesh = init_device_mesh("cpu", (world_size,))
        layer = nn.Linear(6, 4, bias=False)
        fully_shard(layer, mesh=mesh)
        with torch.no_grad():
            layer.weight.to_local().copy_(_ROWS.chunk(world_size)[my_rank])
        assert layer.weight.device_mesh.get_coordinate() == (my_rank,)
        if round:
            torchsnapshot.Snapshot.take(os.path.join(out, "snapshot"), {"layer": layer})
        else:
            _leave_process_group("gloo")


def _replicated_state(held: int | None, seed: int) -> tuple[nn.Module, torch.optim.Optimizer, ElasticSampler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    sampler = ElasticSampler(96, global_batch_size=12, micro_batch_size=4, rank=0, world_size=1, seed=0)
    for _ in range(held or 0):  # a rank that holds a step has trained to it: optimizer state and position
        optimizer.zero_grad()
        model(torch.randn(3, 8)).sum().backward()
        optimizer.step()
        sampler.advance()
    return model, optimizer, sampler


def _heal_ranks(rank: int, world_size: int, out: str) -> None:
    held = {0: 2, 1: 3, 2: None}[rank]  # rank 1 holds the newest step; rank 2 is a new process
    model, optimizer, sampler = _replicated_state(held, seed=rank)
    app_state = {"model": model, "optim": optimizer, "data": sampler}
    healed = heal(app_state, held)
    assert healed is not None and (healed.step, healed.sources) == (3, () if rank == 1 else (1,))
    assert (healed.bytes > 0) == (rank != 1)  # the holder receives nothing
    again = heal(app_state, 3)  # everyone holds step 3 now: nothing moves
    assert again is not None and (again.sources, again.bytes) == ((), 0)
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "data": sampler.state_dict()},
               os.path.join(out, f"rank{rank}.pt"))


def test_heal_gives_every_rank_the_newest_state_a_rank_holds(tmp_path):
    run_ranks(3, _heal_ranks, str(tmp_path))
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(3)]
    model, optimizer, sampler = _replicated_state(3, seed=1)  # rank 1's state, made again
    for state in states:
        assert state["data"] == sampler.state_dict()
        for key, value in model.state_dict().items():
            assert torch.equal(state["model"][key], value), key
        theirs, ours = state["optim"], optimizer.state_dict()
        assert theirs["param_groups"] == ours["param_groups"]
        for index, entry in ours["state"].items():
            for name, value in entry.items():
                assert torch.equal(theirs["state"][index][name], value), (index, name)


def _large_replicated_state(held: int | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model whose weight and moments (2 MB each) come in parts, from every holder."""
    torch.manual_seed(7)
    model = nn.Linear(512, 1024)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(held or 0):
        optimizer.zero_grad()
        model(torch.randn(3, 512)).sum().backward()
        optimizer.step()
    return model, optimizer


def _heal_from_every_holder(rank: int, world_size: int, out: str) -> None:
    held = {0: 3, 1: 3, 2: 3, 3: None}[rank]  # three holders of step 3 (the same state); a new process
    model, optimizer = _large_replicated_state(held)
    if held is None:
        with torch.no_grad():
            model.weight.zero_()  # nothing of it may be left: every part must arrive
    healed = heal({"model": model, "optim": optimizer}, held)
    assert healed is not None and healed.sources == ((0, 1, 2) if rank == 3 else ())
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, os.path.join(out, f"rank{rank}.pt"))


def test_a_new_rank_receives_a_part_of_each_large_tensor_from_every_holder(tmp_path):
    assert _large_replicated_state(None)[0].weight.nbytes >= 2 * SPLIT_BYTES
    run_ranks(4, _heal_from_every_holder, str(tmp_path))
    model, optimizer = _large_replicated_state(3)
    healed = torch.load(tmp_path / "rank3.pt")
    for key, value in model.state_dict().items():
        assert torch.equal(healed["model"][key], value), key
    for index, entry in optimizer.state_dict()["state"].items():
        for name, value in entry.items():
            assert torch.equal(healed["optim"]["state"][index][name], value), (index, name)


def _refuse_sharded(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(nn.Linear(8, 8), mesh=init_device_mesh("cpu", (world_size,)))
    with pytest.raises(RestoreError, match="sharded tensors"):
        heal({"model": model}, 1)


def test_heal_refuses_sharded_state_before_any_collective():
    run_ranks(2, _refuse_sharded)


def _malformed_layout(rank: int, world_size: int) -> None:
    model = nn.Linear(2, 2)
    if rank == 0:  # a hostile or broken source: sends a layout that names a non-dtype
        dist.all_gather([torch.empty(1, dtype=torch.int64) for _ in range(world_size)],
                        torch.tensor([5], dtype=torch.int64))
        layout = b'{"__dict__": [["model", {"__dict__": [["weight", {"__tensor__": ["Tensor", [2, 2]]}]]}]]}'
        dist.send(torch.tensor([len(layout)], dtype=torch.int64), dst=1)
        dist.send(torch.frombuffer(bytearray(layout), dtype=torch.uint8), dst=1)
    else:
        with pytest.raises(RestoreError, match="rank 0 sent to heal this rank is malformed"):
            heal({"model": model}, None)


def test_a_malformed_state_from_a_peer_is_refused_with_its_rank():
    run_ranks(2, _malformed_layout)


def _layouts_that_differ(rank: int, world_size: int) -> None:
    if rank < 2:  # two holders of step 5 whose states differ in shape: one is broken or hostile
        dist.all_gather([torch.empty(1, dtype=torch.int64) for _ in range(world_size)],
                        torch.tensor([5], dtype=torch.int64))
        layout = f'{{"__dict__": [["model", {{"__dict__": [["weight", {{"__tensor__": ["float32", [2, {rank + 2}]]}}]]}}]]}}'
        dist.send(torch.tensor([len(layout)], dtype=torch.int64), dst=2)
        dist.send(torch.frombuffer(bytearray(layout.encode()), dtype=torch.uint8), dst=2)
    else:
        with pytest.raises(RestoreError, match=r"ranks 0 and 1 hold the same step but their states hold different tensors"):
            heal({"model": nn.Linear(2, 2, bias=False)}, None)


def test_holders_whose_layouts_differ_are_refused_before_any_tensor_moves():
    run_ranks(3, _layouts_that_differ)
