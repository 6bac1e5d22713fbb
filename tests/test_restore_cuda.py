"""CUDA destinations: pinned-buffer staging and asynchronous host-to-device copies."""

from __future__ import annotations

import pytest
import torch
import torchsnapshot
from torch import nn

import agent

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 2048))  # 64 MB of weights: many staged pieces


def test_restore_into_cuda_tensors(tmp_path):
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"model": model(0)})
    dest = model(1).cuda()
    agent.restore(tmp_path / "s", {"model": dest})
    torch.cuda.synchronize()
    for got, want in zip(dest.state_dict().values(), model(0).state_dict().values()):
        assert torch.equal(got.cpu(), want)


def test_copies_wait_for_the_work_queued_on_the_current_stream(tmp_path):
    """The destination is still being written on the caller's stream (a long kernel, then a fill)
    when the restore starts: the restored values must land after that fill, not under it."""
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"model": model(0)})
    dest = model(1).cuda()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda._sleep(1 << 30)  # about a second of GPU time on the caller's current stream
        for p in dest.parameters():
            p.data.fill_(-1.0)
        agent.restore(tmp_path / "s", {"model": dest})
        for got, want in zip(dest.state_dict().values(), model(0).state_dict().values()):
            assert torch.equal(got.cpu(), want)


def test_pinned_staging_stays_within_pinned_mb(tmp_path):
    torchsnapshot.Snapshot.take(str(tmp_path / "s"), {"model": model(0)})
    dest = model(1).cuda()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_host_memory_stats()
    before = torch.cuda.host_memory_stats().get("active_bytes.current", 0)
    agent.restore(tmp_path / "s", {"model": dest}, pinned_mb=8, io_threads=4)
    peak = torch.cuda.host_memory_stats()["active_bytes.peak"]
    assert peak - before <= 8 << 20, peak
    for got, want in zip(dest.state_dict().values(), model(0).state_dict().values()):
        assert torch.equal(got.cpu(), want)
