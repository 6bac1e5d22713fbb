"""PromptOpExecutor and MembershipWatch on torch's real dynamic rendezvous (c10d store, several
handlers in threads): the first survivor to rendezvous moves the round on for every live node in
one write, and the others find themselves in it without writing anything (also a live node that
rejoins late); a re-rendezvous completes without waiting out a long last call; a job's first round
still waits out the last call; the watch tells a peer that moved the round on from a lost one, and
a round moved on without a node from this node's eviction; a node declared dead (its agent's
connection closed) is lost at once and dropped from the round for every node."""

from __future__ import annotations

import pickle
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    create_handler,
)

from agent.membership import MembershipWatch
from agent.rendezvous.node_ledger import NodeLedger
from agent.rendezvous.prompt import PromptOpExecutor

LONG_LAST_CALL_S = 60
JOIN_TIMEOUT_S = 20
"""A node left out of a round fails with RendezvousTimeoutError after this long (and torch alone
would still be waiting for its 60 s last call)."""


@pytest.fixture
def make_node(store):
    handlers: list[DynamicRendezvousHandler] = []

    def make(max_nodes: int = 3, last_call_s: float = LONG_LAST_CALL_S, keep_alive_max_attempt: int = 2,
             name: str | None = None) -> tuple[DynamicRendezvousHandler, PromptOpExecutor]:
        """A node; ``name``: its address (rank 0's store listens there), which its name starts with."""
        params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{store.port}", run_id="prompt", min_nodes=1,
                                      max_nodes=max_nodes, join_timeout=JOIN_TIMEOUT_S, last_call_timeout=last_call_s,
                                      keep_alive_interval=1, keep_alive_max_attempt=keep_alive_max_attempt,
                                      local_addr=name)
        # A store client per node, as each agent has: one client's blocking read holds its socket.
        client = TCPStore("127.0.0.1", store.port, is_master=False)
        handler = create_handler(client, C10dRendezvousBackend(client, "prompt"), params)
        handlers.append(handler)
        return handler, PromptOpExecutor.install(handler, poll_interval=0.05)

    yield make
    for handler in handlers:
        handler._stop_heartbeats()


def until(condition, failure: str) -> None:
    """Wait until ``condition()`` holds; fail with ``failure`` after the join timeout."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.02)


def stored_state(store: TCPStore):
    stored = C10dRendezvousBackend(store, "prompt").get_state()
    return None if stored is None else pickle.loads(stored[0])


def waiting(store: TCPStore, handler: DynamicRendezvousHandler) -> bool:
    """Whether the stored rendezvous state has ``handler``'s node waiting: in the wait list, or a
    participant of a round still forming."""
    state = stored_state(store)
    if state is None:
        return False
    node = handler._this_node
    return node in state.wait_list or (node in state.participants and not state.complete)


STATE_WRITES = ("_add_to_participants", "_add_to_wait_list", "_add_to_redundancy_list", "_remove_from_participants",
                "_remove_from_wait_list", "_remove_from_redundancy_list", "_mark_rendezvous_complete", "_move_round_on")
"""The executor's changes of the round (a keep-alive aside)."""


def count_round_writes(executor: PromptOpExecutor) -> list[str]:
    """The names of the round changes ``executor`` makes from now on, in order."""
    made: list[str] = []
    for name in STATE_WRITES:
        original = getattr(executor, name)

        def counted(original=original, name=name) -> None:
            made.append(name)
            original()

        setattr(executor, name, counted)
    return made


def dropped(store: TCPStore, handler: DynamicRendezvousHandler, by: DynamicRendezvousHandler) -> None:
    """Wait until ``handler``'s node, whose heartbeats stopped, is gone from the stored state
    (``by`` syncs, which runs torch's clean-up, and writes it back), as a survivor's agent sees
    a loss before it rendezvouses."""
    node, deadline = handler._this_node, time.monotonic() + JOIN_TIMEOUT_S
    while node in stored_state(store).last_heartbeats:
        assert time.monotonic() < deadline, "the dead node was never dropped"
        by._state_holder.sync()
        by._state_holder.mark_dirty()
        by._state_holder.sync()
        time.sleep(0.1)


