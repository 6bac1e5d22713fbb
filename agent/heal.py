"""Healing replicated state from a live peer, in-process: the ranks of a re-formed round agree on
the newest step any of them holds in memory, and each rank that lacks it receives the state from
a rank that holds it, point to point over the round's process group (what torchft does for a
replica group that restarted).

Only replicated state heals this way (DDP's parameters, its optimizer, counters): every rank that
holds step S holds the same values. Sharded state (DTensor, ShardedTensor) is refused before any
collective: :mod:`agent.heal_sharded` re-lays FSDP2's shards (with this module's wire format),
and the rest restores through :meth:`agent.Checkpointer.restore`, resharded to the new world.

A peer is data, never code: the structure of the state goes as JSON (containers, numbers,
strings, and tensors by dtype and shape, both checked), never as a pickle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent.checkpoint.stage import read_state_dicts
from agent.errors import RestoreError

_TENSOR, _SHARDED, _DICT, _TUPLE = "__tensor__", "__sharded__", "__dict__", "__tuple__"


@dataclass(frozen=True)
class Healed:
    """The step every rank now holds, the ranks this rank received it from (empty: it held that
    step already), and the bytes it received."""

    step: int
    sources: tuple[int, ...]
    bytes: int
    seconds: float


SPLIT_BYTES = 1 << 20
"""A tensor at least this large comes in parts, one from each rank that holds it; a smaller one
whole, from one of them."""


def heal(app_state: Mapping[str, Any], held_step: int | None) -> Healed | None:
    """Give every rank of the default process group the newest state a rank holds in memory
    (``held_step``: the step of this rank's ``app_state``, None when it holds none). Returns None
    when no rank holds any (restore from a snapshot then); collective: every rank calls it.

    Every rank that holds the newest step sends each rank that lacks it an equal part of the state,
    all parts in flight at once: a new node's rank receives from all the survivors in parallel."""
    started = time.perf_counter()
    state_dicts = read_state_dicts(app_state)
    _refuse_sharded(state_dicts)
    device = device_of_backend()
    mine = torch.tensor([-1 if held_step is None else held_step], dtype=torch.int64, device=device)
    steps = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, mine)
    held = [int(s.item()) for s in steps]
    newest = max(held)
    if newest < 0:
        return None
    holders = [rank for rank, step in enumerate(held) if step == newest]
    lacking = [rank for rank, step in enumerate(held) if step != newest]
    me = dist.get_rank()
    if me in lacking:
        decoded, received = receive_state(app_state.keys(), holders, device)
        for key, state in decoded.items():
            app_state[key].load_state_dict(state)
        return Healed(step=newest, sources=tuple(holders), bytes=received, seconds=time.perf_counter() - started)
    if lacking:
        send_state(state_dicts, lacking, holders.index(me), len(holders), device)
    return Healed(step=newest, sources=(), bytes=0, seconds=time.perf_counter() - started)


def carry_over(previous: Mapping[str, Any], app_state: Mapping[str, Any]) -> None:
    """Give each object of ``app_state`` built anew for this round the state of the object under
    its key in the previous round (a module that wraps the same parameters, as a new DDP around
    the kept model does, holds that state already)."""
    for key, obj in app_state.items():
        before = previous.get(key)
        if before is None or before is obj or _same_parameters(before, obj):
            continue
        obj.load_state_dict(before.state_dict())


def _same_parameters(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.nn.Module) and isinstance(b, torch.nn.Module)):
        return False
    return [id(p) for p in a.parameters()] == [id(p) for p in b.parameters()]


