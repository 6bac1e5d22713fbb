"""The memory tier on real agents (scripts/local_cluster.py --memory-interval: each node a tmpfs
of its own, in a mount namespace of its own): a lost node's job resumes from the peers' RAM and
trains on exactly as without the fault; two buddies lost together, a damaged memory file and a
full tmpfs each leave the storage tier in charge."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from conftest import REPO, free_port

from agent.checkpoint.dirs import COMMIT_MARKER
from agent.events import read_events
from agent.memory.layout import KEY_FILE, MemorySnapshot
from agent.memory.peer_files import PeerFileClient, read_key
from agent.memory.tier import MemoryChoice, MemoryTier, newest_complete
from agent.recovery_timeline import events_after, recovery_after

sys.path.insert(0, str(REPO / "scripts"))
from harness import chaos
from harness.nodes import Cluster

STEPS = 150


def memory_args(**overrides) -> argparse.Namespace:
    args = {"nodes": 3, "nproc_per_node": 1, "scenario": "kill", "fault_node": 2, "backend": "c10d",
            "rdzv_endpoint": f"127.0.0.1:{free_port()}", "state_mb": 4, "interval_steps": 50, "memory_interval": 1,
            "timeout": 120}
    args.update(overrides)
    return argparse.Namespace(**args)


def test_the_leader_picks_the_newest_snapshot_whose_every_file_survives():
    complete = {"0/a": 10, "1/a": 10, ".torchrevive_checksums.json": 3, ".torchrevive_commit": 2}
    held = {
        0: {"r2/step_7": {"files": {"0/a": 10, ".torchrevive_checksums.json": 3, ".torchrevive_commit": 2},
                          "complete": complete},
            "r1/step_9": {"files": complete, "complete": complete}},
        1: {"r2/step_7": {"files": {"0/a": 10}}, "r2/step_8": {"files": {"0/a": 10, "1/a": 10}}},
    }
    # r2/step_7 lacks 1/a on every live node; r1/step_9 is whole on node 0 (an older round's, still whole).
    assert newest_complete(held) == newest_complete({0: held[0]})
    assert newest_complete(held).snapshot == MemorySnapshot(1, 9)
    held[1]["r2/step_7"]["files"]["1/a"] = 10
    choice = newest_complete(held)
    assert choice.snapshot == MemorySnapshot(2, 7) and choice.holders["1/a"] == 1 and choice.holders["0/a"] == 0
    held[1]["r2/step_7"]["files"]["1/a"] = 9  # a truncated copy is no copy
    assert newest_complete(held).snapshot == MemorySnapshot(1, 9)
    assert newest_complete({0: {}, 1: {"r3/step_1": {"files": complete}}}) is None  # no marker: not committed
    # An inventory naming a file outside its snapshot is data from a peer: never followed.
    crafted = {**complete, "../../etc/cron.d/x": 1}
    assert newest_complete({0: {"r5/step_1": {"files": crafted, "complete": crafted}}}) is None


def test_a_crafted_file_name_in_a_choice_is_never_pulled(tmp_path):
    tier = MemoryTier(tmp_path / "node", host="127.0.0.1", secret_file=None)
    choice = MemoryChoice(MemorySnapshot(4, 3), {"../../planted": 1, "/abs": 1})
    # No holder address is given: a name that got through would fail looking one up.
    assert tier._pull(tmp_path / "node" / "r4" / "step_3", 4, choice, {}, ["../../planted", "/abs"]) == 0
    assert not (tmp_path / "planted").exists()


def as_memory_snapshot_of(snapshot: Path, run: str) -> None:
    """Make a storage snapshot's commit marker a memory snapshot's of ``run`` (which names its run)."""
    marker = json.loads((snapshot / COMMIT_MARKER).read_text())
    (snapshot / COMMIT_MARKER).write_text(json.dumps({**marker, "tier": "memory", "run": run}))


def in_memory_after_storage(since: float) -> Callable[[list[dict]], list[dict]]:
    """A predicate of a job's events: their memory snapshots committed after ``since`` (when the
    round of every node formed: one of an earlier, smaller round holds nothing of a node that joined
    since) and newer than storage's newest."""

    def committed(events: list[dict]) -> list[dict]:
        storage = max((e["step"] for e in events if e["event"] == "save_committed"), default=None)
        return [e for e in events if e["event"] == "memory_save_committed" and e["time"] > since
                and storage is not None and e["step"] > storage + 2]

    return committed


