"""Snapshots whose metadata lies: each is a real snapshot written by torchsnapshot (or the
Checkpointer) with its ``.snapshot_metadata`` rewritten. Restore refuses each with one
RestoreError naming the metadata file and the key (so that the Checkpointer falls back), before
any byte is copied where the lie is in the metadata: no byte lands past a destination tensor
(each destination is a view at the start of a larger buffer whose tail is a canary).

A chunk of float64 in a float32 tensor once made the reader write twice the chunk's bytes into
the tensor: the canary is how these tests see a write past the tensor without crashing. Random
rewrites of every field (hypothesis) end in a restore or a RestoreError, never another exception."""

from __future__ import annotations

import copy
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torchsnapshot
import yaml
from distributed import run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torchsnapshot import knobs

import agent
from agent import RestoreError
from agent.checkpoint import Checkpointer
from agent.checkpoint.commit import metadata_refused
from agent.checkpoint.checksums import data_files, digest_files, write_checksums
from agent.restore.manifest import StoredChunk, StoredTensor, load_metadata, manifest_for_rank
from agent.restore.plan import Box, plan_copies
from agent.restore.reader import SnapshotFiles, read_ops

CANARY = 2048
"""Elements after each destination tensor, in the same buffer, that a restore must never touch."""
W = torch.arange(16.0)
BIG = torch.arange(4096.0).reshape(64, 64)
ROWS = torch.arange(60.0).reshape(10, 6)


class Canaried:
    """Destination tensors, each a view at the start of a buffer of zeros CANARY elements longer."""

    def __init__(self, **shapes: tuple[int, ...]) -> None:
        self.buffers = {key: torch.zeros(math.prod(shape) + CANARY) for key, shape in shapes.items()}
        self.tensors = {key: self.buffers[key][: math.prod(shape)].view(shape) for key, shape in shapes.items()}

    def untouched(self) -> bool:
        """Whether every byte of every buffer is still zero: nothing was copied, nor written past."""
        return all(not buffer.any() for buffer in self.buffers.values())


def edit_metadata(snapshot: Path, edit: Callable[[dict], None]) -> None:
    path = snapshot / ".snapshot_metadata"
    metadata = json.loads(path.read_text())  # torchsnapshot writes its YAML as JSON
    edit(metadata)
    path.write_text(json.dumps(metadata))


def stored_as(tensor: dict, dtype: str, snapshot: Path) -> None:
    """Make a stored tensor entry claim ``dtype``, its byte range that many bytes from where it
    starts (the file made long enough, with bytes that are not zero), as a crafted one would."""
    numel = math.prod(tensor["shape"])
    start = tensor["byte_range"][0]
    end = start + numel * getattr(torch, dtype.removeprefix("torch.")).itemsize
    file = snapshot / tensor["location"]
    if file.stat().st_size < end:
        with open(file, "ab") as f:
            f.write(b"\xab" * (end - file.stat().st_size))
    tensor.update(dtype=dtype, byte_range=[start, end])


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A snapshot of a plain tensor 's/w' and a chunked one 's/big' (4 chunks of 16 rows)."""
    with knobs.override_max_chunk_size_bytes(4096):
        torchsnapshot.Snapshot.take(str(tmp_path / "snap"), {"s": torchsnapshot.StateDict(w=W, big=BIG)})
    return tmp_path / "snap"


def plain_destination() -> tuple[Canaried, dict]:
    dest = Canaried(w=(16,), big=(64, 64))
    return dest, {"s": torchsnapshot.StateDict(**dest.tensors)}


def big(metadata: dict) -> dict:
    return metadata["manifest"]["0/s/big"]


def w(metadata: dict) -> dict:
    return metadata["manifest"]["0/s/w"]


def test_the_plain_snapshot_restores_into_canaried_destinations(plain):
    dest, state = plain_destination()
    agent.restore(plain, state)
    assert torch.equal(dest.tensors["w"], W) and torch.equal(dest.tensors["big"], BIG)
    assert all(not buffer[-CANARY:].any() for buffer in dest.buffers.values())


def test_a_float64_chunk_in_a_float32_tensor_is_refused_before_a_byte_is_written(plain):
    """The last chunk (rows 48..64) claims float64: read as such, its 8 KiB would land in the
    4 KiB of the tensor's last rows and the 4 KiB after them."""
    edit_metadata(plain, lambda m: stored_as(big(m)["chunks"][-1]["tensor"], "torch.float64", plain))
    dest, state = plain_destination()
    error = restore_error(plain, state)
    assert not dest.buffers["big"][-CANARY:].any(), "bytes were written past the tensor"
    assert dest.untouched()
    assert re.search(r"snap/\.snapshot_metadata: '0/s/big' has a chunk of dtype torch\.float64 in a tensor of dtype "
                     r"torch\.float32; the snapshot is damaged or crafted: restore another one", error), error


