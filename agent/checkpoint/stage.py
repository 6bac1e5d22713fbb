"""Stage: copy a rank's state into buffers allocated once and reused, so that the training thread
pays only for a memory copy and the write runs in the background from the copy.

CPU tensors are copied into host buffers, page-aligned from 4 MB on (a write that bypasses the page
cache takes them without a bounce, :mod:`agent.checkpoint.direct_write`), by a small thread pool
(``Tensor.copy_`` releases the GIL); CUDA tensors into pinned host buffers with non-blocking
copies on a side stream that first waits for the current stream, and the stager waits for that
stream once before returning. A buffer is reused while the tensor at its logical path keeps its
shape and dtype; anything else is reallocated. The walk follows torchsnapshot's own flattening
(its private helpers, pinned with the version ``compat`` checks), so the manifest is a direct
save's; other leaves (step counters, objects torchsnapshot pickles whole) are deep-copied.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor
from torchsnapshot.flatten import _encode, _should_flatten_dict
from torchsnapshot.rng_state import RNGState

from agent.checkpoint.direct_write import aligned
from agent.checkpoint.write import SLAB_THRESHOLD_BYTES


class FixedState:
    """A stateful whose ``state_dict`` was read already: a staged copy (what torchsnapshot writes
    in the background) or the live state dict of a synchronous save. It keeps the container types
    of the original, so the manifest is the same as a direct save's."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state

    def load_state_dict(self, state_dict: Any) -> None:
        raise TypeError("a state read for a save is written, never restored into")


def read_state_dicts(app_state: Mapping[str, Any]) -> dict[str, Any]:
    """Every stateful's ``state_dict()``, read once per save, the way torchsnapshot's take reads
    them: an RNGState first, and put back afterwards (reading the others must not move the RNG
    state that is saved), then the others in sorted key order, the same on every rank (a
    ``state_dict`` may run collectives)."""
    rng_keys = [key for key, obj in app_state.items() if isinstance(obj, RNGState)]
    read = {key: app_state[key].state_dict() for key in rng_keys}
    for key in sorted(set(app_state) - set(rng_keys)):
        read[key] = app_state[key].state_dict()
    for key in rng_keys:
        app_state[key].load_state_dict(read[key])
    return {key: read[key] for key in app_state}


class Stager:
    """Copies ``app_state`` into reused staging buffers.

    Args:
        threads: copies run in parallel on this many threads.
    """

    def __init__(self, *, threads: int = 2) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="torchrevive-stage")
        self._stream: Any = None

    @property
    def staged_bytes(self) -> int:
        """Host memory the staging buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def stage(self, state_dicts: Mapping[str, Any]) -> dict[str, FixedState]:
        """A staged copy of every state dict (see :func:`read_state_dicts`), complete when this
        returns."""
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        staged = {key: FixedState(self._walk(state, key, copies)) for key, state in state_dicts.items()}
        self._copy_all(copies)
        return staged

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _walk(self, value: Any, path: str, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """The staged twin of ``value``: the containers torchsnapshot flattens are rebuilt, their
        tensors mapped to buffers; any other leaf is copied whole."""
        if isinstance(value, DTensor):
            local = self._buffer(path, value.to_local(), copies)
            # The same spec (mesh, placements, global shape) around the staged local shard.
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor) and not isinstance(value, ShardedTensor):
            return self._buffer(path, value, copies)
        if type(value) is list:
            return [self._walk(v, f"{path}/{i}", copies) for i, v in enumerate(value)]
        if type(value) in (dict, OrderedDict) and _should_flatten_dict(value):
            return type(value)((k, self._walk(v, f"{path}/{_encode(str(k))}", copies)) for k, v in value.items())
        return copy.deepcopy(value)  # a ShardedTensor or an object torchsnapshot pickles whole

    def _buffer(self, path: str, tensor: torch.Tensor, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The staging buffer for ``tensor`` (reused when shape and dtype still fit)."""
        tensor = tensor.detach()
        buffer = self._buffers.get(path)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = _host_buffer(tensor)
            self._buffers[path] = buffer
        copies.append((buffer, tensor))
        return buffer

    def _copy_all(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        cuda = [(b, t) for b, t in copies if t.is_cuda]
        host = [(b, t) for b, t in copies if not t.is_cuda]
        if cuda:
            self._copy_from_cuda(cuda)
        # Largest first, so that the threads finish together.
        host.sort(key=lambda pair: pair[1].numel() * pair[1].element_size(), reverse=True)
        for future in [self._pool.submit(_copy, b, t) for b, t in host]:
            future.result()

    def _copy_from_cuda(self, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Device-to-host copies on a side stream, ordered after the work queued so far."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for buffer, tensor in copies:
                buffer.copy_(tensor, non_blocking=True)
        self._stream.synchronize()


def _host_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """An empty host tensor like ``tensor``: pinned for a CUDA tensor; page-aligned for a CPU
    tensor that torchsnapshot writes from its own buffer (from its slab threshold on: smaller ones
    are copied into shared files)."""
    nbytes = tensor.numel() * tensor.element_size()
    if tensor.is_cuda or nbytes < SLAB_THRESHOLD_BYTES:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    return torch.frombuffer(aligned(nbytes), dtype=torch.uint8).view(tensor.dtype).view(tensor.shape)


def _copy(buffer: torch.Tensor, tensor: torch.Tensor) -> None:
    buffer.copy_(tensor)