def _parts(tensors: list[torch.Tensor], holders: int) -> list[list[tuple[int, torch.Tensor]]]:
    """Each holder's share of ``tensors`` (contiguous): (message tag, flat view) pairs. A tensor of
    :data:`SPLIT_BYTES` or more is cut into one range per holder; a smaller one goes whole, the
    holders taking turns. Sender and receiver compute the same shares from the same layout."""
    shares: list[list[tuple[int, torch.Tensor]]] = [[] for _ in range(holders)]
    tag, small = 0, 0
    for tensor in tensors:
        flat = tensor.view(-1)
        if tensor.numel() * tensor.element_size() < SPLIT_BYTES:
            shares[small % holders].append((tag, flat))
            small, tag = small + 1, tag + 1
            continue
        for holder, part in enumerate(flat.tensor_split(holders)):
            shares[holder].append((tag, part))
            tag += 1
    return shares


def send_state(state_dicts: dict[str, Any], to: list[int], holder: int, holders: int, device: torch.device,
               sharded: list[Any] | None = None) -> None:
    """Send this holder's share of its state dicts (their structure as JSON first) to each rank of
    ``to``, every message in flight at once; with ``sharded``, its DTensors go by dtype and global
    shape only, and are appended there."""
    tensors: list[torch.Tensor] = []
    layout = json.dumps(encode(state_dicts, tensors, sharded)).encode()
    size = torch.tensor([len(layout)], dtype=torch.int64, device=device)
    layout_bytes = torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(device)
    share = _parts([t.detach().to(device).contiguous() for t in tensors], holders)[holder]
    for rank in to:
        dist.send(size, dst=rank)
        dist.send(layout_bytes, dst=rank)
    run_all([dist.P2POp(dist.isend, part, rank, tag=_FIRST_PART_TAG + tag) for rank in to for tag, part in share])


def receive_state(keys: Collection[str], holders: list[int], device: torch.device,
                  sharded: list[ShardedEntry] | None = None) -> tuple[dict[str, Any], int]:
    """Receive the state dicts of ``keys``, a share from each of ``holders``; them, and the bytes
    received. Every holder sends its layout, and all must be the same; with ``sharded``, the
    DTensors in it are :class:`ShardedEntry` there, appended to ``sharded``."""
    layouts = [_receive_layout(source, device) for source in holders]
    try:
        parsed = [json.loads(layout) for layout in layouts]
    except ValueError as exc:
        raise RestoreError(f"a layout ranks {holders} sent to heal this rank is not JSON: {exc}") from exc
    # Scalars may differ (a rank that began its next step set that step's learning rate); the
    # tensors, which come in parts from each holder, must line up.
    for source, layout in zip(holders[1:], parsed[1:]):
        if _tensor_specs(layout) != _tensor_specs(parsed[0]):
            raise RestoreError(f"ranks {holders[0]} and {source} hold the same step but their states hold different "
                               "tensors (names, dtypes or shapes): every rank must build the same model and optimizer")
    tensors: list[torch.Tensor] = []
    try:
        decoded = _decode(parsed[0], tensors, device, sharded)
    except (ValueError, TypeError, KeyError) as exc:
        raise RestoreError(f"the state rank {holders[0]} sent to heal this rank is malformed: {exc}") from exc
    if not isinstance(decoded, dict) or set(decoded) != set(keys):
        raise RestoreError(f"rank {holders[0]} sent state for "
                           f"{sorted(decoded) if isinstance(decoded, dict) else decoded!r}, "
                           f"this rank's app_state has {sorted(keys)}: every rank must pass the same keys")
    shares = _parts(tensors, len(holders))
    run_all([dist.P2POp(dist.irecv, part, source, tag=_FIRST_PART_TAG + tag)
             for source, share in zip(holders, shares) for tag, part in share])
    return decoded, sum(t.numel() * t.element_size() for t in tensors)


_FIRST_PART_TAG = 1
"""The tag of a state's first part (0 is the layout's); part n goes with tag n + 1."""


def _receive_layout(source: int, device: torch.device) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=source)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buffer, src=source)
    return bytes(buffer.cpu().numpy())


def run_all(operations: list[dist.P2POp]) -> None:
    """Put every one of ``operations`` in flight at once (one batch, as NCCL needs), and wait for them."""
    if operations:
        for work in dist.batch_isend_irecv(operations):
            work.wait()