def restore_error(snapshot: Path, state: dict) -> str:
    """The RestoreError's message ("" when the restore succeeded: the caller looks at the
    destination first, to see whether a restore that should have failed wrote past it)."""
    try:
        agent.restore(snapshot, state)
    except RestoreError as exc:
        return str(exc)
    return ""


def test_the_reader_itself_never_writes_past_a_destination(tmp_path):
    """Defence in depth, below the metadata's checks: a plan whose chunk is of another dtype than
    its destination is refused at the copy."""
    (tmp_path / "data").write_bytes(torch.arange(32.0, dtype=torch.float64).numpy().tobytes())
    chunk = StoredChunk((0,), (32,), "data", 0, 256, torch.float64, "buffer_protocol")
    ops = plan_copies(StoredTensor((32,), torch.float64, (chunk,), False), [Box((0,), (32,))], max_op_bytes=1 << 20)
    backing = torch.zeros(32 + CANARY)
    files = SnapshotFiles(tmp_path)
    try:
        with pytest.raises(RestoreError, match=r"data: a chunk of torch\.float64 copied as \[32\] into torch\.float32 "
                                               r"\[32\]; the snapshot is damaged or crafted"):
            read_ops(ops, [backing[:32]], files, io_threads=1)
    finally:
        files.close()
    assert not backing.any()


CHUNK_LIES: dict[str, tuple[Callable[[dict], None], str]] = {
    "float16 chunk": (lambda m: big(m)["chunks"][0]["tensor"].update(dtype="torch.float16", byte_range=[64, 2112]),
                      r"'0/s/big' has a chunk of dtype torch\.float16 in a tensor of dtype torch\.float32"),
    "chunk past the shape": (lambda m: big(m)["chunks"][-1].update(offsets=[56, 0]),
                             r"'0/s/big' has a chunk at offsets \[56, 0\] of sizes \[16, 64\] outside its shape"),
    "negative offset": (lambda m: big(m)["chunks"][0].update(offsets=[-8, 0]),
                        r"'0/s/big' has offsets \[-8, 0\], not a list of sizes"),
    "negative size": (lambda m: big(m)["chunks"][0].update(sizes=[-16, 64]),
                      r"'0/s/big' has sizes \[-16, 64\], not a list of sizes"),
    "sizes unlike the stored tensor": (lambda m: big(m)["chunks"][0].update(sizes=[32, 64]),
                                       r"'0/s/big' has a chunk of sizes \[32, 64\] that stores a tensor of shape"),
    "chunk of another rank": (lambda m: big(m)["chunks"][0].update(offsets=[0], sizes=[16]),
                              r"'0/s/big' has a chunk with offsets \[0\] and sizes \[16\] in a tensor of 2 dim"),
    "reversed byte range": (lambda m: w(m).update(byte_range=[64, 0]),
                            r"'0/s/w' has a byte_range \[64, 0\] that is no range of bytes"),
    "negative byte range": (lambda m: w(m).update(byte_range=[-64, 0]),
                            r"'0/s/w' has byte_range \[-64, 0\], not a list of sizes"),
    "byte range of other length": (lambda m: w(m).update(byte_range=[0, 128]),
                                   r"'0/s/w' has a byte_range \[0, 128\] of 128 bytes for a torch\.float32 tensor "
                                   r"of shape \[16\] \(64 bytes\)"),
    "unknown serializer": (lambda m: w(m).update(serializer="pickle"),
                           r"'0/s/w' has serializer 'pickle', not one torchsnapshot writes"),
    "quantized raw bytes": (lambda m: w(m).update(dtype="torch.qint8"), r"'0/s/w' stores torch\.qint8 as raw bytes"),
    "unknown dtype": (lambda m: w(m).update(dtype="torch.float128"), r"'0/s/w' has dtype 'torch\.float128'"),
}