def rendezvous(handlers, *, store: TCPStore | None = None, late=None, late_by: float = 0.0) -> list[int]:
    """Every handler's next_rendezvous at once; their world sizes. The ``late`` handler starts
    ``late_by`` seconds after every other one is seen waiting in the stored state (observed, not
    guessed from how long joining usually takes)."""

    def join(handler):
        if handler is late:
            until(lambda: all(waiting(store, h) for h in handlers if h is not late),
                  "the other nodes never started to wait")
            time.sleep(late_by)
        return handler.next_rendezvous().world_size

    with ThreadPoolExecutor(len(handlers)) as pool:
        return list(pool.map(join, handlers))


def test_survivors_re_form_without_waiting_out_the_last_call(store, make_node):
    nodes = [make_node() for _ in range(3)]
    handlers = [h for h, _ in nodes]
    assert rendezvous(handlers) == [3, 3, 3]  # max_nodes joined: torch completes the round at once
    for _, executor in nodes:
        executor.rejoining = True  # as the agent sets it after its first round
    handlers[2]._stop_heartbeats()  # the third node dies: its heartbeats lapse after 2 s
    dropped(store, handlers[2], by=handlers[0])
    assert rendezvous(handlers[:2]) == [2, 2]  # before the join timeout, torch alone waits 60 s here


def formed(nodes) -> list[DynamicRendezvousHandler]:
    """The nodes' handlers, after a first round of all of them (from then on they rejoin)."""
    handlers = [h for h, _ in nodes]
    assert rendezvous(handlers) == [len(nodes)] * len(nodes)
    for _, executor in nodes:
        executor.rejoining = True
    return handlers


def test_the_first_survivor_moves_the_round_on_for_every_live_node_in_one_write(store, make_node):
    nodes = [make_node(max_nodes=4) for _ in range(4)]
    handlers = formed(nodes)
    writes = [count_round_writes(executor) for _, executor in nodes[:3]]
    before = stored_state(store).round
    handlers[3]._stop_heartbeats()  # the fourth node dies
    dropped(store, handlers[3], by=handlers[0])
    # The first survivor's one write makes the next round, with both other survivors in it; the
    # third rejoins 1.5 s after the two others wait, alive all the while (heartbeating), and is in
    # it too. Each says it is alive with a key of its own, and the first participant completes the
    # round: two writes of the round in all. torch alone would wait out its 60 s last call, after
    # every survivor left the round, waited, and joined the next, a write each.
    assert rendezvous(handlers[:3], store=store, late=handlers[2], late_by=1.5) == [3, 3, 3]
    # Nobody left the round or joined the next by itself. (A compare-and-set lost to a peer's
    # keep-alive, which c10d writes into the state, is tried again.)
    made = [name for node_writes in writes for name in node_writes]
    assert set(made) == {"_move_round_on", "_mark_rendezvous_complete"}, made
    assert sum(len(node_writes) > 0 for node_writes in writes) <= 2  # the one who moved it on, the one who completed it
    state = stored_state(store)
    assert state.round == before + 1 and state.complete
    assert sorted(state.participants.values()) == [0, 1, 2]


def test_a_node_carried_over_dead_holds_the_round_until_it_is_dropped(store, make_node):
    # A node moves the round on before it knows that a peer died (its own workers failed first):
    # the dead peer never says it is alive, so the round completes only once it is dropped,
    # without it, instead of completing with a participant that never comes.
    nodes = [make_node(keep_alive_max_attempt=3) for _ in range(3)]
    handlers = formed(nodes)
    handlers[2]._stop_heartbeats()  # dies; nobody has seen it yet
    started = time.monotonic()
    assert rendezvous(handlers[:2]) == [2, 2]
    assert time.monotonic() - started > 1.0  # its heartbeats had to lapse first (up to 3 s)
    assert handlers[2]._this_node not in stored_state(store).participants


