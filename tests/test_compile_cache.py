"""A node's compile caches (agent.compile_cache): a process that starts on a node after another
compiled there, or on a new node after the leader shared its caches, compiles from them; a
shared archive that is torn, corrupt, of another torch or crafted to escape is never taken."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from conftest import worker_env

from agent.compile_cache import (
    POINTER_FILE,
    SHARED_DIR,
    CompileCache,
    CompileCacheError,
    PeerFetch,
    Shared,
    fetch_shared,
    pack,
    unpack,
)
from agent.memory.peer_files import PeerError, PeerFileClient, PeerFileServer

COMPILE = """
import json, torch
from torch._dynamo.utils import counters
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
torch.compile(model, dynamic=False)(torch.randn(2, 16, requires_grad=True)).sum().backward()
print(json.dumps({"hits": counters["inductor"]["fxgraph_cache_hit"], "misses": counters["inductor"]["fxgraph_cache_miss"]}))
"""


def compile_with(cache: CompileCache) -> dict[str, int]:
    """Compile a small model forward and backward in a new process whose caches are ``cache``'s."""
    done = subprocess.run([sys.executable, "-c", COMPILE], env={**worker_env(), **cache.environment()},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def share(cache: CompileCache) -> tuple[Shared | None, str | None]:
    """Run the leader's share and wait for its outcome."""
    outcome: list[tuple[Shared | None, str | None]] = []
    finished = threading.Event()
    cache.share_if_changed(lambda shared, problem: (outcome.append((shared, problem)), finished.set()))
    assert finished.wait(120), "the pack never ended"
    return outcome[0]


def test_processes_compile_from_the_node_caches_and_a_new_node_from_the_shared_copy(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    node0 = CompileCache(tmp_path / "node0", str(checkpoints), share=True)
    assert node0.prepare().warm_from == "none"
    cold = compile_with(node0)
    assert cold["misses"] > 0 and cold["hits"] == 0, cold
    # A worker restarted on the node finds what its predecessor compiled.
    assert node0.prepare().warm_from == "local"
    restarted = compile_with(node0)
    assert restarted["misses"] == 0 and restarted["hits"] == cold["misses"], restarted
    # Precompiled headers are never shared.
    headers = node0.caches / "precompiled_headers"
    headers.mkdir(exist_ok=True)
    (headers / "big.h.gch").write_bytes(b"\0" * 1024)
    shared, problem = share(node0)
    assert problem is None and shared is not None and shared.files > 0, (shared, problem)
    with tarfile.open(checkpoints / SHARED_DIR / shared.archive) as tar:
        names = tar.getnames()
    assert names and not any(name.startswith(("precompiled_headers", "locks")) for name in names), names
    # A new node with empty caches starts from the shared copy, and compiles nothing from scratch.
    node1 = CompileCache(tmp_path / "node1", str(checkpoints), share=True)
    ready = node1.prepare()
    assert (ready.warm_from, ready.files, ready.problem) == ("snapshot", shared.files, None), ready
    joined = compile_with(node1)
    assert joined["misses"] == 0 and joined["hits"] == cold["misses"], joined
    # Unchanged caches are not packed again.
    finished = threading.Event()
    node0.share_if_changed(lambda *_: finished.set())
    assert not finished.wait(2.0)


def caches_with(root: Path, files: dict[str, bytes]) -> Path:
    caches = root / "inductor"
    for name, data in files.items():
        (caches / name).parent.mkdir(parents=True, exist_ok=True)
        (caches / name).write_bytes(data)
    return caches


def test_a_pack_points_at_the_new_archive_and_keeps_the_one_before(tmp_path):
    caches = caches_with(tmp_path / "node", {"fxgraph/a/entry": b"1" * 100, "aotautograd/b/entry": b"2"})
    shared, served = tmp_path / "checkpoints" / SHARED_DIR, tmp_path / "memory" / SHARED_DIR
    first = pack(caches, [shared, served])
    (caches / "fxgraph/c").mkdir()
    (caches / "fxgraph/c/entry").write_bytes(b"3")
    second = pack(caches, [shared, served])
    (caches / "fxgraph/d").mkdir()
    (caches / "fxgraph/d/entry").write_bytes(b"4")
    third = pack(caches, [shared, served])
    for folder in (shared, served):  # the checkpoint dir's copy, and the one the data plane serves
        pointer = json.loads((folder / POINTER_FILE).read_text())
        assert (pointer["archive"], pointer["files"], pointer["torch"]) == (third.archive, 4, torch.__version__)
        assert hashlib.sha256((folder / third.archive).read_bytes()).hexdigest() == pointer["sha256"]
        assert sorted(p.name for p in folder.glob("*.tar")) == sorted([second.archive, third.archive])
    assert first.archive not in {second.archive, third.archive}
    assert unpack(shared, tmp_path / "other" / "inductor") == (4, 103)
    assert (tmp_path / "other" / "inductor" / "fxgraph/d/entry").read_bytes() == b"4"


def crafted(shared: Path, members: list[tuple[tarfile.TarInfo, bytes]], *, torch_version: str | None = None,
            digest: str | None = None) -> None:
    """Write an archive of ``members`` and a pointer naming it, as a hostile writer of the checkpoint dir could."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            info.size = len(data) if info.isfile() else 0
            tar.addfile(info, io.BytesIO(data) if info.isfile() else None)
    data = buffer.getvalue()
    real = hashlib.sha256(data).hexdigest()
    shared.mkdir(parents=True, exist_ok=True)
    (shared / f"{real}.tar").write_bytes(data)
    (shared / POINTER_FILE).write_text(json.dumps({"archive": f"{real}.tar", "sha256": digest or real,
                                                   "torch": torch_version or torch.__version__}))


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.mode = kind, link, 0o644
    return info


HOSTILE = {
    "a path out of the folder": ([(member("../escaped"), b"x")], "not a path inside"),
    "an absolute path": ([(member("/tmp/torchrevive-absolute-escape"), b"x")], "not a path inside"),
    "a symbolic link": ([(member("fxgraph/link", tarfile.SYMTYPE, "/etc/passwd"), b"")], "neither a file"),
    "a hard link": ([(member("fxgraph/hard", tarfile.LNKTYPE, "/etc/passwd"), b"")], "neither a file"),
    "a device": ([(member("fxgraph/dev", tarfile.CHRTYPE), b"")], "neither a file"),
    "a fifo": ([(member("fxgraph/fifo", tarfile.FIFOTYPE), b"")], "neither a file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_an_archive_crafted_to_escape_is_refused_and_writes_nothing(tmp_path, case):
    members, refusal = HOSTILE[case]
    shared = tmp_path / "checkpoints" / SHARED_DIR
    crafted(shared, [(member("fxgraph/fine"), b"ok"), *members])
    caches = tmp_path / "node" / "inductor"
    with pytest.raises(CompileCacheError, match=rf"\.tar: .*{refusal}"):
        unpack(shared, caches)
    assert not caches.exists()
    assert not (tmp_path / "node" / "escaped").exists() and not Path("/tmp/torchrevive-absolute-escape").exists()
    assert [p.name for p in (tmp_path / "node").iterdir()] == []  # no unpacking folder left behind


def test_a_torn_corrupt_foreign_or_oversized_archive_is_not_taken(tmp_path):
    shared = tmp_path / "checkpoints" / SHARED_DIR
    caches = tmp_path / "node" / "inductor"
    files = [(member("fxgraph/entry"), b"y" * 4096)]
    crafted(shared, files, digest="0" * 64)
    with pytest.raises(CompileCacheError, match="names no archive"):
        unpack(shared, caches)  # the pointer's digest is not the archive's name
    crafted(shared, files)
    archive = next(shared.glob("*.tar"))
    archive.write_bytes(archive.read_bytes()[:-600] + b"\1" * 600)
    with pytest.raises(CompileCacheError, match="do not match the digest"):
        unpack(shared, caches)
    for old in shared.glob("*.tar"):
        old.unlink()
    crafted(shared, files, torch_version="1.0.0")
    with pytest.raises(CompileCacheError, match="torch 1.0.0"):
        unpack(shared, caches)
    crafted(shared, files)
    with pytest.raises(CompileCacheError, match="above the 1000 taken"):
        unpack(shared, caches, max_bytes=1000)
    (shared / POINTER_FILE).write_text(json.dumps({"archive": "../../x.tar", "sha256": "../../x"}))
    with pytest.raises(CompileCacheError, match="names no archive"):
        unpack(shared, caches)
    (shared / POINTER_FILE).write_text("{not json")
    with pytest.raises(CompileCacheError, match="unreadable"):
        unpack(shared, caches)
    assert not caches.exists()
    # The node's workers then compile from scratch, and the event says why.
    ready = CompileCache(tmp_path / "node", str(tmp_path / "checkpoints"), share=True).prepare()
    assert ready.warm_from == "none" and "unreadable" in ready.problem, ready


def test_without_share_a_node_uses_its_own_caches_only(tmp_path):
    crafted(tmp_path / "checkpoints" / SHARED_DIR, [(member("fxgraph/entry"), b"z")])
    cache = CompileCache(tmp_path / "node", str(tmp_path / "checkpoints"), share=False)
    assert (cache.prepare().warm_from, cache.shared) == ("none", None)
    assert cache.environment() == {"TORCHINDUCTOR_CACHE_DIR": str((tmp_path / "node").resolve() / "inductor")}
    caches_with(tmp_path / "node", {"fxgraph/mine": b"m"})
    assert cache.prepare().warm_from == "local"


SECRET = b"c" * 32


def served_by_peer(root: Path) -> tuple[PeerFileServer, PeerFetch]:
    """A peer's data plane serving ``root`` in round 3, and a fetch from it as an agent makes one."""
    server = PeerFileServer(root, SECRET, host="127.0.0.1")
    server.round = 3

    def from_peer(into: Path) -> None:
        try:
            with PeerFileClient(server.address, SECRET, round=3) as client:
                fetch_shared(client.get, into)
        except PeerError as exc:
            raise CompileCacheError(str(exc)) from None

    return server, from_peer


def test_a_node_with_empty_caches_takes_a_peers_over_the_data_plane_before_the_checkpoint_dirs(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    leader = CompileCache(tmp_path / "leader", str(checkpoints), share=True, served=tmp_path / "leader-memory")
    caches_with(leader.caches.parent, {"fxgraph/a/entry": b"a" * 10, "aotautograd/b/entry": b"b"})
    # Before the job shared any caches (its first round), no peer is asked.
    early = CompileCache(tmp_path / "early", str(checkpoints), share=True)
    assert early.prepare(lambda into: pytest.fail("a peer asked before the job shared its caches")).warm_from == "none"
    shared, problem = share(leader)
    assert problem is None and (tmp_path / "leader-memory" / SHARED_DIR / shared.archive).exists()
    server, from_peer = served_by_peer(tmp_path / "leader-memory")
    try:
        joining = CompileCache(tmp_path / "joining", str(checkpoints), share=True)
        ready = joining.prepare(from_peer)
        assert (ready.warm_from, ready.files, ready.bytes, ready.problem) == ("peer", 2, 11, None), ready
        assert (joining.caches / "fxgraph/a/entry").read_bytes() == b"a" * 10
        assert not list((tmp_path / "joining").glob(".peer-incoming-*"))
    finally:
        server.close()


def test_a_peers_crafted_archive_is_refused_and_the_checkpoint_dirs_is_taken(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    pack(caches_with(tmp_path / "leader", {"fxgraph/good": b"g"}), [checkpoints / SHARED_DIR])
    crafted(tmp_path / "peer-memory" / SHARED_DIR, [(member("fxgraph/link", tarfile.SYMTYPE, "/etc/passwd"), b"")])
    server, from_peer = served_by_peer(tmp_path / "peer-memory")
    try:
        joining = CompileCache(tmp_path / "joining", str(checkpoints), share=True)
        ready = joining.prepare(from_peer)
        assert (ready.warm_from, ready.files) == ("snapshot", 1), ready
        assert ready.problem.startswith("from a peer: ") and "neither a file nor a folder" in ready.problem, ready
        assert not (joining.caches / "fxgraph/link").exists()
    finally:
        server.close()
    # A peer that does not answer, and no copy in the checkpoint dir either: nothing, and why.
    (checkpoints / SHARED_DIR / POINTER_FILE).write_text("{}")
    ready = CompileCache(tmp_path / "alone", str(checkpoints), share=True).prepare(from_peer)
    assert ready.warm_from == "none" and ready.problem.startswith("from a peer: ") and "names no archive" in ready.problem
