"""FastStorageReader: torch.distributed.checkpoint (DCP) checkpoints read at storage speed.

DCP's FileSystemWriter stores each tensor item as a ``torch.save`` archive (an uncompressed zip)
at an offset of a ``.distcp`` file, and its FileSystemReader reads the items one at a time, from
one stream, ``torch.load``s each and copies it again. This reader maps each file once, finds the
raw storage bytes inside each item's archive (the zip's directory and the small ``data.pkl``
give the entry's position, dtype, storage offset and strides; nothing is unpickled beyond those
names), and copies exactly the requested slice into the destination with a thread pool. DCP's
planners still decide what goes where, so resharding (N -> M, DTensor) works as with DCP's own
reader. Tensor items it does not know how to read directly (a storage transform such as
compression) go through FileSystemReader's code, with a debug log.

The checkpoint is data: its metadata and byte items load as :mod:`agent.restore.pickles` says
unless ``trust_pickles``, the files it names must lie inside it, and every size and offset read
from it is checked against the file before a byte is copied.

    dcp.load(state_dict, storage_reader=agent.FastStorageReader(path))
"""

from __future__ import annotations

import io
import logging
import mmap
import pickle
import threading
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.futures import Future

from agent.errors import RestoreError
from agent.restore.locations import check_locations
from agent.restore.pickles import TORCH_DTYPES, load_dcp_metadata, load_object
from agent.restore.reader import SnapshotFiles, StorageReadError, default_io_threads, release_pages

logger = logging.getLogger(__name__)
_LOCAL_HEADER = 30
_LOCAL_HEADER_SIGNATURE = b"PK\x03\x04"
MAX_RECIPE_BYTES = 1 << 16
"""A tensor's ``data.pkl`` is a few hundred bytes; a larger one is refused unread."""
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
    """A DCP StorageReader for FileSystemWriter checkpoints: mmap, parallel, no intermediate copies.

    Unless ``trust_pickles``, the metadata loads through an unpickler that knows only DCP's
    metadata classes, and byte items with ``weights_only`` semantics; anything else raises
    RestoreError naming the file, the key and the opt-in.
    """

    def __init__(self, path: str | Path, *, io_threads: int | None = None, trust_pickles: bool = False) -> None:
        super().__init__(path)
        self.io_threads = io_threads or default_io_threads()
        self.trust_pickles = trust_pickles
        self.bytes_read = 0
        self.tensors_read = 0
        self._metadata: dict[Path, Metadata] = {}
        self._located: dict[Any, _RawTensor] = {}
        self._lock = threading.Lock()

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        if path not in self._metadata:  # read once: agent.restore reads it before dcp.load, for a clear error
            metadata = load_dcp_metadata(path, trust_pickles=self.trust_pickles)
            _check_storage_data(Path(self.path), metadata.storage_data, named_in=path)
            self._metadata[path] = metadata
        metadata = self._metadata[path]
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        byte_items = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
        fast, fallback = [], []
        for item in plan.items:
            if item.type != LoadItemType.BYTE_IO:
                (fallback if self.storage_data[item.storage_index].transform_descriptors else fast).append(item)
        if fallback:
            logger.debug("%d DCP tensor items have storage transforms; FileSystemReader reads them", len(fallback))
            super().read_data(LoadPlan(fallback), planner).wait()  # it loads tensors with weights_only=True
        files = SnapshotFiles(Path(self.path))
        try:
            for item in byte_items:
                planner.load_bytes(item, io.BytesIO(self._object_payload(files, item)))
            targets = [planner.resolve_tensor(item).detach() for item in fast]  # planners are not thread-safe
            copy: Callable[[tuple[ReadItem, torch.Tensor]], int] = lambda job: self._copy(files, *job)
            with ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="torchrevive-dcp") as pool:
                self.bytes_read += sum(pool.map(copy, zip(fast, targets)))
            self.tensors_read += len(fast)
            for item, target in zip(fast, targets):
                planner.commit_tensor(item, target)
        finally:
            files.close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _object_payload(self, files: SnapshotFiles, item: ReadItem) -> bytes:
        """What the planner gets for a byte item. DCP's planners ``torch.load`` it with
        ``weights_only=False``, so unless trusted, it is loaded safely here and the planner gets
        the result saved again by ``torch.save``, never the stored bytes."""
        info = self.storage_data[item.storage_index]
        with self._mapped(files, item) as mapping:
            payload = mapping[info.offset : info.offset + info.length]
        if info.transform_descriptors:
            payload = self.transforms.transform_load_stream(item, info.transform_descriptors, io.BytesIO(payload)).read()
        if self.trust_pickles:
            return payload
        value = load_object(payload, where=Path(self.path) / info.relative_path, key=item.storage_index.fqn,
                            kind="object", trust_pickles=False)
        resaved = io.BytesIO()
        torch.save(value, resaved)
        return resaved.getvalue()

    def _copy(self, files: SnapshotFiles, item: ReadItem, target: torch.Tensor) -> int:
        raw = self._locate(files, item)
        with self._mapped(files, item) as mapping:
            whole = torch.frombuffer(mapping, dtype=raw.dtype, count=raw.numel_span, offset=raw.byte_offset)
            source = whole.as_strided(raw.shape, raw.stride)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                source = source.narrow(dim, start, length)
            if target.shape != source.shape:
                raise RestoreError(f"{self._where(item)}: the plan asks {list(source.shape)} elements for a "
                                   f"destination of {list(target.shape)}")
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
                with self._mapped(files, item) as mapping:
                    self._located[key] = locate_saved_tensor(mapping, info.offset, info.length, where=self._where(item))
            return self._located[key]

    @contextmanager
    def _mapped(self, files: SnapshotFiles, item: ReadItem) -> Iterator[mmap.mmap]:
        """The mapping of the item's file, once the item's bytes are checked to be in the file now:
        a mapping touched past the end of its file (one shorter than the metadata says, or one
        truncated since it was mapped) raises SIGBUS, which kills the process."""
        info = self.storage_data[item.storage_index]
        try:
            with files.mapped(info.relative_path, info.offset + info.length) as mapping:
                yield mapping
        except StorageReadError as exc:
            raise RestoreError(f"{exc}, for {item.storage_index.fqn!r}; the checkpoint is damaged: restore another "
                               "one") from None

    def _where(self, item: ReadItem) -> str:
        """The item's file and key, for messages."""
        return f"{Path(self.path) / self.storage_data[item.storage_index].relative_path} ({item.storage_index.fqn})"