def round_of_three(cluster: Cluster) -> float:
    """When the round of all three nodes formed (the first round may form with two)."""
    return max(e["time"] for e in cluster.wait_for_round_of(3, 120))


def test_a_lost_node_resumes_from_memory_and_trains_on_as_if_nothing_happened(tmp_path):
    faulty = tmp_path / "faulty"
    faulty.mkdir()
    args = memory_args(steps=STEPS, train_args=["--log-samples", str(faulty / "samples.jsonl")])
    cluster = Cluster(args, faulty)
    try:
        cluster.start_all(3)
        formed = round_of_three(cluster)
        cluster.wait_for(in_memory_after_storage(formed), 120, "a memory snapshot of three nodes, newer than storage's")
        lost_at = time.time()
        cluster.kill(2)
        assert cluster.wait_done(240) == [0, 0]
    finally:
        cluster.stop()
    events = read_events(faulty / "events.jsonl")
    recovery = recovery_after(events, lost_at, failed_at=lost_at)
    assert recovery["restore_source"] == "memory" and recovery["bytes_from_storage"] == 0
    before = [e for e in events if e["time"] < lost_at]
    newest_in_storage = max(e["step"] for e in before if e["event"] == "save_committed")
    newest_in_memory = max(e["step"] for e in before if e["event"] == "memory_save_committed")
    # The newest memory snapshot (or one committed as the node died), newer than storage's.
    assert recovery["restored_step"] >= newest_in_memory > newest_in_storage
    # Each survivor pulled what its rank lacked while the rendezvous ran (the replicated model and
    # optimizer partitions of the lost node), then its round's fetch found little or nothing left.
    # (A node slow to start may join after the first round: that earlier round change is not counted.)
    ahead = [e for e in events if e["event"] == "memory_pull_ahead_done" and e["time"] >= lost_at]
    assert len(ahead) == 2 and all(e["bytes"] > 0 for e in ahead), ahead
    assert recovery["restored_step"] in {e["step"] for e in ahead}
    fetched = [e for e in events if e["event"] == "memory_fetch_done" and e["time"] >= lost_at]
    assert len(fetched) == 2
    reference = chaos.reference_run(tmp_path / "reference", STEPS, cluster.width)
    ours = chaos.final_model(faulty / "checkpoints" / f"step_{STEPS}", cluster.width)
    theirs = chaos.final_model(reference / f"step_{STEPS}", cluster.width)
    for key in theirs:  # equal up to float summation order across world sizes (see test_recovery_e2e)
        assert torch.allclose(ours[key], theirs[key], rtol=0, atol=1e-5), key


