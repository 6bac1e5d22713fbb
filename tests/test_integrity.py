"""Checksums, verify modes, damaged snapshots, a full disk, and every dtype x shape through save and
restore (torchrevive's engine and torchsnapshot's own restore)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torchsnapshot
from conftest import REPO, TORCHREVIVE, worker_env
from torch import nn
from torchsnapshot import knobs

import agent
from agent.checkpoint import Checkpointer, CheckpointError
from agent.checkpoint.checksums import BLOCK_BYTES, CHECKSUMS_FILE, data_files, load_checksums, sample
from agent.events import EventLog, read_events

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
SHAPES = {"0-d": (), "empty": (0,), "empty-2d": (3, 0), "small": (7,), "odd-2d": (3, 5), "large": (257, 1031)}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, dtype=dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bytes(a.contiguous().view(-1).view(torch.uint8).numpy()) == \
        bytes(b.contiguous().view(-1).view(torch.uint8).numpy())


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_every_dtype_and_shape_round_trips(tmp_path, monkeypatch, batched):
    if not batched:
        monkeypatch.setenv("TORCHSNAPSHOT_DISABLE_BATCHING", "1")
    torch.manual_seed(0)
    tensors = {f"{str(dt).removeprefix('torch.')}-{name}": random_tensor(dt, shape)
               for dt in DTYPES for name, shape in SHAPES.items()}
    chunked = {f"{str(dt).removeprefix('torch.')}-chunked": random_tensor(dt, (301, 97)) for dt in DTYPES}
    with knobs.override_max_chunk_size_bytes(4096):  # several chunks per "chunked" tensor
        Checkpointer(tmp_path, staging=False).save(1, {"s": torchsnapshot.StateDict(**tensors, **chunked)})
    expected = {**tensors, **chunked}
    assert (tmp_path / "step_1" / CHECKSUMS_FILE).is_file()

    ours = torchsnapshot.StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    agent.restore(tmp_path / "step_1", {"s": ours}, verify="full")
    theirs = torchsnapshot.StateDict({k: torch.zeros_like(v) for k, v in expected.items()})
    torchsnapshot.Snapshot(str(tmp_path / "step_1")).restore({"s": theirs})
    for key, value in expected.items():
        assert same_bits(ours[key], value), f"torchrevive restore of {key}"
        assert same_bits(theirs[key], value), f"torchsnapshot restore of {key}"


def test_a_dtype_the_format_cannot_hold_is_refused_before_writing(tmp_path):
    ckpt = Checkpointer(tmp_path, staging=False)
    with pytest.raises(CheckpointError, match=r"'s/scale' is torch.float8_e4m3fn, which torchsnapshot cannot store"):
        ckpt.save(1, {"s": torchsnapshot.StateDict(scale=torch.zeros(4, dtype=torch.float8_e4m3fn))})
    assert not (tmp_path / "step_1").exists()


def model_state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"model": nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 1536))}  # a 6 MB weight: two blocks


def weights(app: dict) -> torch.Tensor:
    return app["model"][1].weight.detach().clone()


def two_snapshots(tmp_path, verify: str = "full") -> Checkpointer:
    ckpt = Checkpointer(tmp_path, staging=False, verify=verify, events=EventLog(tmp_path / "events.jsonl"))
    ckpt.save(1, model_state(1))
    ckpt.save(2, model_state(2))
    return ckpt


def largest_data_file(snapshot):
    return max((snapshot / name for name in data_files(snapshot)), key=lambda p: p.stat().st_size)


def test_checksums_cover_every_file_in_blocks(tmp_path):
    two_snapshots(tmp_path)
    snapshot = tmp_path / "step_2"
    checksums = load_checksums(snapshot)
    assert set(checksums.files) == set(data_files(snapshot, skip=(".torchrevive_commit",)))
    big = largest_data_file(snapshot)
    digest = checksums.files[str(big.relative_to(snapshot))]
    assert digest.size == big.stat().st_size and len(digest.blocks) == -(-digest.size // BLOCK_BYTES) > 1


def flip_one_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_one_flipped_byte_makes_full_verify_fall_back(tmp_path):
    ckpt = two_snapshots(tmp_path, verify="full")
    damaged = largest_data_file(tmp_path / "step_2")
    flip_one_byte(damaged, damaged.stat().st_size - 3)
    target = model_state(0)
    with pytest.warns(UserWarning, match=rf"falling back from .*step_2: {damaged}: bytes \d+\.\.\d+ do not match their "
                                          r"checksum; it holds 'model/"):
        assert ckpt.restore(target) == 1
    assert torch.equal(weights(target), weights(model_state(1)))
    events = read_events(tmp_path / "events.jsonl")
    fallback = next(e for e in events if e["event"] == "restore_fallback")
    assert fallback["snapshot"].endswith("step_2") and "do not match their checksum" in fallback["error"]
    assert any(e["event"] == "restore_done" and e["step"] == 1 for e in events)


def test_sample_verify_catches_a_rewritten_file_by_its_size(tmp_path):
    ckpt = two_snapshots(tmp_path, verify="sample")
    damaged = largest_data_file(tmp_path / "step_2")
    with open(damaged, "ab") as f:  # every chunk still fits: only the recorded size tells
        f.write(b"appended")
    target = model_state(0)
    with pytest.warns(UserWarning, match=rf"{damaged}: \d+ bytes, \d+ when committed \(truncated or rewritten\)"):
        assert ckpt.restore(target) == 1
    assert torch.equal(weights(target), weights(model_state(1)))


def test_sample_verify_hashes_a_small_fraction(tmp_path):
    two_snapshots(tmp_path)
    snapshot = tmp_path / "step_2"
    full = agent.restore(snapshot, model_state(0), verify="full")
    sampled = agent.restore(snapshot, model_state(0), verify="sample")
    off = agent.restore(snapshot, model_state(0), verify="off")
    assert full.bytes_verified >= full.bytes_read > 0 and off.bytes_verified == 0
    # exactly the blocks sample() picks, of the files the restore reads (file names torchsnapshot
    # draws at random decide which blocks: the fraction itself varies on a snapshot this small)
    checksums = load_checksums(snapshot)
    picked = [checksums.block_range(location, block) for location, digest in checksums.files.items()
              if location != ".snapshot_metadata" for block in sample(location, range(len(digest.blocks)))]
    assert sampled.bytes_verified == sum(hi - lo for lo, hi in picked) < full.bytes_verified


def test_deleted_metadata_falls_back(tmp_path):
    ckpt = two_snapshots(tmp_path)
    (tmp_path / "step_2" / ".snapshot_metadata").unlink()
    target = model_state(0)
    with pytest.warns(UserWarning, match=r"step_2/.snapshot_metadata: missing"):
        assert ckpt.restore(target) == 1
    assert torch.equal(weights(target), weights(model_state(1)))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*TORCHREVIVE, *args], capture_output=True, text=True, env=worker_env(), timeout=120)


def test_verify_cli_passes_then_names_the_bad_chunk(tmp_path):
    two_snapshots(tmp_path)
    snapshot = tmp_path / "step_2"
    ok = run_cli("verify", str(snapshot))
    assert ok.returncode == 0 and "ok," in ok.stdout and "files" in ok.stdout, ok.stderr
    inspect = run_cli("inspect", str(snapshot))
    assert inspect.returncode == 0 and "checksums   yes (" in inspect.stdout
    damaged = largest_data_file(snapshot)
    flip_one_byte(damaged, 5)
    bad = run_cli("verify", str(snapshot))
    assert bad.returncode == 1
    assert f"{damaged}: bytes 0..{min(BLOCK_BYTES, damaged.stat().st_size)} do not match their checksum" in bad.stderr


def test_verify_cli_checks_the_structure_of_a_plain_torchsnapshot(tmp_path):
    torchsnapshot.Snapshot.take(str(tmp_path / "plain"), model_state(3))
    ok = run_cli("verify", str(tmp_path / "plain"))
    assert ok.returncode == 0 and "no checksum record" in ok.stdout
    assert "checksums   no" in run_cli("inspect", str(tmp_path / "plain")).stdout
    damaged = largest_data_file(tmp_path / "plain")
    with open(damaged, "r+b") as f:
        f.truncate(100)
    bad = run_cli("verify", str(tmp_path / "plain"))
    assert bad.returncode == 1 and f"{damaged}: truncated (100 bytes; needs bytes" in bad.stderr


FULL_DISK_SCRIPT = textwrap.dedent("""
    import resource, signal, sys, torch
    from torch import nn
    from agent.checkpoint import Checkpointer, CheckpointError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    ckpt = Checkpointer(sys.argv[1], staging=False)
    torch.manual_seed(1)
    ckpt.save(1, {"model": nn.Linear(64, 64)})
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file may grow past 1 MiB
    try:
        ckpt.save(2, {"model": nn.Linear(1024, 1024)})  # a 4 MiB weight
    except CheckpointError as exc:
        print("ERROR", exc)