def encode(value: Any, tensors: list[torch.Tensor], sharded: list[Any] | None = None) -> Any:
    """``value``'s structure as JSON-ready data; its tensors are appended to ``tensors`` and, where
    ``sharded`` is given, its DTensors to ``sharded`` (by dtype and global shape), in order."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor) and sharded is not None:
        sharded.append(value)
        return {_SHARDED: [str(value.dtype).removeprefix("torch."), list(value.shape)]}
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape)]}
    if isinstance(value, Mapping):
        return {_DICT: [[_key(k), encode(v, tensors, sharded)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [encode(v, tensors, sharded) for v in value]}
    if isinstance(value, list):
        return [encode(v, tensors, sharded) for v in value]
    if _is_scalar(value):
        return value
    raise RestoreError(f"a state dict holds a {type(value).__name__}: healing from a peer sends containers, "
                       "numbers, strings and tensors only")


def _tensor_specs(layout: Any, path: str = "") -> list[Any]:
    """Where a parsed layout holds tensors: each one's path, kind, dtype and shape, in order."""
    if isinstance(layout, list):
        return [spec for i, value in enumerate(layout) for spec in _tensor_specs(value, f"{path}/{i}")]
    if not isinstance(layout, dict) or len(layout) != 1:
        return []
    (kind, body), = layout.items()
    if kind in (_TENSOR, _SHARDED):
        return [(path, kind, body)]
    if kind == _DICT and isinstance(body, list):
        return [spec for entry in body if isinstance(entry, list) and len(entry) == 2
                for spec in _tensor_specs(entry[1], f"{path}/{entry[0]}")]
    return _tensor_specs(body, path) if kind == _TUPLE else []


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _key(key: Any) -> Any:
    if _is_scalar(key):
        return key
    raise RestoreError(f"a state dict key {key!r} is a {type(key).__name__}: healing sends scalar keys only")


@dataclass(frozen=True)
class ShardedEntry:
    """Where a peer's state holds a DTensor: its dtype and global shape."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def _decode(value: Any, tensors: list[torch.Tensor], device: torch.device, sharded: list[ShardedEntry] | None) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, device, sharded) for v in value]
    if not isinstance(value, dict):
        if _is_scalar(value):
            return value
        raise TypeError(f"unexpected {type(value).__name__}")
    (kind, body), = value.items()
    if kind == _DICT:
        return {_received_key(k): _decode(v, tensors, device, sharded) for k, v in body}
    if kind == _TUPLE:
        return tuple(_decode(v, tensors, device, sharded) for v in body)
    if kind in (_TENSOR, _SHARDED):
        dtype_name, shape = body
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"a tensor of dtype {dtype_name!r} and shape {shape!r}")
        if kind == _TENSOR:
            tensors.append(torch.empty(shape, dtype=dtype, device=device))
            return tensors[-1]
        if sharded is None or not shape:
            raise ValueError(f"a sharded tensor of shape {shape!r} where none is expected")
        sharded.append(ShardedEntry(dtype, tuple(shape)))
        return sharded[-1]
    raise ValueError(f"unknown entry {kind!r}")


def _received_key(key: Any) -> Any:
    if _is_scalar(key):
        return key
    raise TypeError(f"a key {key!r}")


def leaves(value: Any) -> Iterator[Any]:
    """What ``value``'s containers (mappings, lists, tuples) hold, in the order :func:`encode`
    meets it."""
    if isinstance(value, Mapping):
        for item in value.values():
            yield from leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from leaves(item)
    else:
        yield value


def _refuse_sharded(state_dicts: Any) -> None:
    from torch.distributed.tensor import DTensor

    if any(isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor" for value in leaves(state_dicts)):
        raise RestoreError("heal() moves replicated state only; this app_state holds sharded tensors (FSDP2, "
                           "tensor parallel): heal them with agent.heal_sharded (Round.heal does) or restore "
                           "them with Checkpointer.restore")


def device_of_backend() -> torch.device:
    """Where the default process group's tensors live: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
