"""Snapshot files written around the page cache: the bytes are the buffer's whatever its alignment,
the page cache holds none of a direct write's body (the kernel's own count, mincore), a file system
without O_DIRECT, or refusing a direct write, gets the bytes through the page cache, and a save
takes the direct path end to end."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from agent.checkpoint import Checkpointer, direct_write
from agent.checkpoint.direct_write import BLOCK, aligned, write_durably
from agent.checkpoint.stage import Stager
from agent.checkpoint.write import write_snapshot

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: Path) -> int:
    """How many of ``path``'s pages the page cache holds (mincore over a read-only mapping)."""
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        pages = -(-size // mmap.PAGESIZE)
        vector = ctypes.create_string_buffer(pages)
        try:
            assert _libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(address, size)
    finally:
        os.close(fd)
    return sum(byte & 1 for byte in vector.raw)


def direct_io_here(directory: Path) -> bool:
    try:
        os.close(os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        (directory / ".probe").unlink(missing_ok=True)


@pytest.fixture
def direct_dir(tmp_path: Path) -> Path:
    if not direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    probe = tmp_path / ".probe"
    write_durably(str(probe), aligned_copy(bytes(4 * BLOCK)), direct=True)
    if cached_pages(probe):  # tmpfs takes O_DIRECT (Linux 6.6 on) and keeps every page in memory
        pytest.skip(f"{tmp_path}'s file system keeps directly written pages in memory (tmpfs)")
    probe.unlink()
    return tmp_path


def random_bytes(nbytes: int) -> bytes:
    generator = torch.Generator().manual_seed(nbytes)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator).numpy().tobytes()


def aligned_copy(data: bytes) -> memoryview:
    view = aligned(len(data))
    view[:] = data
    return view


@pytest.mark.parametrize("shape", ["aligned", "unaligned", "read_only"])
def test_a_direct_write_holds_the_buffers_bytes_and_leaves_its_body_out_of_the_page_cache(direct_dir, shape):
    data = random_bytes(3 * (8 << 20) + 1234)  # the bounce buffer's size three times, and a tail
    view = {"aligned": lambda: aligned_copy(data),
            "unaligned": lambda: memoryview(bytearray(b"x" + data))[1:],
            "read_only": lambda: memoryview(data)}[shape]()
    path = direct_dir / "file"
    body = len(data) // BLOCK * BLOCK

    assert write_durably(str(path), view, direct=True) == body
    assert path.read_bytes() == data
    path.write_bytes(data[:0])  # reading it back cached it: write it again to count
    assert write_durably(str(path), view, direct=True) == body
    assert cached_pages(path) <= 1  # at most the tail's page, written through the cache


def test_a_buffered_write_leaves_the_file_in_the_page_cache_which_is_what_direct_avoids(direct_dir):
    data = random_bytes(4 << 20)
    path = direct_dir / "file"
    assert write_durably(str(path), aligned_copy(data), direct=False) == 0
    assert cached_pages(path) == len(data) // mmap.PAGESIZE  # the check above can see cached pages
    assert path.read_bytes() == data


def test_a_file_shorter_than_a_block_goes_through_the_page_cache(direct_dir):
    path = direct_dir / "small"
    assert write_durably(str(path), memoryview(b"metadata"), direct=True) == 0
    assert path.read_bytes() == b"metadata"


def test_a_file_system_without_o_direct_is_written_through_the_page_cache(tmp_path):
    """ramfs has no O_DIRECT (this kernel's tmpfs has)."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a ramfs")
    try:
        assert not direct_io_here(mount)
        data = random_bytes(1 << 20)
        assert write_durably(str(mount / "file"), aligned_copy(data), direct=True) == 0
        assert (mount / "file").read_bytes() == data
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.parametrize("refused_after", [0, 1])
def test_a_file_system_that_refuses_a_direct_write_gets_the_rest_through_the_page_cache(direct_dir, monkeypatch,
                                                                                        refused_after):
    """Some file systems take O_DIRECT at open and refuse the writes (EINVAL: they ask for a larger
    alignment). None is here, so the kernel's refusal is played: direct writes after the first
    ``refused_after`` fail as such a file system's would, before writing a byte."""
    real_write = os.write
    direct_writes = []

    def refusing(fd: int, data) -> int:
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            if len(direct_writes) >= refused_after:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            direct_writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(direct_write.os, "write", refusing)
    data = random_bytes(2 * (8 << 20) + 777)
    path = direct_dir / "file"
    assert write_durably(str(path), memoryview(bytearray(b"x" + data))[1:], direct=True) == sum(direct_writes)
    assert len(direct_writes) == refused_after  # one bounce buffer's worth went directly, or none
    assert path.read_bytes() == data


def test_staged_tensors_torchsnapshot_writes_from_their_own_buffers_are_page_aligned():
    stager = Stager()
    try:
        state = {"big": torch.randn(1_100_000), "odd": torch.randn(3, 200_001, dtype=torch.float64),
                 "batched": torch.randn(5000), "small": torch.randn(7)}
        staged = stager.stage({"app": state})["app"].state_dict()
    finally:
        stager.close()
    assert staged["big"].data_ptr() % BLOCK == 0 and staged["odd"].data_ptr() % BLOCK == 0
    for key, tensor in state.items():
        assert torch.equal(staged[key], tensor) and staged[key].dtype == tensor.dtype


@pytest.mark.parametrize("direct", [True, False])
def test_a_save_writes_its_tensors_directly_only_when_asked_and_restores_the_same(direct_dir, monkeypatch, direct):
    torch.manual_seed(0)
    model = nn.Linear(1024, 1100)  # a weight above the slab threshold: written from its staged buffer
    record = write_snapshot(direct_dir / "snapshot", {"model": model}, replicated=[], group=None, direct=direct)
    assert record.error is None
    weight_bytes = 1024 * 1100 * 4
    assert (record.direct_bytes >= weight_bytes) if direct else record.direct_bytes == 0

    bodies: list[tuple[bool, int]] = []  # (aligned in memory, length) of each direct write
    real_write_body = direct_write._write_body

    def noting(fd: int, body: memoryview) -> int:
        bodies.append((direct_write._address(body) % BLOCK == 0, len(body)))
        return real_write_body(fd, body)

    monkeypatch.setattr(direct_write, "_write_body", noting)
    checkpointer = Checkpointer(direct_dir / "ckpt", interval_steps=1, direct_io=direct, round=None)
    checkpointer.save(1, {"model": model})
    checkpointer.wait()
    # The staged weight went to the disk from its own buffer, without the bounce buffer's copy.
    assert ((True, weight_bytes) in bodies) if direct else bodies == []
    restored = nn.Linear(1024, 1100)
    assert checkpointer.restore({"model": restored}) == 1
    assert torch.equal(restored.weight, model.weight) and torch.equal(restored.bias, model.bias)