""")


def test_a_full_disk_fails_the_save_and_keeps_the_previous_snapshot(tmp_path):
    done = subprocess.run([sys.executable, "-c", FULL_DISK_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=worker_env(), cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ERROR" in done.stdout and "step_2: saving step 2 failed (" in done.stdout
    assert "File too large" in done.stdout and f"{tmp_path}/step_1 stays the latest committed one" in done.stdout
    assert not (tmp_path / "step_2").exists()
    ckpt = Checkpointer(tmp_path, staging=False, verify="full")
    torch.manual_seed(1)
    reference = nn.Linear(64, 64)
    target = {"model": nn.Linear(64, 64)}
    assert ckpt.restore(target) == 1 and torch.equal(target["model"].weight, reference.weight)


def test_events_record_saves_restores_and_the_first_step(tmp_path):
    log = tmp_path / "events.jsonl"
    ckpt = Checkpointer(tmp_path / "ckpt", interval_steps=2, staging=False, events=EventLog(log, node="n0"))
    app = model_state(1)
    ckpt.maybe_save(2, app)
    assert ckpt.restore(model_state(0)) == 2
    ckpt.maybe_save(3, app)
    events = read_events(log)
    assert [e["event"] for e in events] == ["save_committed", "restore_done", "first_step_done"]
    assert all(e["node"] == "n0" and e["time"] > 0 for e in events)
    assert events[1]["bytes"] > 0 and events[2]["step"] == 3
    assert json.loads((tmp_path / "ckpt" / "step_2" / ".torchrevive_commit").read_text())["step"] == 2

