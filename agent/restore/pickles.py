"""What restore unpickles, and what it refuses.

Unpickling runs code, so a checkpoint's pickles are data unless the user trusts the checkpoint
(``trust_pickles=True``): ``torch.save`` payloads (torchsnapshot objects, DCP byte items) load
with ``torch.load(weights_only=True)`` semantics (containers, numbers, strings, tensors), and
DCP's ``.metadata`` through an unpickler that knows DCP's metadata classes and nothing else.
A refusal is one RestoreError naming the file, the key and the opt-in.
"""

from __future__ import annotations

import importlib
import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from agent.errors import RestoreError

OPT_IN = "if you trust this checkpoint, pass trust_pickles=True (restore.trust_pickles: true)"

_DCP_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.layout pickles as a call of it with the layout's name
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("collections", "OrderedDict"),
})
"""What DCP's FileSystemWriter pickles into ``.metadata``, torch dtypes aside: plain classes whose
construction only stores their arguments."""
TORCH_DTYPES = {name: dtype for name, dtype in vars(torch).items() if isinstance(dtype, torch.dtype)}
"""torch.float32 and the like pickle as the global ``torch.<name>``."""


def load_object(payload: bytes, *, where: Path, key: str, kind: str, trust_pickles: bool) -> Any:
    """Unpickle a ``torch.save`` payload stored at ``where`` for ``key`` (a pickled ``kind``):
    ``weights_only`` unless ``trust_pickles``."""
    try:
        return torch.load(io.BytesIO(payload), weights_only=not trust_pickles, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if trust_pickles:
            raise RestoreError(f"{where}: '{key}' cannot be unpickled ({exc}); the checkpoint is damaged") from exc
        raise RestoreError(f"{where}: '{key}' is a pickled {kind} that safe loading refuses (unpickling runs "
                           f"code); {OPT_IN}") from exc
    except (EOFError, RuntimeError) as exc:
        raise RestoreError(f"{where}: '{key}' is damaged ({exc}); restore another checkpoint") from exc


def load_dcp_metadata(path: Path, *, trust_pickles: bool) -> Metadata:
    """DCP's ``.metadata`` at ``path``: with DCP's own ``pickle.load`` when ``trust_pickles``,
    else through an unpickler that refuses every global but DCP's metadata classes."""
    try:
        with open(path, "rb") as f:
            metadata = pickle.load(f) if trust_pickles else _DcpMetadataUnpickler(f).load()
    except FileNotFoundError:
        raise RestoreError(f"{path}: missing; not a DCP checkpoint, or an incomplete one") from None
    except _Refused as exc:
        raise RestoreError(f"{path}: DCP metadata names {exc}, which safe loading refuses (unpickling runs "
                           f"code); {OPT_IN}") from None
    except Exception as exc:  # a damaged pickle raises whatever its opcodes and constructors raise
        raise RestoreError(f"{path}: unreadable DCP metadata ({type(exc).__name__}: {exc}); restore another "
                           "checkpoint") from exc
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise RestoreError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata; restore another checkpoint")
    return metadata


class _Refused(pickle.UnpicklingError):
    """A global outside the allowlist (its message is the global's name)."""


class _DcpMetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata; any other global is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and name in TORCH_DTYPES:
            return TORCH_DTYPES[name]
        raise _Refused(f"{module}.{name}")