def test_a_joining_node_is_admitted_right_after_a_memory_snapshot_and_restarts_from_it(tmp_path):
    # A memory snapshot every 200 steps (about 2 s here), storage's far apart: the join waits.
    cluster = Cluster(memory_args(memory_interval=200, interval_steps=5000), tmp_path)
    try:
        cluster.start_all(2)
        cluster.wait_for(lambda ev: len([e for e in ev if e["event"] == "memory_save_committed"]) >= 2, 120,
                         "two memory snapshots: when the next is due is known")
        joined_at = time.time()
        cluster.start(2)
        recovery = cluster.wait_for(lambda ev: recovery_after(ev, joined_at, failed_at=joined_at), 120, "the join")
    finally:
        cluster.stop()
    events = read_events(tmp_path / "events.jsonl")
    changes = events_after(events, "membership_change", joined_at)
    first = changes[0]
    assert first["cause"] == "node_joined", changes
    # The agent that restarted first decided for the job; another one, which saw the join a little
    # later than the detection skew allows for, may have waited for the next commit meanwhile.
    deferred = sorted((e for e in events if e["event"] == "join_deferred" and e["time"] > joined_at
                       and e["node"] == first["node"]), key=lambda e: e["time"])
    commits = [e for e in events if e["event"] == "memory_save_committed"]
    if deferred:  # the join waited: for a snapshot newer than any when it was seen
        assert first["deferred_s"] > 0
        newest_before = max(e["step"] for e in commits if e["time"] <= deferred[0]["time"])
        assert first["at_commit"] > newest_before
    else:  # a commit landed just before the join was seen (within the agents' skew): that one counts
        (made,) = [e for e in commits if e["step"] == first["at_commit"]]
        assert first["deferred_s"] == 0 and first["time"] - made["time"] <= 0.25 + 2 * 0.1 + 0.1
    # The first survivor to restart did so right after that commit, and that is the snapshot the
    # new round restores, from memory.
    assert first["at_commit"] == recovery["restored_step"]
    assert recovery["restore_source"] == "memory" and recovery["world_size_after"] == 3
    assert recovery["deferred_s"] == first["deferred_s"]


def test_two_buddies_lost_together_restore_from_storage(tmp_path):
    # Node 1's files live on node 1 and its buddy node 2: with both gone, no memory snapshot is whole.
    cluster = Cluster(memory_args(), tmp_path)
    try:
        cluster.start_all(3)
        formed = round_of_three(cluster)
        cluster.wait_for(in_memory_after_storage(formed), 120, "a memory snapshot of three nodes, newer than storage's")
        lost_at = time.time()
        cluster.kill(1)
        cluster.kill(2)
        recovery = cluster.wait_for(lambda ev: recovery_after(ev, lost_at, failed_at=lost_at), 120, "the recovery")
    finally:
        cluster.stop()
    events = read_events(tmp_path / "events.jsonl")
    storage_steps = {e["step"] for e in events if e["event"] == "save_committed"}
    assert recovery["world_size_after"] == 1 and recovery["restore_source"] == "storage"
    assert recovery["restored_step"] in storage_steps and recovery["bytes_from_storage"] > 0
    assert not [e for e in events if e["event"] == "restore_fallback"]  # the leader chose storage: nothing failed


def test_a_damaged_memory_file_falls_back_to_storage(tmp_path):
    cluster = Cluster(memory_args(), tmp_path)
    try:
        cluster.start_all(3)
        formed = round_of_three(cluster)
        cluster.wait_for(in_memory_after_storage(formed), 120, "a memory snapshot of three nodes, newer than storage's")
        workers = [p for i in (0, 1, 2) for p in cluster.pids(i) if p != cluster.nodes[i].pid]
        for pid in workers:  # training pauses: no newer memory snapshot replaces the damaged one
            os.kill(pid, signal.SIGSTOP)
        # Flip one byte in the middle of every data file node 0 holds, in its own tmpfs.
        flip = ("import pathlib, sys\n"
                "for p in pathlib.Path(sys.argv[1]).glob('*/r*/step_*/**/*'):\n"
                "    if p.is_file() and not p.name.startswith('.') and p.stat().st_size > 64:\n"
                "        b = bytearray(p.read_bytes()); b[len(b) // 2] ^= 1; p.write_bytes(b)\n")
        subprocess.run(["nsenter", "--target", str(cluster.nodes[0].pid), "--mount", "--", sys.executable, "-c", flip,
                        str(cluster.memory_dir)], check=True, timeout=60)
        lost_at = time.time()
        cluster.kill(2)
        for pid in workers:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        recovery = cluster.wait_for(lambda ev: recovery_after(ev, lost_at, failed_at=lost_at), 120, "the recovery")
    finally:
        cluster.stop()
    events = read_events(tmp_path / "events.jsonl")
    fallbacks = [e for e in events if e["event"] == "restore_fallback"]
    assert fallbacks and all("/r" in e["snapshot"] and "checksum" in e["error"] for e in fallbacks), fallbacks
    assert recovery["restore_source"] == "storage" and recovery["world_size_after"] == 2


