"""FastStorageReader: torch.distributed.checkpoint (DCP) checkpoints read at storage speed.

DCP's FileSystemWriter stores each tensor item as a ``torch.save`` archive (an uncompressed zip)
at an offset of a ``.distcp`` file, and its FileSystemReader reads the items one at a time, from
one stream, ``torch.load``s each and copies it again. This reader maps each file once, finds the
raw storage bytes inside each item's archive (the zip's directory and the small ``data.pkl``
give the entry's position, dtype, storage offset and strides; nothing is unpickled beyond those
names), and copies exactly the requested slice into the destination with a thread pool. DCP's
planners still decide what goes where, so resharding (N -> M, DTensor) works as with DCP's own
reader. Items it does not know how to read directly (a storage transform such as compression) go
through FileSystemReader's code, with a debug log.

    dcp.load(state_dict, storage_reader=agent.FastStorageReader(path))
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
import warnings
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from agent.errors import RestoreError
from agent.restore.reader import SnapshotFiles, default_io_threads, release_pages

logger = logging.getLogger(__name__)
_LOCAL_HEADER = 30
DCP_METADATA = ".metadata"


def is_dcp_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory written by DCP's FileSystemWriter."""
    return (path / DCP_METADATA).is_file()


@dataclass(frozen=True)
class _RawTensor:
    """Where a saved tensor's elements lie in its file."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    byte_offset: int
    """of element 0 (the tensor's storage offset applied)"""
    numel_span: int
    """elements from element 0 to the last one the tensor uses, plus one"""


class FastStorageReader(FileSystemReader):
    """A DCP StorageReader for FileSystemWriter checkpoints: mmap, parallel, no intermediate copies."""

    def __init__(self, path: str | Path, *, io_threads: int | None = None) -> None:
        super().__init__(path)
        self.io_threads = io_threads or default_io_threads()
        self.bytes_read = 0
        self.tensors_read = 0
        self._located: dict[Any, _RawTensor] = {}
        self._lock = threading.Lock()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        fast, fallback = [], []
        for item in plan.items:
            (fallback if self.storage_data[item.storage_index].transform_descriptors else fast).append(item)
        if fallback:
            logger.debug("%d DCP items have storage transforms; FileSystemReader reads them", len(fallback))
            super().read_data(LoadPlan(fallback), planner).wait()
        files = SnapshotFiles(Path(self.path))
        try:
            for item in fast:
                if item.type == LoadItemType.BYTE_IO:
                    info = self.storage_data[item.storage_index]
                    mapping = files.mapping(info.relative_path)
                    planner.load_bytes(item, io.BytesIO(mapping[info.offset : info.offset + info.length]))
            tensors = [item for item in fast if item.type != LoadItemType.BYTE_IO]
            targets = [planner.resolve_tensor(item).detach() for item in tensors]  # planners are not thread-safe
            copy: Callable[[tuple[ReadItem, torch.Tensor]], int] = lambda job: self._copy(files, *job)
            with ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="torchrevive-dcp") as pool:
                self.bytes_read += sum(pool.map(copy, zip(tensors, targets)))
            self.tensors_read += len(tensors)
            for item, target in zip(tensors, targets):
                planner.commit_tensor(item, target)
        finally:
            files.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _copy(self, files: SnapshotFiles, item: ReadItem, target: torch.Tensor) -> int:
        raw = self._locate(files, item)
        mapping = files.mapping(self.storage_data[item.storage_index].relative_path)
        whole = torch.frombuffer(mapping, dtype=raw.dtype, count=raw.numel_span, offset=raw.byte_offset)
        source = whole.as_strided(raw.shape, raw.stride)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            source = source.narrow(dim, start, length)
        if target.shape != source.shape:
            raise RestoreError(f"{self.path}: {item.storage_index.fqn}: the plan asks {list(source.shape)} "
                               f"elements for a destination of {list(target.shape)}")
        target.copy_(source)
        nbytes = source.numel() * source.element_size()
        del whole, source
        release_pages(mapping, raw.byte_offset, raw.byte_offset + raw.numel_span * raw.dtype.itemsize)
        return nbytes

    def _locate(self, files: SnapshotFiles, item: ReadItem) -> _RawTensor:
        key = item.storage_index
        with self._lock:
            if key not in self._located:
                info = self.storage_data[key]
                self._located[key] = locate_saved_tensor(files.mapping(info.relative_path), info.offset, info.length,
                                                         where=f"{Path(self.path) / info.relative_path} ({key.fqn})")
            return self._located[key]


