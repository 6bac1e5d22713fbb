"""The memory tier, the agent's side: each agent serves its node's memory directory to its peers
(:mod:`agent.memory.peer_files`), tells each round's workers where their buddy is, and in a
recovery helps the round's leader pick the newest snapshot it can restore without storage.

Each run of an agent has a memory directory of its own (:mod:`agent.memory.run_dir`), and
vouches only for snapshots its rendezvous run committed.

Per round, through the job's rendezvous store (keys named for the round): each active node
publishes its data plane's address and its inventory (the memory snapshots it holds, file by file,
compressed: it stays within etcd's request limit), and deletes what it published the round
before. The leader picks the newest memory snapshot its run committed whose every file is on some
live node, or none; while its workers start, each agent pulls the files its ranks will read and
its node lacks from the nodes that hold them, so its ranks restore from local RAM through the same
engine as a storage snapshot, resharded to the new world size.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousError

from agent.checkpoint.checksums import CHECKSUMS_FILE
from agent.checkpoint.dirs import COMMIT_MARKER
from agent.errors import RestoreError
from agent.memory.layout import (
    FETCHED_FILE,
    INVENTORY_MAX_BYTES,
    KEY_FILE,
    MemorySnapshot,
    decode_inventory,
    file_sizes,
    fit_inventory,
    inventory,
    mark_fetched,
    of_run,
    safe_name,
    snapshots,
    written_by,
)
from agent.memory.peer_files import (
    PeerError,
    PeerFileClient,
    PeerFileServer,
    parse_address,
    read_secret,
    write_key,
)
from agent.memory.run_dir import RunDir

_PREFIX = "torchrevive/memory"


def inventory_key(round: int, group_rank: int) -> str:
    """Where the node of ``group_rank`` publishes its memory inventory when ``round`` forms."""
    return f"{_PREFIX}/{round}/inventory/{group_rank}"


PEER_LIST_TIMEOUT_S = 1.0
"""How long a pull ahead waits for a peer's answer: a frozen peer is skipped after it."""
PEER_TRIES = 2
"""How many peers :meth:`MemoryTier.from_peers` asks before it gives up."""
PEER_FETCH_TIMEOUT_S = 2.0
"""How long it waits for a peer's answer (a frozen one is skipped after it)."""
MAX_PEERS_ASKED = 1024
"""The group ranks it looks through for published addresses."""