def test_a_save_that_is_not_committed_leaves_no_ram_behind(tmp_path):
    # One node, no buddy: the snapshot is written to the memory directory, then cannot be
    # replicated, so it is not committed; the node frees it (a full tmpfs must not stay full).
    from agent.events import EventLog
    from agent.memory.saver import MemorySaver

    root = tmp_path / "memory"
    (root / "r3" / "step_4").mkdir(parents=True)  # an older snapshot that was never committed either
    saver = MemorySaver(root, interval_steps=1, buddy="", round=3, local_rank=0,
                        events=EventLog(tmp_path / "events.jsonl"))
    assert saver.save(5, {"model": {"weight": torch.arange(1000.0)}}, replicated=[])
    saver.wait()
    [failed] = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "memory_save_failed"]
    assert failed["step"] == 5 and "buddy" in failed["error"]
    assert not (root / "r3" / "step_5").exists()  # written, then freed
    assert (root / "r3" / "step_4").exists()  # another snapshot is not this save's to remove


def test_a_full_tmpfs_warns_and_the_storage_tier_goes_on(tmp_path):
    cluster = Cluster(memory_args(memory_mb=1, state_mb=8), tmp_path)
    try:
        cluster.start_all(3)
        cluster.wait_for_round_of(3, 120)  # the first round may form with two
        events = cluster.wait_for(lambda ev: len([e for e in ev if e["event"] == "save_committed"]) >= 2 and ev, 120,
                                  "two storage commits")
    finally:
        cluster.stop()
    failed = [e for e in events if e["event"] == "memory_save_failed"]
    # The rank whose write hit the full tmpfs says so; another may first report the save's collective failing.
    assert any("No space left on device" in e["error"] for e in failed), failed
    assert not [e for e in events if e["event"] == "memory_save_committed"]
    assert "memory snapshot of step" in (tmp_path / "node0.log").read_text()  # the warning


def test_agents_share_one_secret_find_their_buddies_and_free_their_ram_at_the_end(tmp_path):
    job_store = dist.HashStore()
    job_store.set_timeout(timedelta(seconds=30))
    round_store = dist.PrefixStore("torch.rendezvous.job.4", job_store)  # as torch's rendezvous wraps it
    tiers = [MemoryTier(tmp_path / f"node{g}", host="127.0.0.1", secret_file=None) for g in (0, 1)]
    try:
        with ThreadPoolExecutor(2) as pool:
            buddies = list(pool.map(lambda g: tiers[g].start_round(round_store, 4, g, 2), (0, 1)))
        addresses = ["%s:%d" % tier._server.address for tier in tiers]
        assert buddies == [addresses[1], addresses[0]]
        secrets = [(tier.root / KEY_FILE).read_bytes() for tier in tiers]
        assert secrets[0] == secrets[1] and oct((tiers[0].root / KEY_FILE).stat().st_mode & 0o777) == "0o600"
        (tiers[1].root / "r4" / "step_3").mkdir(parents=True)
        (tiers[1].root / "r4" / "step_3" / "f").write_bytes(b"x" * 10)
        with PeerFileClient(tiers[1]._server.address, read_key(tiers[0].root / KEY_FILE), round=4) as client:
            assert client.list("r4") == {"step_3/f": 10}
        # A later round (another prefix) and a new agent: the same secret, kept outside the rounds.
        late = MemoryTier(tmp_path / "node2", host="127.0.0.1", secret_file=None)
        tiers.append(late)
        assert late.start_round(dist.PrefixStore("torch.rendezvous.job.5", job_store), 5, 0, 1) == ""  # alone: no buddy
        assert (late.root / KEY_FILE).read_bytes() == secrets[0]
        # The kept secret goes (with etcd3, with its writer's lease) and a new agent draws another
        # first: the others take it at their next round, and every agent still reaches every other.
        job_store.delete_key("torchrevive/memory/secret")
        newcomer = MemoryTier(tmp_path / "node3", host="127.0.0.1", secret_file=None)
        tiers.append(newcomer)
        round6 = dist.PrefixStore("torch.rendezvous.job.6", job_store)
        assert newcomer.start_round(round6, 6, 0, 1) == ""
        tiers[1].start_round(round6, 6, 1, 1)  # a standby node of round 6: it still takes the secret
        assert (tiers[1].root / KEY_FILE).read_bytes() == (newcomer.root / KEY_FILE).read_bytes() != secrets[0]
        with PeerFileClient(tiers[1]._server.address, read_key(newcomer.root / KEY_FILE), round=6) as client:
            assert client.list("r4") == {"step_3/f": 10}
    finally:
        for tier in tiers:
            tier.close()
    assert all(not tier.root.exists() and tier.root.parent.is_dir() for tier in tiers)  # each run's own directory