@pytest.mark.parametrize("lie", CHUNK_LIES)
def test_chunks_that_disagree_with_their_tensor_are_refused(plain, lie):
    edit, refusal = CHUNK_LIES[lie]
    edit_metadata(plain, edit)
    dest, state = plain_destination()
    with pytest.raises(RestoreError, match=rf"snap/\.snapshot_metadata: {refusal}.*the snapshot is damaged or "
                                           r"crafted: restore another one"):
        agent.restore(plain, state)
    assert dest.untouched()


def saved_payload(snapshot: Path, value: object) -> dict:
    """A torch.save payload written into the snapshot, as a tensor entry's location and range."""
    torch.save(value, snapshot / "payload")
    return {"location": "payload", "serializer": "torch_save", "byte_range": [0, (snapshot / "payload").stat().st_size]}


@pytest.mark.parametrize("value, found", [
    (torch.zeros(16, 64, dtype=torch.float64), r"a torch\.float64 tensor of shape \[16, 64\]"),
    (torch.zeros(4, 64), r"a torch\.float32 tensor of shape \[4, 64\]"),
    ({"not": "a tensor"}, r"a dict"),
])
def test_torch_save_chunks_must_hold_exactly_their_tensor(plain, value, found):
    edit_metadata(plain, lambda m: big(m)["chunks"][-1]["tensor"].update(saved_payload(plain, value)))
    dest, state = plain_destination()
    with pytest.raises(RestoreError, match=rf"snap/payload: bytes 0\.\.\d+ hold {found} where the metadata says a "
                                           r"torch\.float32 tensor of shape \[16, 64\]; the snapshot is damaged or "
                                           r"crafted: restore another one; it holds 's/big'"):
        agent.restore(plain, state)
    assert not any(buffer[-CANARY:].any() for buffer in dest.buffers.values())


def test_a_torch_save_chunk_of_the_right_tensor_restores(plain):
    """The crafting above changes only the payload: the chunk's own tensor, saved, restores."""
    edit_metadata(plain, lambda m: big(m)["chunks"][-1]["tensor"].update(saved_payload(plain, BIG[48:].clone())))
    dest, state = plain_destination()
    agent.restore(plain, state)
    assert torch.equal(dest.tensors["big"], BIG)


# --- DTensor and ShardedTensor shards (written at 2 ranks, restored here into plain tensors) ----


def write_sharded(rank: int, world_size: int, path: str) -> None:
    """Every kind of entry: a DTensor and a ShardedTensor (rows over the ranks), a DTensor
    replicated on both, plain, chunked and 0-d tensors, primitives, containers and an object."""
    from torch.distributed._shard import sharded_tensor
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world_size)])
    sharded = sharded_tensor.empty(spec, *ROWS.shape)
    for shard in sharded.local_shards():
        start, rows = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
        shard.tensor.copy_(ROWS[start : start + rows])
    mesh = init_device_mesh("cpu", (world_size,))
    state = torchsnapshot.StateDict(
        dt=distribute_tensor(ROWS.clone(), mesh, [Shard(0)]), st=sharded,
        rep=distribute_tensor(W.clone(), mesh, [Replicate()]), w=W, big=BIG, zero_d=torch.tensor(3.0),
        step=3, lr=0.5, name="x", flag=True, raw=b"ab", lst=[1, torch.ones(2)], d={"a": 1}, obj=(1, 2))
    with knobs.override_max_chunk_size_bytes(4096):
        torchsnapshot.Snapshot.take(path, {"s": state})


