"""Healing replicated state from a live peer, in-process: the ranks of a re-formed round agree on
the newest step any of them holds in memory, and each rank that lacks it receives the state from
a rank that holds it, point to point over the round's process group (what torchft does for a
replica group that restarted).

Only replicated state heals this way (DDP's parameters, its optimizer, counters): every rank that
holds step S holds the same values. Sharded state (DTensor, ShardedTensor) is refused before any
collective; it restores through :meth:`agent.Checkpointer.restore`, resharded to the new world.

A peer is data, never code: the structure of the state goes as JSON (containers, numbers,
strings, and tensors by dtype and shape, both checked), never as a pickle.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from agent.checkpoint.stage import read_state_dicts
from agent.errors import RestoreError

_TENSOR, _DICT, _TUPLE = "__tensor__", "__dict__", "__tuple__"


@dataclass(frozen=True)
class Healed:
    """The step every rank now holds, the rank this rank received it from (None: it held that step
    already), and the bytes it received."""

    step: int
    source: int | None
    bytes: int
    seconds: float


def heal(app_state: Mapping[str, Any], held_step: int | None) -> Healed | None:
    """Give every rank of the default process group the newest state a rank holds in memory
    (``held_step``: the step of this rank's ``app_state``, None when it holds none). Returns None
    when no rank holds any (restore from a snapshot then); collective: every rank calls it."""
    started = time.perf_counter()
    state_dicts = read_state_dicts(app_state)
    _refuse_sharded(state_dicts)
    device = _device()
    mine = torch.tensor([-1 if held_step is None else held_step], dtype=torch.int64, device=device)
    steps = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(steps, mine)
    held = [int(s.item()) for s in steps]
    newest = max(held)
    if newest < 0:
        return None
    holders = [rank for rank, step in enumerate(held) if step == newest]
    lacking = [rank for rank, step in enumerate(held) if step != newest]
    if not lacking:
        return Healed(step=newest, source=None, bytes=0, seconds=time.perf_counter() - started)
    # Each rank that lacks the step gets it from one holder, the holders taking turns: a new node's
    # ranks are served in parallel, and a rank that holds the step receives nothing.
    source_of = {rank: holders[i % len(holders)] for i, rank in enumerate(lacking)}
    me = dist.get_rank()
    if me in source_of:
        received = _receive_state(app_state, source_of[me], device)
        return Healed(step=newest, source=source_of[me], bytes=received, seconds=time.perf_counter() - started)
    for rank in (r for r, source in source_of.items() if source == me):
        _send_state(state_dicts, rank, device)
    return Healed(step=newest, source=None, bytes=0, seconds=time.perf_counter() - started)


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


def _send_state(state_dicts: dict[str, Any], to: int, device: torch.device) -> None:
    """Send this rank's state dicts to rank ``to``: their structure as JSON, then each tensor."""
    tensors: list[torch.Tensor] = []
    layout = json.dumps(_encode(state_dicts, tensors)).encode()
    dist.send(torch.tensor([len(layout)], dtype=torch.int64, device=device), dst=to)
    dist.send(torch.frombuffer(bytearray(layout), dtype=torch.uint8).to(device), dst=to)
    for tensor in tensors:
        dist.send(tensor.detach().to(device).contiguous(), dst=to)


def _receive_state(app_state: Mapping[str, Any], source: int, device: torch.device) -> int:
    """Receive ``source``'s state dicts and load them; the bytes received."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=source)
    buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(buffer, src=source)
    tensors: list[torch.Tensor] = []
    try:
        decoded = _decode(json.loads(bytes(buffer.cpu().numpy())), tensors, device)
    except (ValueError, TypeError, KeyError) as exc:
        raise RestoreError(f"the state rank {source} sent to heal this rank is malformed: {exc}") from exc
    for tensor in tensors:
        dist.recv(tensor, src=source)
    if not isinstance(decoded, dict) or set(decoded) != set(app_state):
        raise RestoreError(f"rank {source} sent state for {sorted(decoded) if isinstance(decoded, dict) else decoded!r}, "
                           f"this rank's app_state has {sorted(app_state)}: every rank must pass the same keys")
    for key, state in decoded.items():
        app_state[key].load_state_dict(state)
    return sum(t.numel() * t.element_size() for t in tensors)


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_TENSOR: [str(value.dtype).removeprefix("torch."), list(value.shape)]}
    if isinstance(value, Mapping):
        return {_DICT: [[_key(k), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if _is_scalar(value):
        return value
    raise RestoreError(f"a state dict holds a {type(value).__name__}: healing from a peer sends containers, "
                       "numbers, strings and tensors only")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


def _key(key: Any) -> Any:
    if _is_scalar(key):
        return key
    raise RestoreError(f"a state dict key {key!r} is a {type(key).__name__}: healing sends scalar keys only")


def _decode(value: Any, tensors: list[torch.Tensor], device: torch.device) -> Any:
    if isinstance(value, list):
        return [_decode(v, tensors, device) for v in value]
    if not isinstance(value, dict):
        if _is_scalar(value):
            return value
        raise TypeError(f"unexpected {type(value).__name__}")
    (kind, body), = value.items()
    if kind == _DICT:
        return {_received_key(k): _decode(v, tensors, device) for k, v in body}
    if kind == _TUPLE:
        return tuple(_decode(v, tensors, device) for v in body)
    if kind == _TENSOR:
        dtype_name, shape = body
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"a tensor of dtype {dtype_name!r} and shape {shape!r}")
        tensors.append(torch.empty(shape, dtype=dtype, device=device))
        return tensors[-1]
    raise ValueError(f"unknown entry {kind!r}")


def _received_key(key: Any) -> Any:
    if _is_scalar(key):
        return key
    raise TypeError(f"a key {key!r}")


def _refuse_sharded(state_dicts: Any) -> None:
    from torch.distributed.tensor import DTensor

    stack = [state_dicts]
    while stack:
        value = stack.pop()
        if isinstance(value, DTensor) or type(value).__name__ == "ShardedTensor":
            raise RestoreError("heal() moves replicated state only; this app_state holds sharded tensors (FSDP2, "
                               "tensor parallel): restore them with Checkpointer.restore instead")
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