def _check_storage_data(root: Path, storage_data: dict[Any, Any], *, named_in: Path) -> None:
    """Each item's index, file and byte range are what FileSystemWriter writes, its file lies
    inside the checkpoint, and the file holds the item's bytes now (the reader checks again
    before each item: a file may shrink while it is read)."""
    for index, info in storage_data.items():
        position = (getattr(info, "offset", None), getattr(info, "length", None))
        if not isinstance(index, MetadataIndex) or not isinstance(getattr(info, "relative_path", None), str) \
                or not _naturals(position):
            raise RestoreError(f"{named_in}: item {index!r} has no valid position ({info!r}); the checkpoint is "
                               "damaged: restore another one")
    check_locations(root, {info.relative_path: index.fqn for index, info in storage_data.items()}, named_in=named_in)
    sizes: dict[str, int] = {}
    for index, info in storage_data.items():
        path = root / info.relative_path
        if info.relative_path not in sizes:
            try:
                sizes[info.relative_path] = path.stat().st_size
            except OSError as exc:
                raise RestoreError(f"{path}: cannot be read ({exc.strerror}), needed by {index.fqn!r}; the "
                                   "checkpoint is damaged: restore another one") from None
        _check_span(sizes[info.relative_path], info.offset, info.length, where=f"{path} ({index.fqn})")


def _check_span(size: int, offset: int, length: int, *, where: str) -> None:
    """Bytes ``offset``.. ``offset + length`` lie inside a file (or an item) of ``size`` bytes."""
    if offset < 0 or length < 0 or offset + length > size:
        raise RestoreError(f"{where}: bytes {offset}..{offset + length} lie outside the {size} bytes that hold "
                           "them; the checkpoint is damaged: restore another one")


def locate_saved_tensor(buffer: Any, offset: int, length: int, *, where: str) -> _RawTensor:
    """Find the tensor saved by ``torch.save`` in ``buffer[offset : offset + length]``. Every
    position and size the archive gives is checked to lie inside that range: a crafted item gives
    RestoreError, never a read outside it or an allocation it did not pay for in bytes."""
    _check_span(len(buffer), offset, length, where=where)
    small = length < (1 << 16)  # read whole; a large item is windowed so that its data is never copied
    try:
        with (io.BytesIO(buffer[offset : offset + length]) if small else _Window(buffer, offset, length)) as window, \
                zipfile.ZipFile(window) as archive:
            pickled = next(info for info in archive.infolist() if info.filename.endswith("/data.pkl"))
            if max(pickled.file_size, pickled.compress_size) > MAX_RECIPE_BYTES:
                raise pickle.UnpicklingError(f"a data.pkl of {pickled.file_size} bytes")
            recipe = _TensorRecipe.from_pickle(archive.read(pickled))
            entry = archive.getinfo(f"{pickled.filename.removesuffix('data.pkl')}data/{recipe.storage_key}")
    except Exception as exc:  # zipfile and the unpickler raise whatever a damaged or crafted archive makes them hit
        raise RestoreError(f"{where}: not a torch.save tensor archive this reader understands "
                           f"({type(exc).__name__}: {exc}); the checkpoint is damaged or crafted") from exc
    if entry.compress_type != zipfile.ZIP_STORED:
        raise RestoreError(f"{where}: the tensor's bytes are compressed in the archive")
    data_start = _data_start(buffer, offset, length, entry, where=where)
    itemsize = recipe.dtype.itemsize
    span = 1 + sum((size - 1) * stride for size, stride in zip(recipe.shape, recipe.stride)) if all(recipe.shape) else 0
    if (recipe.storage_offset + span) * itemsize > entry.file_size:
        raise RestoreError(f"{where}: the archive's storage is shorter than its tensor")
    return _RawTensor(recipe.dtype, recipe.shape, recipe.stride,
                      offset + data_start + recipe.storage_offset * itemsize, span)