@dataclass(frozen=True)
class MemoryChoice:
    """The memory snapshot a round restores, and a node that holds each of its files."""

    snapshot: MemorySnapshot
    holders: dict[str, int]
    """file (relative to the snapshot) -> group rank of a node holding it."""

    def to_json(self) -> str:
        return json.dumps({"snapshot": self.snapshot.relative, "holders": self.holders})

    @classmethod
    def from_json(cls, text: str) -> MemoryChoice:
        """The choice the round's leader published. It comes from the store: every name is
        checked, and ValueError says what is wrong (the caller names the key)."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return cls(MemorySnapshot.parse(raw.get("snapshot")), file_sizes(raw.get("holders"), what="holders"))


class MemoryTier:
    """One agent's part of the memory tier.

    Args:
        base: where this run's memory directory is made (``checkpoint.memory_dir``, default
            /dev/shm; see :class:`agent.memory.run_dir.RunDir`): :attr:`root`.
        run_id: the rendezvous run id (``job.id``): it names the directory, and the snapshots
            this tier vouches for and restores are those its run committed.
        host: the node's own address; the data plane listens there.
        secret_file: the job's secret (mode 600); None: the first round's leader draws one and
            shares it through the rendezvous store (as safe as that store).
    """

    def __init__(self, base: Path, *, run_id: str = "", host: str, secret_file: str | None) -> None:
        self._run_dir = RunDir(Path(base), run_id)
        self.root = self._run_dir.path
        self.run_id = run_id
        self.host = host
        self._secret_file = secret_file
        self._server: PeerFileServer | None = None
        self._secret = b""
        """The data plane's key (32 bytes) this agent serves and pulls with."""
        self._shared_hex = ""
        self._ahead: threading.Thread | None = None
        """The pull ahead of a round's fetch (:meth:`pull_ahead`), if one was started."""
        self._ahead_stop = threading.Event()
        self._published: list[tuple[Any, str]] = []
        """The keys this node set in its last round, and that round's store."""

    def close(self) -> None:
        """Stop serving and free the node's RAM: this run's memory directory goes (nothing else)."""
        if self._server is not None:
            self._server.close()
        self._run_dir.close()

    def start_round(self, store: Any, round: int, group_rank: int, active_nodes: int) -> str:
        """Delete what this node published for its last round; publish its address and inventory
        for ``round``; the buddy's ``host:port`` for this node's workers ("" when this node is
        standby or alone)."""
        store = job_store(store)
        self._ensure_server(store)
        assert self._server is not None
        self._server.round = round
        self._delete_published()
        host, port = self._server.address
        if group_rank < active_nodes:
            self._publish(store, f"{_PREFIX}/{round}/address/{group_rank}", f"{host}:{port}")
            self._publish(store, *self._inventory(round, group_rank))
        if group_rank >= active_nodes or active_nodes < 2:
            return ""
        return store.get(f"{_PREFIX}/{round}/address/{(group_rank + 1) % active_nodes}").decode()

    def _inventory(self, round: int, group_rank: int) -> tuple[str, str]:
        """This node's inventory key for ``round`` and its value, within the store's limit (a
        warning names the snapshots left out when it does not fit)."""
        key = inventory_key(round, group_rank)
        encoded, left_out = fit_inventory(inventory(self.root, self.run_id))
        if left_out:
            warnings.warn(f"{key}: this node's memory inventory is over {INVENTORY_MAX_BYTES} bytes even compressed; "
                          f"{', '.join(left_out)} left out of it (not restored from this node). The snapshots hold "
                          "too many files for the store: fewer ranks per node or the storage tier alone", stacklevel=3)
        return key, encoded

    def _publish(self, store: Any, key: str, value: str) -> None:
        store.set(key, value)
        self._published.append((store, key))

    def _delete_published(self) -> None:
        """Delete the keys of this node's last round: nobody reads them once a round has formed
        after it (its peers serve the new round only), and the store would grow every round."""
        published, self._published = self._published, []
        for store, key in published:
            try:
                store.delete_key(key)
            except Exception as exc:  # noqa: BLE001 - a cleanup; a store that is down, the rendezvous tells
                warnings.warn(f"{key}: could not delete this node's key of an earlier round ({exc})", stacklevel=3)

    def choose(self, store: Any, round: int, active_nodes: int) -> MemoryChoice | None:
        """(The round's leader.) The newest memory snapshot its run committed every file of which
        is on a node of this round, with a holder for each file; None when there is none. A
        malformed inventory is left out, with a warning."""
        store = job_store(store)
        held = {}
        for g in range(active_nodes):
            key = inventory_key(round, g)
            try:
                held[g] = of_run(decode_inventory(store.get(key), source=key), self.run_id)
            except ValueError as exc:
                warnings.warn(str(exc), stacklevel=2)
                held[g] = {}
        return newest_complete(held)

    def pull_ahead(self, store: Any, round: int, group_rank: int, active_nodes: int, ranks: list[int],
                   world_size: int, on_done: Callable[[MemorySnapshot | None, int, float], None]) -> None:
        """The round ends: pull, in the background while the rendezvous runs, the files of the
        newest memory snapshot that this node and its live peers of ``round`` hold together and
        that this node's ``ranks`` (of ``world_size``) read and it lacks. The bulk of them is
        replicated state, which every rank reads at any world size; the round's fetch
        (:meth:`start_fetch`) pulls what is left. Peers answer only while they are still in
        ``round``; ``on_done(snapshot, bytes, seconds)`` at the end (snapshot None: nothing whole)."""
        self._ahead_stop.set()
        store = job_store(store)
        keys = {g: f"{_PREFIX}/{round}/address/{g}" for g in range(active_nodes) if g != group_rank}
        try:  # a peer that died before publishing its address never will: no blocking get
            addresses = {g: parse_address(store.get(key).decode()) for g, key in keys.items() if store.check([key])}
        except (RuntimeError, ValueError, RendezvousError):
            return  # the store is gone too (its host was lost): the round's rendezvous will tell
        self._ahead_stop = stop = threading.Event()
        self._ahead = threading.Thread(target=self._pull_ahead,
                                       args=(round, group_rank, addresses, ranks, world_size, stop, on_done),
                                       name="torchrevive-memory-pull-ahead", daemon=True)
        self._ahead.start()

    def _pull_ahead(self, round: int, group_rank: int, addresses: dict[int, tuple[str, int]], ranks: list[int],
                    world_size: int, stop: threading.Event,
                    on_done: Callable[[MemorySnapshot | None, int, float], None]) -> None:
        from agent.prefetch import files_read

        started, pulled, choice = time.monotonic(), 0, None
        try:
            candidates = [s.relative for s in reversed(snapshots(self.root))]
            held = self._list_peers(round, addresses, candidates)
            for relative in candidates:  # a committed one's record, from a peer that vouches for it
                voucher = next((g for g, entries in sorted(held.items())
                                if {CHECKSUMS_FILE, COMMIT_MARKER} <= entries.get(relative, {}).get("files", {}).keys()), None)
                if voucher is None:
                    continue
                records = {name: voucher for name in _records()}
                try:
                    pulled += self._pull_records(self.root / relative, round,
                                                 MemoryChoice(MemorySnapshot.parse(relative), records), addresses)
                except (OSError, RestoreError, PeerError, ValueError):
                    continue  # this candidate only (another run's, say): the others may be whole
            # Only this node's inventory vouches for a snapshot, and only for one of its own run.
            choice = newest_complete({**held, group_rank: inventory(self.root, self.run_id)})
            if choice is not None and not stop.is_set():
                local = self.root / choice.snapshot.relative
                pulled += self._pull(local, round, choice, addresses, sorted(files_read(local, ranks, world_size)),
                                     stop=stop)
        except (OSError, RestoreError, PeerError, ValueError):
            pass  # what is missing, the round's fetch pulls
        finally:
            on_done(choice.snapshot if choice else None, pulled, time.monotonic() - started)

    def _list_peers(self, round: int, addresses: dict[int, tuple[str, int]],
                    candidates: list[str]) -> dict[int, dict[str, dict]]:
        """What each reachable peer of ``round`` holds of the ``candidates`` snapshots (as in an
        inventory, without the checksum records). A lost peer refuses or, frozen, says nothing
        within a second: it holds nothing."""
        def listed(item: tuple[int, tuple[str, int]]) -> tuple[int, dict[str, dict]]:
            group, address = item
            entries: dict[str, dict] = {}
            try:
                with PeerFileClient(address, self._secret, round=round, timeout=PEER_LIST_TIMEOUT_S) as client:
                    for relative in candidates:
                        files = client.list(relative)
                        entries[relative] = {"files": {name: size for name, size in files.items()
                                                       if safe_name(name) and not name.startswith(FETCHED_FILE)}}
            except (PeerError, OSError):
                pass  # unreachable, or moved on to the next round: what it listed so far stands
            return group, entries

        with ThreadPoolExecutor(max_workers=max(1, len(addresses))) as pool:
            return dict(pool.map(listed, addresses.items()))

    def start_fetch(self, store: Any, round: int, choice: MemoryChoice, ranks: list[int], world_size: int,
                    on_done: Callable[[int, float], None]) -> None:
        """Pull, in the background while the workers start, the files of ``choice`` that this
        node's ``ranks`` (of ``world_size``) will read and the node lacks, into the same path
        here. When done it calls ``on_done(bytes, seconds)`` and marks the directory (the ranks
        wait for that). A file that cannot be pulled is left missing: the
        ranks' restore then fails on it and falls back to storage, all together."""
        local = self.root / choice.snapshot.relative
        local.mkdir(parents=True, exist_ok=True)
        store = job_store(store)
        addresses = {}
        for g in set(choice.holders.values()):
            key = f"{_PREFIX}/{round}/address/{g}"
            try:  # the holders come from the store: one that published no address is not waited for
                if store.check([key]):
                    addresses[g] = parse_address(store.get(key).decode())
            except ValueError:
                pass  # a malformed address: that holder's files are left missing
        threading.Thread(target=self._fetch, args=(local, round, choice, addresses, ranks, world_size, on_done),
                         name="torchrevive-memory-fetch", daemon=True).start()

    def _fetch(self, local: Path, round: int, choice: MemoryChoice, addresses: dict[int, tuple[str, int]],
               ranks: list[int], world_size: int, on_done: Callable[[int, float], None]) -> None:
        from agent.prefetch import files_read

        if self._ahead is not None:  # what it pulls now is still pulled; then this fetch takes over
            self._ahead_stop.set()
            self._ahead.join()
        started, pulled = time.monotonic(), 0
        try:
            pulled += self._pull_records(local, round, choice, addresses)
            pulled += self._pull(local, round, choice, addresses, sorted(files_read(local, ranks, world_size)))
        except (OSError, RestoreError):
            pass  # left missing: see start_fetch
        finally:
            seconds = time.monotonic() - started
            mark_fetched(local, round, {"bytes": pulled, "seconds": seconds})
            on_done(pulled, seconds)

    def _pull_records(self, local: Path, round: int, choice: MemoryChoice,
                      addresses: dict[int, tuple[str, int]]) -> int:
        """Pull the snapshot's metadata, checksum record and commit marker, those not here yet;
        the bytes pulled. A commit marker pulled that another run wrote is refused: removed (the
        snapshot is not committed here, so the ranks never restore it), and RestoreError."""
        had_marker = (local / COMMIT_MARKER).is_file()
        pulled = self._pull(local, round, choice, addresses, list(_records()))
        if not had_marker and (local / COMMIT_MARKER).is_file() and not written_by(local, self.run_id):
            (local / COMMIT_MARKER).unlink()
            raise RestoreError(f"{local}: the commit marker pulled from node {choice.holders[COMMIT_MARKER]} is not "
                               f"of this run ({self.run_id!r}): refused")
        return pulled

    def _pull(self, local: Path, round: int, choice: MemoryChoice, addresses: dict[int, tuple[str, int]],
              names: list[str], *, stop: threading.Event | None = None) -> int:
        """Pull the ``names`` not here yet, from each holder in parallel; the bytes pulled. Once
        ``stop`` is set, no further file is started."""
        by_holder: dict[int, list[str]] = {}
        for name in names:
            if name in choice.holders and safe_name(name) and not (local / name).is_file():
                by_holder.setdefault(choice.holders[name], []).append(name)

        def pull(holder: int, wanted: list[str]) -> int:
            pulled = 0
            if holder not in addresses:
                return 0  # no address published: left missing (see start_fetch)
            try:
                with PeerFileClient(addresses[holder], self._secret, round=round) as client:
                    for name in wanted:
                        if stop is not None and stop.is_set():
                            break
                        pulled += client.get(f"{choice.snapshot.relative}/{name}", local / name)
            except (PeerError, OSError):
                pass  # left missing: see start_fetch
            return pulled

        with ThreadPoolExecutor(max_workers=max(1, len(by_holder))) as pool:
            return sum(pool.map(lambda item: pull(*item), by_holder.items()))

    def from_peers(self, store: Any, round: int, fetch: Callable[[PeerFileClient], None], *,
                   exclude: int | None = None, tries: int = PEER_TRIES) -> int:
        """Call ``fetch`` with a client of each node of ``round`` that published its address (group
        rank order, ``exclude`` left out, at most ``tries``) until one call succeeds; the group rank
        of that node. PeerError (the last one's) when none did. Peers answer only while they are in
        ``round``; a node not in it yet (a joining one) asks the round it reads from the rendezvous."""
        store = job_store(store)
        self._ensure_server(store)
        problem = PeerError(f"no node of round {round} published its address")
        tried = 0
        for group in range(MAX_PEERS_ASKED):
            key = f"{_PREFIX}/{round}/address/{group}"
            if tried == tries or not store.check([key]):
                break
            if group == exclude:
                continue
            tried += 1
            try:
                with PeerFileClient(parse_address(store.get(key).decode()), self._secret, round=round,
                                    timeout=PEER_FETCH_TIMEOUT_S) as client:
                    fetch(client)
                return group
            except (PeerError, OSError, ValueError) as exc:
                problem = exc if isinstance(exc, PeerError) else PeerError(f"{key}: {exc}")
        raise problem

    def _ensure_server(self, store: Any) -> None:
        """Serve with the job's secret: the configured file's, else the one kept in the job's
        ``store``. Each round every agent offers the secret it has (a
        new one draws one) and takes what the store holds: the first offer wins, and should the
        key go (with etcd3, with the lease of the agent that wrote it) the agents converge again."""
        if self._secret_file:
            key = read_secret(self._secret_file)
        else:
            offer = self._shared_hex or secrets.token_hex(32)
            self._shared_hex = store.compare_set(f"{_PREFIX}/secret", "", offer).decode()
            key = bytes.fromhex(self._shared_hex)  # 32 random bytes: a key as it is
        if self._server is not None and self._secret == key:
            return
        # The workers read it from the node's memory directory (mode 600, in a 700 directory).
        write_key(self.root / KEY_FILE, key)
        self._secret = key
        if self._server is None:
            self._server = PeerFileServer(self.root, key, host=self.host)
        else:
            self._server.secret = key