def test_torchs_last_call_leaves_out_a_node_carried_over_dead(store, make_node):
    # Heartbeats lapse after 60 s here; the last call is 1 s: the round completes at the last call
    # with the two nodes that said they are alive, not with the silent one (the agents of a round
    # completed with it would wait 60 s for it in torch's rank assignment).
    nodes = [make_node(last_call_s=1, keep_alive_max_attempt=60) for _ in range(3)]
    handlers = formed(nodes)
    handlers[2]._stop_heartbeats()
    started = time.monotonic()
    assert rendezvous(handlers[:2]) == [2, 2]
    assert time.monotonic() - started < 20
    state = stored_state(store)
    assert handlers[2]._this_node not in state.participants and state.complete


def test_a_node_declared_dead_is_lost_at_once_and_dropped_from_the_round(store, make_node):
    # Heartbeats lapse after 60 s here: nothing below may wait for that.
    nodes = [make_node(keep_alive_max_attempt=60) for _ in range(3)]
    handlers = formed(nodes)
    watch = MembershipWatch(handlers[0], ledger=nodes[0][1].ledger, poll_interval=0.05)
    watch.start_round()
    dead = str(handlers[2]._this_node)
    handlers[2]._stop_heartbeats()
    closed_at = time.time()
    watch.declare_dead(dead, at=closed_at)  # as agent.liveness does when its connection closes
    change = watch.check(workers_healthy=True)
    assert change is not None and change.cause == "node_lost" and change.by_connection
    assert change.lost == {dead} and change.failed_at == closed_at and change.workers_blocked
    assert watch.check(workers_healthy=True) is None  # told once
    deadline = time.monotonic() + 10
    while dead in {str(n) for n in stored_state(store).participants}:  # the watch wrote it out
        assert time.monotonic() < deadline, "the declared node stayed in the stored round"
        time.sleep(0.05)
    watch.pause()
    started = time.monotonic()
    assert rendezvous(handlers[:2]) == [2, 2]
    assert time.monotonic() - started < 20  # far from the 60 s heartbeat timeout
    watch.close()


def test_a_participant_a_peer_dropped_as_dead_is_lost_here_too(store, make_node):
    # Node 1's connection to node 2 closed first: it drops node 2 from the stored round. Node 0 still
    # holds a current heartbeat of node 2 (its own connection has not told it yet), and node 2 waits
    # to rejoin nowhere: lost, not a node that left by itself to rejoin.
    nodes = [make_node(keep_alive_max_attempt=60) for _ in range(3)]
    handlers = formed(nodes)
    watches = [MembershipWatch(handlers[i], ledger=nodes[i][1].ledger, poll_interval=0.05) for i in (0, 1)]
    for watch in watches:
        watch.start_round()
    dead = str(handlers[2]._this_node)
    handlers[2]._stop_heartbeats()
    watches[1].declare_dead(dead, at=time.time())  # node 1's watch drops it from the round and writes that back
    try:
        until(lambda: dead not in {str(n) for n in stored_state(store).participants},
              "node 1 never dropped the node declared dead from the stored round")
        changes = []
        until(lambda: changes.append(watches[0].check(workers_healthy=True, now=True)) or changes[-1] is not None,
              "node 0's watch never saw the change")
        change = changes[-1]
        assert not nodes[0][1].ledger.is_dead(dead)  # node 0's ledger alone would not call it dead
        assert change is not None and (change.cause, change.lost, change.left) == ("node_lost", {dead}, frozenset())
        assert not change.by_connection
    finally:
        for watch in watches:
            watch.close()


def test_a_heartbeat_newer_than_a_declaration_undoes_it():
    # A connection can end while its agent lives (a reset on the way): its next heartbeat says so.
    ledger = NodeLedger(heartbeat_timeout=3.0)
    ledger.saw({"a": 99.0})
    ledger.declare_dead("a", at=100.0)
    ledger.saw({"a": 99.0})  # the heartbeat it had before: still dead
    assert ledger.declared_dead("a") and ledger.is_dead("a")
    ledger.saw({"a": 101.0})
    assert not ledger.declared_dead("a")


