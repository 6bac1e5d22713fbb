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
