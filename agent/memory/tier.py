"""The memory tier, the agent's side: each agent serves its node's memory directory to its peers
(:mod:`agent.memory.peer_files`), tells each round's workers where their buddy is, and in a
recovery helps the round's leader pick the newest snapshot it can restore without storage.

Per round, through the round's store: each active node publishes its data plane's address and
its inventory (the memory snapshots it holds, file by file). The leader picks the newest
committed memory snapshot whose every file is on some live node, or none; each agent then pulls
the files its node lacks from the nodes that hold them, so its ranks restore it from local RAM
through the same engine as a storage snapshot, resharded to the new world size.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.memory.layout import SECRET_FILE, MemorySnapshot, inventory
from agent.memory.peer_files import PeerError, PeerFileClient, PeerFileServer, read_secret

_PREFIX = "torchrevive/memory"


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
        raw = json.loads(text)
        return cls(MemorySnapshot.parse(raw["snapshot"]), {str(k): int(v) for k, v in raw["holders"].items()})


class MemoryTier:
    """One agent's part of the memory tier.

    Args:
        root: the node's memory directory (created, mode 700).
        host: the node's own address; the data plane listens there.
        secret_file: the job's secret (mode 600); None: the first round's leader draws one and
            shares it through the rendezvous store (as safe as that store).
    """

    def __init__(self, root: Path, *, host: str, secret_file: str | None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        self.host = host
        self._secret_file = secret_file
        self._server: PeerFileServer | None = None
        self._secret = b""

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def start_round(self, store: Any, round: int, group_rank: int, active_nodes: int) -> str:
        """Publish this node's address and inventory for ``round``; the buddy's ``host:port``
        for this node's workers ("" when this node is standby or alone)."""
        self._ensure_server(store)
        assert self._server is not None
        self._server.round = round
        host, port = self._server.address
        if group_rank < active_nodes:
            store.set(f"{_PREFIX}/{round}/address/{group_rank}", f"{host}:{port}")
            store.set(f"{_PREFIX}/{round}/inventory/{group_rank}", json.dumps(inventory(self.root)))
        if group_rank >= active_nodes or active_nodes < 2:
            return ""
        return store.get(f"{_PREFIX}/{round}/address/{(group_rank + 1) % active_nodes}").decode()

    def choose(self, store: Any, round: int, active_nodes: int) -> MemoryChoice | None:
        """(The round's leader.) The newest committed memory snapshot every file of which is on a
        node of this round, with a holder for each file; None when there is none."""
        held = {g: json.loads(store.get(f"{_PREFIX}/{round}/inventory/{g}")) for g in range(active_nodes)}
        return newest_complete(held)

    def fetch(self, store: Any, round: int, choice: MemoryChoice) -> tuple[Path, int]:
        """Pull the files of ``choice`` this node lacks from the nodes holding them; the local
        snapshot directory and the bytes pulled. A file that cannot be pulled is left missing:
        the ranks' restore then fails on it and falls back to storage, all together."""
        local = self.root / choice.snapshot.relative
        missing: dict[int, list[str]] = {}
        for name, holder in sorted(choice.holders.items()):
            if not (local / name).is_file():
                missing.setdefault(holder, []).append(name)

        def pull(holder: int, names: list[str]) -> int:
            address = store.get(f"{_PREFIX}/{round}/address/{holder}").decode()
            host, _, port = address.rpartition(":")
            pulled = 0
            try:
                with PeerFileClient((host, int(port)), self._secret, round=round) as client:
                    for name in names:
                        pulled += client.get(f"{choice.snapshot.relative}/{name}", local / name)
            except (PeerError, OSError):
                pass  # left missing: see the docstring
            return pulled

        with ThreadPoolExecutor(max_workers=max(1, len(missing))) as pool:
            pulled = sum(pool.map(lambda item: pull(*item), missing.items()))
        return local, pulled

    def _ensure_server(self, store: Any) -> None:
        if self._server is not None:
            return
        if self._secret_file:
            secret = read_secret(self._secret_file)
        else:  # the first agent to get here draws it; the store outside the round's prefix keeps it for all rounds
            job_store = getattr(store, "underlying_store", store)
            secret = bytes.fromhex(job_store.compare_set(f"{_PREFIX}/secret", "", secrets.token_hex(32)).decode())
        # The workers read it from the node's memory directory (mode 600, in a 700 directory).
        path = self.root / SECRET_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secret.hex().encode())
        self._secret = read_secret(path)
        self._server = PeerFileServer(self.root, self._secret, host=self.host)


def newest_complete(held: Mapping[int, Mapping[str, Any]]) -> MemoryChoice | None:
    """From each node's inventory (group rank -> :func:`agent.memory.layout.inventory`), the
    newest committed snapshot whose every file some node holds, whole (its size as recorded)."""
    candidates: dict[str, dict[str, int]] = {}
    for entries in held.values():
        for relative, entry in entries.items():
            if "complete" in entry:
                candidates.setdefault(relative, entry["complete"])
    for relative in sorted(candidates, key=MemorySnapshot.parse, reverse=True):
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