@pytest.fixture(scope="module")
def sharded_original(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sharded") / "snap"
    run_ranks(2, write_sharded, str(path))
    return path


@pytest.fixture
def sharded(sharded_original: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(sharded_original, tmp_path / "snap"))


def sharded_destination() -> tuple[Canaried, dict]:
    dest = Canaried(dt=(10, 6), st=(10, 6), rep=(16,), w=(16,), big=(64, 64))
    return dest, {"s": torchsnapshot.StateDict(**dest.tensors, zero_d=torch.tensor(0.0), step=0, lr=0.0, name="",
                                               flag=False, raw=b"", lst=[0, torch.zeros(2)], d={}, obj=None)}


def shard_of_rank_1(metadata: dict, key: str) -> dict:
    return metadata["manifest"][f"1/s/{key}"]["shards"][0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sharded_snapshot_restores_into_canaried_destinations(sharded):
    dest, state = sharded_destination()
    agent.restore(sharded, state)
    assert torch.equal(dest.tensors["dt"], ROWS) and torch.equal(dest.tensors["st"], ROWS)
    assert torch.equal(dest.tensors["big"], BIG) and torch.equal(dest.tensors["rep"], W)
    assert state["s"]["obj"] == (1, 2) and state["s"]["lst"][0] == 1 and state["s"]["raw"] == b"ab"


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_metadata_written_as_yaml_restores_as_its_json_does(sharded):
    """torchsnapshot writes its metadata as JSON, which the restore reads without a YAML parser; an
    older torchsnapshot wrote YAML proper, which still restores, to the same entries."""
    path = sharded / ".snapshot_metadata"
    from_json = load_metadata(sharded)
    path.write_text(yaml.safe_dump(json.loads(path.read_text())))
    assert not path.read_text().lstrip().startswith("{")
    assert load_metadata(sharded) == from_json
    dest, state = sharded_destination()
    agent.restore(sharded, state)
    assert torch.equal(dest.tensors["dt"], ROWS) and torch.equal(dest.tensors["big"], BIG)


def test_an_entry_of_a_type_torchsnapshot_never_writes_is_refused(sharded):
    edit_metadata(sharded, lambda m: manifest(m)["0/s/w"].update(type="Bogus"))
    dest, state = sharded_destination()
    with pytest.raises(RestoreError, match=r"snap/\.snapshot_metadata: unreadable snapshot metadata \(ValueError: "
                                           r"manifest entry '0/s/w' has the unknown type 'Bogus'\); restore another"):
        agent.restore(sharded, state)
    assert dest.untouched()


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("key", ["dt", "st"])
def test_a_float64_shard_of_another_rank_is_refused(sharded, key):
    """Rank 1's shard (the last rows) claims float64: the shards of both ranks are merged into one
    tensor, whose dtype is rank 0's."""
    edit_metadata(sharded, lambda m: stored_as(shard_of_rank_1(m, key)["tensor"], "torch.float64", sharded))
    dest, state = sharded_destination()
    error = restore_error(sharded, state)
    assert not dest.buffers[key][-CANARY:].any(), "bytes were written past the tensor"
    assert dest.untouched()
    assert re.search(rf"snap/\.snapshot_metadata: '1/s/{key}' has shards of dtype torch\.float64 and 2 dimensions where "
                     r"another rank's have torch\.float32 and 2", error), error


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("key", ["dt", "st"])
def test_a_shard_whose_sizes_are_not_its_tensor_is_refused(sharded, key):
    edit_metadata(sharded, lambda m: shard_of_rank_1(m, key).update(sizes=[10, 6]))
    dest, state = sharded_destination()
    with pytest.raises(RestoreError, match=rf"'1/s/{key}' has a chunk of sizes \[10, 6\] that stores a tensor of "
                                           r"shape \[5, 6\]"):
        agent.restore(sharded, state)
    assert dest.untouched()


# --- the Checkpointer falls back past a crafted snapshot ----------------------------------------


def test_the_checkpointer_falls_back_past_a_float64_chunk(tmp_path):
    """An attacker who can write the storage rewrites the metadata and its checksums: restore takes
    the previous snapshot, and nothing is written past the destination."""
    ckpt = Checkpointer(tmp_path / "ckpt", staging=False)
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    first = model.weight.detach().clone()
    with knobs.override_max_chunk_size_bytes(4096):  # the weight in 4 chunks of 16 rows
        ckpt.save(1, {"model": model})
        with torch.no_grad():
            model.weight.add_(1.0)
        ckpt.save(2, {"model": model})
    latest = ckpt.latest()
    edit_metadata(latest, lambda m: stored_as(m["manifest"]["0/model/weight"]["chunks"][-1]["tensor"],
                                              "torch.float64", latest))
    write_checksums(latest, digest_files(latest, data_files(latest)))
    backing = torch.zeros(64 * 64 + CANARY)
    target = nn.Linear(64, 64)
    target.weight = nn.Parameter(backing[: 64 * 64].view(64, 64))
    with pytest.warns(UserWarning, match=r"'0/model/weight' has a chunk of dtype torch\.float64"):
        step = Checkpointer(tmp_path / "ckpt", staging=False).restore({"model": target})
    assert step == 1
    assert torch.equal(target.weight, first)
    assert not backing[-CANARY:].any()


# --- metadata that names no rank, fields of the wrong types, containers that do not fit ----------


def manifest(metadata: dict) -> dict:
    return metadata["manifest"]


def renamed(old: str, new: str) -> Callable[[dict], None]:
    return lambda m: manifest(m).__setitem__(new, manifest(m).pop(old))


METADATA_LIES: dict[str, tuple[Callable[[dict], None], str]] = {
    "writer past the world size": (renamed("1/s/dt", "2/s/dt"), r"'2/s/dt' names rank 2 of a snapshot written by 2 ranks"),
    "writer not a number": (renamed("1/s/w", "x/s/w"), r"'x/s/w' is not a key of the form <rank>/<path>"),
    "negative writer": (renamed("1/s/w", "-1/s/w"), r"'-1/s/w' is not a key of the form <rank>/<path>"),
    "no writer": (renamed("1/s/w", "s"), r"'s' is not a key of the form <rank>/<path>"),
    "world size 0": (lambda m: m.update(world_size=0), r"world_size 0 is not a number of ranks"),
    "world size -1": (lambda m: m.update(world_size=-1), r"world_size -1 is not a number of ranks"),
    "world size as text": (lambda m: m.update(world_size="2"), r"world_size '2' is not a number of ranks"),
    "replicated as text": (lambda m: manifest(m)["0/s/w"].update(replicated="yes"),
                           r"'0/s/w' has a 'replicated' that is neither true nor false"),
    "shape as text": (lambda m: manifest(m)["0/s/w"].update(shape="16"), r"'0/s/w' has shape '16', not a list"),
    "dim_map of numbers": (lambda m: manifest(m)["0/s/dt"].update(dim_map=[0]),
                           r"'0/s/dt' has a 'dim_map' that is not a list of lists of mesh dimensions"),
    "no shard on any rank": (lambda m: [manifest(m)[f"{r}/s/dt"].update(shards=[]) for r in (0, 1)],
                             r"'s/dt': a sharded tensor with no stored shard"),
    # What a rank whose mesh coordinate was stale wrote: the shard of the rank it had been.
    "a rank's shard over another's": (lambda m: shard_of_rank_1(m, "dt").update(offsets=[3, 0]),
                                      r"the sharded tensor 's/dt' has rank 0's shard at offsets \[0, 0\] of sizes "
                                      r"\[5, 6\] and rank 1's shard at offsets \[3, 0\] of sizes \[5, 6\], which overlap"),
    "a gap between shards": (lambda m: shard_of_rank_1(m, "st").update(offsets=[6, 0]),
                             r"the sharded tensor 's/st' has chunks holding 60 of its 66 elements \(shape \[11, 6\]\)"),
    "chunks of a chunked tensor overlapping": (lambda m: big(m)["chunks"][1].update(offsets=big(m)["chunks"][0]["offsets"]),
                                               r"'0/s/big' has a chunk at offsets \[0, 0\] of sizes \[16, 64\] and a "
                                               r"chunk at offsets \[0, 0\] of sizes \[16, 64\], which overlap"),
    "chunked tensor without chunks": (lambda m: manifest(m)["0/s/big"].update(chunks=[]),
                                      r"'0/s/big' is a chunked tensor without chunks"),
    "int that is no number": (lambda m: manifest(m)["0/s/step"].update(serialized_value="three"),
                              r"'0/s/step' holds no int \(ValueError"),
    "dict keys as text": (lambda m: manifest(m)["0/s/d"].update(keys="a"),
                          r"'0/s/d' is a dict whose keys are not a list of names"),
    "object of another serializer": (lambda m: manifest(m)["0/s/obj"].update(serializer="pickle"),
                                     r"'0/s/obj' has serializer 'pickle', not one torchsnapshot writes objects with"),
    "dict made a list": (lambda m: manifest(m)["0/s/d"].update(type="list") or manifest(m)["0/s/d"].pop("keys"),
                         r"the containers of 's' do not fit its values \(ValueError"),
}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("lie", METADATA_LIES)
def test_metadata_that_torchsnapshot_cannot_have_written_is_refused(sharded, lie):
    edit, refusal = METADATA_LIES[lie]
    edit_metadata(sharded, edit)
    dest, state = sharded_destination()
    with pytest.raises(RestoreError, match=rf"snap/\.snapshot_metadata: .*{refusal}.*restore another one"):
        agent.restore(sharded, state)
    assert dest.untouched()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_commit_refuses_metadata_that_no_restore_could_read(sharded):
    """Rank 0 checks the metadata it wrote before it commits: shards at the offsets of the ranks
    their writers had been in an earlier round fail the save instead of becoming the latest."""
    written = (sharded / ".snapshot_metadata").read_bytes()
    assert metadata_refused(sharded, written) is None
    edit_metadata(sharded, lambda m: shard_of_rank_1(m, "dt").update(offsets=[3, 0]))
    assert metadata_refused(sharded, (sharded / ".snapshot_metadata").read_bytes()) == (
        f"{sharded / '.snapshot_metadata'}: the sharded tensor 's/dt' has rank 0's shard at offsets [0, 0] of sizes "
        "[5, 6] and rank 1's shard at offsets [3, 0] of sizes [5, 6], which overlap")
    assert metadata_refused(sharded, b"{not json") is not None
    assert metadata_refused(sharded, None) == f"{sharded / '.snapshot_metadata'}: torchsnapshot wrote no metadata"


HOSTILE_VALUES = [-1, 0, 1, 2, 7, 1 << 63, 10**30, 1.5, True, None, "", "x", "torch.float64", "torch.qint8",
                  "buffer_protocol", "torch_save", "Tensor", "../outside", "/etc/passwd", [], [0], [-1, 5], [1, 2, 3],
                  [[0]], {}, {"type": "Tensor"}]
DELETE = object()
WRITERS = ["0", "1", "2", "-1", "x", "", "01", "1e0"]


def nodes(node: object, path: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON tree, the root's children down."""
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    return [p for key, child in children for p in [(*path, key), *nodes(child, (*path, key))]]


def mutate(metadata: dict, data: st.DataObject) -> None:
    """Replace or delete one value anywhere in the metadata, or move one entry to another writer."""
    keys = sorted(metadata["manifest"]) if isinstance(metadata.get("manifest"), dict) else []
    if keys and data.draw(st.booleans(), label="rename a key"):
        key = data.draw(st.sampled_from(keys), label="key")
        writer = data.draw(st.sampled_from(WRITERS), label="writer")
        metadata["manifest"][f"{writer}/{key.partition('/')[2]}"] = metadata["manifest"].pop(key)
        return
    paths = nodes(metadata)
    if not paths:  # an earlier rewrite left nothing
        return
    *parent_path, last = data.draw(st.sampled_from(paths), label="path")
    parent = metadata
    for key in parent_path:
        parent = parent[key]
    value = data.draw(st.sampled_from([DELETE, *HOSTILE_VALUES]), label="value")
    if value is DELETE:
        del parent[last]
    else:  # a copy: a later rewrite inside it must change neither HOSTILE_VALUES nor put a list in itself
        parent[last] = copy.deepcopy(value)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_rewrite_of_the_metadata_restores_or_raises_a_restore_error(sharded_original, sharded, data):
    """A restore of metadata rewritten at random succeeds or raises RestoreError (never another
    exception, which the Checkpointer's fallback would not catch), and never writes past a
    destination tensor; manifest_for_rank, for ranks old and new, raises nothing."""
    metadata = json.loads((sharded_original / ".snapshot_metadata").read_text())
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        mutate(metadata, data)
    (sharded / ".snapshot_metadata").write_text(json.dumps(metadata))
    dest, state = sharded_destination()
    try:
        agent.restore(sharded, state)
    except RestoreError:
        pass
    assert not any(buffer[-CANARY:].any() for buffer in dest.buffers.values()), "bytes were written past a tensor"
    try:
        parsed = load_metadata(sharded)
    except RestoreError:
        return
    for rank in range(4):
        manifest_for_rank(parsed, rank)