def locate_saved_tensor(buffer: Any, offset: int, length: int, *, where: str) -> _RawTensor:
    """Find the tensor saved by ``torch.save`` in ``buffer[offset : offset + length]``."""
    small = length < (1 << 16)  # read whole; a large item is windowed so that its data is never copied
    try:
        with (io.BytesIO(buffer[offset : offset + length]) if small else _Window(buffer, offset, length)) as window, \
                zipfile.ZipFile(window) as archive:
            names = archive.namelist()
            pickled = next(n for n in names if n.endswith("/data.pkl"))
            rebuilt = _TensorRecipe.from_pickle(archive.read(pickled))
            entry = archive.getinfo(f"{pickled.removesuffix('data.pkl')}data/{rebuilt.storage_key}")
    except (zipfile.BadZipFile, StopIteration, KeyError, pickle.UnpicklingError) as exc:
        raise RestoreError(f"{where}: not a torch.save tensor archive this reader understands ({exc})") from exc
    if entry.compress_type != zipfile.ZIP_STORED:
        raise RestoreError(f"{where}: the tensor's bytes are compressed in the archive")
    header = buffer[offset + entry.header_offset : offset + entry.header_offset + _LOCAL_HEADER]
    data_start = entry.header_offset + _LOCAL_HEADER + int.from_bytes(header[26:28], "little") + \
        int.from_bytes(header[28:30], "little")
    itemsize = rebuilt.dtype.itemsize
    span = 1 + sum((size - 1) * stride for size, stride in zip(rebuilt.shape, rebuilt.stride)) if all(rebuilt.shape) else 0
    if (rebuilt.storage_offset + span) * itemsize > entry.file_size:
        raise RestoreError(f"{where}: the archive's storage is shorter than its tensor")
    return _RawTensor(rebuilt.dtype, rebuilt.shape, rebuilt.stride,
                      offset + data_start + rebuilt.storage_offset * itemsize, span)


@dataclass
class _TensorRecipe:
    """What ``data.pkl`` says: which storage, its dtype, and the view of it."""

    storage_key: str
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def from_pickle(cls, payload: bytes) -> _TensorRecipe:
        unpickler = _RecipeUnpickler(io.BytesIO(payload))
        recipe = unpickler.load()
        if not isinstance(recipe, cls):
            raise pickle.UnpicklingError("the archive does not hold a single tensor")
        return recipe


class _RecipeUnpickler(pickle.Unpickler):
    """Reads a tensor's ``data.pkl`` into a _TensorRecipe; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _recipe
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):  # the dtype is an argument (float8, ...)
            return _recipe_v3
        if module == "collections" and name == "OrderedDict":
            from collections import OrderedDict

            return OrderedDict
        if module in ("torch", "torch.storage") and (name.endswith("Storage") or name in _DTYPE_NAMES):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a tensor archive")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype | None]:
        kind, storage_type, key, _location, _numel = pid
        if kind != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id {kind!r}")
        with warnings.catch_warnings():  # typed storage classes warn that they are deprecated
            warnings.simplefilter("ignore")
            dtype = storage_type if isinstance(storage_type, torch.dtype) else getattr(storage_type, "dtype", None)
        return key, dtype


_DTYPE_NAMES = {str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _recipe(storage: tuple[str, torch.dtype], storage_offset: int, size: Any, stride: Any, *_: Any) -> _TensorRecipe:
    key, dtype = storage
    return _TensorRecipe(str(key), dtype, int(storage_offset), tuple(size), tuple(stride))


def _recipe_v3(storage: tuple[str, Any], storage_offset: int, size: Any, stride: Any, _requires_grad: Any,
               _hooks: Any, dtype: torch.dtype, *_: Any) -> _TensorRecipe:
    return _TensorRecipe(str(storage[0]), dtype, int(storage_offset), tuple(size), tuple(stride))


class _Window(io.RawIOBase):
    """A read-only, seekable file over ``buffer[start : start + length]`` (no copy of the middle)."""

    def __init__(self, buffer: Any, start: int, length: int) -> None:
        self._view = memoryview(buffer)[start : start + length]
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, out: Any) -> int:
        chunk = self._view[self._pos : self._pos + len(out)]
        out[: len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)

    def close(self) -> None:
        self._view.release()
        super().close()