def job_store(store: Any) -> Any:
    """The job's rendezvous store under a round's: torch gives each round the job's store in a
    PrefixStore. The tier's keys live in the job's store itself, named for their round, because a
    PrefixStore cannot delete through to a store written in Python (etcd3's): torch's binding of
    ``delete_key`` is missing there."""
    return store.underlying_store if isinstance(store, dist.PrefixStore) else store


def _records() -> tuple[str, ...]:
    """A snapshot's records: torchsnapshot's metadata, the checksum record, the commit marker."""
    from torchsnapshot.snapshot import SNAPSHOT_METADATA_FNAME  # late: torchsnapshot is slow to import

    return SNAPSHOT_METADATA_FNAME, CHECKSUMS_FILE, COMMIT_MARKER


def newest_complete(held: Mapping[int, Mapping[str, Any]]) -> MemoryChoice | None:
    """From each node's inventory (group rank -> :func:`agent.memory.layout.inventory`), the
    newest committed snapshot whose every file some node holds, whole (its size as recorded)."""
    candidates: dict[str, dict[str, int]] = {}
    for entries in held.values():
        for relative, entry in entries.items():
            if "complete" in entry:
                candidates.setdefault(relative, entry["complete"])
    for relative in sorted(candidates, key=MemorySnapshot.parse, reverse=True):
        if not all(safe_name(name) for name in candidates[relative]):
            continue  # an inventory naming a file outside the snapshot: data from a peer, not to be followed
        holders: dict[str, int] = {}
        for name, size in candidates[relative].items():
            holder = next((g for g, entries in sorted(held.items())
                           if entries.get(relative, {}).get("files", {}).get(name) == size), None)
            if holder is None:
                break
            holders[name] = holder
        else:
            return MemoryChoice(MemorySnapshot.parse(relative), holders)
    return None