def test_the_first_round_still_waits_out_the_last_call(store, make_node):
    first, second = make_node(max_nodes=4, last_call_s=3)[0], make_node(max_nodes=4, last_call_s=3)[0]
    # The second node starts once the first waits alone in the first round: both are in it.
    assert rendezvous([first, second], store=store, late=second) == [2, 2]



def first_change(watch: MembershipWatch, timeout: float = 10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        change = watch.check(workers_healthy=True, now=True)
        if change is not None:
            return change
        time.sleep(0.05)
    raise AssertionError(f"no membership change within {timeout} s")


def test_the_watch_tells_a_peer_moving_the_round_on_from_a_lost_one(make_node):
    nodes = [make_node() for _ in range(3)]
    first, second, third = formed(nodes)
    watch = MembershipWatch(first, ledger=nodes[0][1].ledger, poll_interval=0.05)
    watch.start_round()
    # The second node's agent restarts (a worker of its own failed): it moves the round on with
    # all three, and the first node's watch sees that nobody was lost.
    with ThreadPoolExecutor(2) as pool:
        moved = pool.submit(second.next_rendezvous)
        change = first_change(watch)
        assert change.cause == "round_advanced" and change.lost == frozenset() and change.joined == frozenset()
        assert not change.loses_nobody  # a worker failed: the step in flight is cut
        watch.pause()  # the first node's agent rejoins (pausing the watch first): it is already in
        others = pool.submit(third.next_rendezvous)
        assert first.next_rendezvous().world_size == 3 and moved.result().world_size == 3
        assert others.result().world_size == 3
    watch.start_round()
    third._stop_heartbeats()  # the third node dies
    change = first_change(watch)
    assert change.cause == "node_lost" and change.lost == {str(third._this_node)}
    watch.pause()
    assert rendezvous([first, second]) == [2, 2]
    watch.start_round()
    second._stop_heartbeats()
    change = first_change(watch)
    assert change.cause == "node_lost" and change.lost == {str(second._this_node)}
    watch.close()


def moved_on(store: TCPStore, before: int) -> None:
    """Wait until a node moved the stored round on past ``before``."""
    until(lambda: stored_state(store).round != before, "no node moved the round on")


def test_a_round_moved_on_without_a_node_is_a_loss_to_those_carried_over(store, make_node):
    nodes = [make_node() for _ in range(3)]
    first, second, third = formed(nodes)
    # The second node's watch reads only when asked: it does not see the third die by itself.
    watch = MembershipWatch(second, ledger=nodes[1][1].ledger, poll_interval=60)
    watch.start_round()
    third._stop_heartbeats()
    dropped(store, third, by=first)
    before = stored_state(store).round
    with ThreadPoolExecutor(1) as pool:
        moved = pool.submit(first.next_rendezvous)
        moved_on(store, before)
        # Its first read finds the round moved on without the third: a loss, not its own eviction.
        change = watch.check(workers_healthy=True, now=True)
        assert change is not None and change.cause == "node_lost" and change.lost == {str(third._this_node)}
        watch.pause()
        assert second.next_rendezvous().world_size == 2 and moved.result().world_size == 2
    watch.close()


def in_wait_list(store: TCPStore, handlers) -> None:
    """Wait until every one of ``handlers``' nodes waits in the stored wait list."""
    until(lambda: {h._this_node for h in handlers} <= stored_state(store).wait_list,
          "the new nodes never reached the wait list")


def test_a_new_node_named_first_completes_the_round_it_was_carried_into(store, make_node):
    # The round's first participant completes it once all said they are alive. A node new to the
    # job (it never completed a round) that is first by name does so too: with a 60 s last call,
    # anything else fails on the 20 s join timeout.
    nodes = [make_node(name="localhost") for _ in range(3)]
    handlers = formed(nodes)
    handlers[2]._stop_heartbeats()
    dropped(store, handlers[2], by=handlers[0])
    assert rendezvous(handlers[:2]) == [2, 2]
    newcomer = make_node(name="127.0.0.1")[0]  # named first: "127.0.0.1_<pid>_<n>" < "localhost_..."
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(newcomer.next_rendezvous)
        in_wait_list(store, [newcomer])
        started = time.monotonic()
        assert rendezvous(handlers[:2]) == [3, 3]  # the survivors' agents restart for the join
        assert joined.result().world_size == 3
    assert time.monotonic() - started < JOIN_TIMEOUT_S


def test_nodes_beyond_max_nodes_wait_as_spares_and_fill_the_next_gap(store, make_node, monkeypatch):
    # Two nodes join a round of two with room for one: the one carried in makes it full, the other
    # waits as a spare (torch's redundancy list) instead of making the round one too many, which
    # then never completes; when a participant dies the spare is carried into the next round.
    # (Rank 0 publishes its address every round, as the agent makes it: torch's shared store does
    # so only in a node's first round as rank 0, and a new node not rank 0 would wait 60 s for it.)
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    nodes = [make_node(last_call_s=1) for _ in range(2)]
    handlers = formed(nodes)
    newcomers = [make_node(last_call_s=1)[0] for _ in range(2)]
    with ThreadPoolExecutor(2) as pool:
        joined = [pool.submit(h.next_rendezvous) for h in newcomers]
        in_wait_list(store, newcomers)
        assert rendezvous(handlers) == [3, 3]
        done, _ = wait(joined, timeout=JOIN_TIMEOUT_S, return_when=FIRST_COMPLETED)
        assert len(done) == 1, "the new node carried in never finished its rendezvous"
        (carried, carried_join), (spare, waits) = sorted(zip(newcomers, joined), key=lambda pair: pair[1] not in done)
        assert carried_join.result().world_size == 3 and not waits.done()
        state = stored_state(store)
        assert state.complete and len(state.participants) == 3 and state.redundancy_list == {spare._this_node}
        handlers[1]._stop_heartbeats()  # a participant dies: the spare fills its place
        dropped(store, handlers[1], by=handlers[0])
        assert rendezvous([handlers[0], carried]) == [3, 3]
        assert waits.result(timeout=JOIN_TIMEOUT_S).world_size == 3


def test_the_watch_reports_a_round_moved_on_before_it_started(store, make_node):
    # A peer moves the round on (carrying this node along) between this node's rendezvous and its
    # watch's start: the watch keeps the round this node's workers run in, and reports the next.
    nodes = [make_node() for _ in range(3)]
    first, second, third = formed(nodes)
    watch = MembershipWatch(first, ledger=nodes[0][1].ledger, poll_interval=0.05)
    before = stored_state(store).round
    with ThreadPoolExecutor(1) as pool:
        moved = pool.submit(second.next_rendezvous)
        moved_on(store, before)
        assert watch.start_round(nodes[0][1].completed_round).round == before
        change = first_change(watch)
        assert change.cause == "round_advanced" and change.lost == frozenset()
        watch.pause()
        assert rendezvous([first, third]) == [3, 3] and moved.result().world_size == 3
    watch.close()


def test_a_stalled_node_drops_its_silent_peers_but_never_itself(store, make_node):
    """A stall of the whole machine (a paused VM) lapses every heartbeat, this node's own included:
    its next sync drops its peers, which its agent cannot tell from dead, but keeps itself."""
    nodes = [make_node(max_nodes=2) for _ in range(2)]
    handlers = [h for h, _ in nodes]
    assert rendezvous(handlers) == [2, 2]
    for handler in handlers:
        handler._stop_heartbeats()
    time.sleep(2.5)  # past keep_alive_interval 1 s x keep_alive_max_attempt 2
    stalled, peer = handlers
    stalled._state_holder.mark_dirty()
    stalled._state_holder.sync()
    participants = stalled._state_holder.state.participants
    assert stalled._this_node in participants and peer._this_node not in participants
    assert stalled._this_node in stored_state(store).participants  # written back so