def _data_start(buffer: Any, offset: int, length: int, entry: zipfile.ZipInfo, *, where: str) -> int:
    """Where an archive entry's bytes begin in its item (after its local header), checked to end
    inside the item."""
    _check_span(length, entry.header_offset, _LOCAL_HEADER, where=where)
    header = bytes(buffer[offset + entry.header_offset : offset + entry.header_offset + _LOCAL_HEADER])
    if not header.startswith(_LOCAL_HEADER_SIGNATURE):
        raise RestoreError(f"{where}: the archive's directory points at no entry; the checkpoint is damaged")
    start = entry.header_offset + _LOCAL_HEADER + int.from_bytes(header[26:28], "little") + \
        int.from_bytes(header[28:30], "little")
    _check_span(length, start, entry.file_size, where=where)
    return start


def _naturals(values: Any) -> bool:
    """Whether every value is an int >= 0 (as torch.save writes sizes, strides and offsets)."""
    return all(type(value) is int and value >= 0 for value in values)


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
        recipe = _RecipeUnpickler(io.BytesIO(payload)).load()
        if not isinstance(recipe, cls) or not recipe.well_formed():
            raise pickle.UnpicklingError("the archive does not hold a single tensor")
        return recipe

    def well_formed(self) -> bool:
        """Types and signs as torch.save writes them (the sizes are checked against the file later)."""
        return (isinstance(self.storage_key, str) and isinstance(self.dtype, torch.dtype)
                and len(self.shape) == len(self.stride) and _naturals((self.storage_offset, *self.shape, *self.stride)))


@dataclass(frozen=True)
class _StorageKind:
    """Stands for a storage class that ``data.pkl`` names: its dtype (None for UntypedStorage,
    whose tensors name their dtype). Not callable, unlike the class: no storage is ever built."""

    dtype: torch.dtype | None


def _legacy_storage_kinds() -> dict[str, _StorageKind]:
    """torch.FloatStorage and the like (what torch.save names for most dtypes) by name."""
    with warnings.catch_warnings():  # typed storage classes warn that they are deprecated
        warnings.simplefilter("ignore")
        return {name: _StorageKind(cls.dtype) for name, cls in vars(torch).items() if isinstance(cls, type)
                and issubclass(cls, torch.storage.TypedStorage) and cls is not torch.storage.TypedStorage}


_STORAGE_KINDS = {("torch", name): kind for name, kind in _legacy_storage_kinds().items()}
_STORAGE_KINDS["torch.storage", "UntypedStorage"] = _StorageKind(None)


class _RecipeUnpickler(pickle.Unpickler):
    """Reads a tensor's ``data.pkl`` into a _TensorRecipe; refuses every other global."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _recipe
        if (module, name) == ("torch._utils", "_rebuild_tensor_v3"):  # the dtype is an argument (float8, ...)
            return _recipe_v3
        if (module, name) == ("collections", "OrderedDict"):  # the tensor's (empty) backward hooks
            return OrderedDict
        if (module, name) in _STORAGE_KINDS:
            return _STORAGE_KINDS[module, name]
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a tensor archive")

    def persistent_load(self, pid: Any) -> tuple[str, torch.dtype | None]:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _StorageKind)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r:.80} in a tensor archive")
        return pid[2], pid[1].dtype


def _recipe(storage: tuple[str, torch.dtype | None], storage_offset: int, size: Any, stride: Any,
            *_: Any) -> _TensorRecipe:
    key, dtype = storage
    return _TensorRecipe(key, dtype, storage_offset, tuple(size), tuple(stride))


def _recipe_v3(storage: tuple[str, Any], storage_offset: int, size: Any, stride: Any, _requires_grad: Any,
               _hooks: Any, dtype: torch.dtype, *_: Any) -> _TensorRecipe:
    return _TensorRecipe(storage[0], dtype, storage_offset, tuple(size), tuple(stride))


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