def test_a_pull_ahead_takes_what_a_node_lacks_from_live_peers_of_its_round_only(tmp_path):
    """A node that saw a loss pulls the newest snapshot its peers hold while the rendezvous runs:
    from the peer that holds it, past a frozen peer (connects, never answers), and nothing once
    the peers have moved on to the next round."""
    import socket
    import threading

    from agent.checkpoint import Checkpointer
    from agent.checkpoint.dirs import committed_snapshots

    ckpt = Checkpointer(tmp_path / "ckpt")
    ckpt.save(5, {"model": torch.nn.Linear(600, 500)})
    ckpt.wait()
    [(_, written)] = committed_snapshots(tmp_path / "ckpt")
    files = sorted(p.relative_to(written) for p in written.rglob("*") if p.is_file())
    frozen = socket.create_server(("127.0.0.1", 0))  # accepts into its backlog, never answers
    store = dist.PrefixStore("torch.rendezvous.job.4", dist.HashStore())
    store.underlying_store.set("torchrevive/memory/4/address/2", "127.0.0.1:%d" % frozen.getsockname()[1])
    tiers = [MemoryTier(tmp_path / f"node{g}", host="127.0.0.1", secret_file=None) for g in (0, 1)]
    try:
        tiers[1].start_round(store, 4, 1, 3)
        tiers[0].start_round(store, 4, 0, 3)
        as_memory_snapshot_of(written, tiers[1].run_id)
        shutil.copytree(written, tiers[1].root / "r4" / "step_5")  # the peer holds all of it
        mine = tiers[0].root / "r4" / "step_5"
        mine.mkdir(parents=True)
        kept = max(files, key=lambda f: (written / f).stat().st_size)  # this node holds one file of its own
        (mine / kept).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(written / kept, mine / kept)

        def pull_ahead() -> tuple:
            done, outcome = threading.Event(), []
            tiers[0].pull_ahead(store, 4, 0, 3, [0], 1, lambda *result: (outcome.extend(result), done.set()))
            assert done.wait(20), "the pull ahead hung on the frozen peer"
            return tuple(outcome)

        snapshot, pulled, _ = pull_ahead()
        assert snapshot == MemorySnapshot(4, 5)
        assert pulled == sum((written / f).stat().st_size for f in files if f != kept)
        for f in files:
            assert (mine / f).read_bytes() == (written / f).read_bytes(), f
        shutil.rmtree(mine)
        mine.mkdir()
        (mine / kept).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(written / kept, mine / kept)
        tiers[1]._server.round = 5  # the peer moved on: it answers no request of round 4
        assert pull_ahead()[:2] == (None, 0)
        assert sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file()) == [kept]
    finally:
        frozen.close()
        for tier in tiers:
            tier.close()
