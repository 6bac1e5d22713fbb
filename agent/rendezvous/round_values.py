"""What the agents of a round tell each other through the rendezvous store, read back as data from
the network: whoever can write the store (anyone who reaches c10d's unauthenticated TCPStore, or
holds etcd write access) must not steer an agent to a path or a peer of its choosing.

* The snapshot to restore is a name (``step_<N>``) that each agent resolves under its own
  ``checkpoint.dir``, or a memory snapshot (``r<round>/step_<N>``) under its own memory directory;
  nothing that resolves elsewhere (``..``, an absolute path, a symlink out) is accepted.
* The workers' store is ``host port``: a host name or address and a port, nothing else.
* A value a round's agents have not written yet is waited for, unless the round moved on without
  this node meanwhile (the next round deletes the old round's keys, :mod:`agent.rendezvous.round_keys`)
  or one of its participants died: nobody is left to write it.

Each refusal is one RendezvousStateError naming the key, the value and what to do.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from agent.checkpoint.dirs import step_of
from agent.memory.tier import MemoryChoice

MEMORY_CHOICE = "memory:"
"""A restore choice starts so when the round restores a memory snapshot."""
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})")
_FIRST_POLL_S, _MAX_POLL_S = 0.01, 0.5


class RoundLeftBehind(RendezvousStateError):
    """The round moved on without this node while it waited for a value of the old round: rejoin."""


def _refused(key: str, value: str, problem: str, fix: str) -> RendezvousStateError:
    return RendezvousStateError(f"the rendezvous store's {key} is {value[:200]!r}: {problem}. It is written only by "
                                f"the round's leader agent: {fix}")


def snapshot_name(key: str, value: str) -> str:
    """``value`` when it names a storage snapshot (``step_<N>``, nothing more)."""
    if step_of(Path(value)) is None or Path(value).name != value:
        raise _refused(key, value, "not the name of a snapshot (step_<N>)",
                       "check what else writes to the job's rendezvous store")
    return value


def chosen_memory_snapshot(key: str, value: str) -> MemoryChoice:
    """The memory snapshot choice ``value`` (with its :data:`MEMORY_CHOICE` prefix) holds."""
    try:
        return MemoryChoice.from_json(value.removeprefix(MEMORY_CHOICE))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _refused(key, value, f"not a memory snapshot choice ({exc})",
                       "check what else writes to the job's rendezvous store") from exc


def storage_choice(key: str, value: str, checkpoint_dir: str | None) -> Path | None:
    """The storage snapshot a round's leader chose (``step_<N>``, or "" for none) under this
    node's ``checkpoint_dir``: ``checkpoint_dir/step_<N>``, resolving inside it."""
    if not value:
        return None
    snapshot_name(key, value)
    if not checkpoint_dir:
        raise _refused(key, value, "the round restores from storage, and this node has no checkpoint.dir",
                       "give every node the same checkpoint.dir")
    root = Path(checkpoint_dir)
    path = root / value
    if path.resolve().parent != root.resolve():
        raise _refused(key, value, f"{path} resolves to {path.resolve()}, outside checkpoint.dir {root.resolve()}",
                       "replace the symlink by the snapshot itself")
    return path


def memory_choice(key: str, value: str, memory_root: Path | None) -> tuple[MemoryChoice, Path]:
    """The memory snapshot a round's leader chose (``value`` less :data:`MEMORY_CHOICE`) and where
    it lies under this node's ``memory_root``."""
    if memory_root is None:
        raise _refused(key, value, "the round restores a memory snapshot, and this node has no memory tier",
                       "give every node the same checkpoint.memory_interval_steps")
    choice = chosen_memory_snapshot(key, value)
    local = memory_root / choice.snapshot.relative
    if not local.resolve().is_relative_to(memory_root.resolve()):
        raise _refused(key, value, f"{local} resolves to {local.resolve()}, outside the memory directory "
                                   f"{memory_root.resolve()}", "remove the symlink from the memory directory")
    return choice, local


def worker_store_address(key: str, value: str) -> tuple[str, int]:
    """The workers' store (``host port``) a round's leader serves."""
    host, _, port = value.partition(" ")
    if not (_valid_host(host) and port.isdigit() and 0 < int(port) < 65536):
        raise _refused(key, value, "not 'HOST PORT' (a host name or address, and a port from 1 to 65535)",
                       "check what else writes to the job's rendezvous store")
    return host, int(port)


def _valid_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return _HOST_NAME.fullmatch(host) is not None and ".." not in host


def wait_for_value(store: Any, key: str, broken: Callable[[], str | None]) -> str:
    """``key``'s value in a round's ``store``, once the round's leader has set it: see
    :func:`wait_for_keys`."""
    wait_for_keys(store, [key], broken)
    return store.get(key).decode()


def wait_for_keys(store: Any, keys: list[str], broken: Callable[[], str | None]) -> None:
    """Return once the round's agents have set every one of ``keys`` in its ``store`` (within the
    store's timeout). RoundLeftBehind as soon as ``broken()`` says why they never will: the round
    moved on without this node (the next round may have deleted them), or a participant died after
    the round completed. Polls with ``check``: a blocking ``get`` would wait out the store's whole
    timeout (60 s) for a key nobody is left to write."""
    deadline = time.monotonic() + store.timeout.total_seconds()
    delay = _FIRST_POLL_S
    while not store.check(keys):
        reason = broken() if delay >= _MAX_POLL_S else None
        if reason is not None:
            raise RoundLeftBehind(f"{reason}: this node stops waiting for {_missing(store, keys)} and joins the "
                                  "next round")
        if time.monotonic() > deadline:
            raise dist.DistStoreError(f"{_missing(store, keys)} not set in the rendezvous store within "
                                      f"{store.timeout.total_seconds():.0f} s")
        time.sleep(delay)
        delay = min(_MAX_POLL_S, delay * 2)


def _missing(store: Any, keys: list[str]) -> str:
    """The keys of ``keys`` not set in ``store`` (all of them, if every one was set meanwhile)."""
    return ", ".join([key for key in keys if not store.check([key])] or keys)
