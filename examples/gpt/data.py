"""Real text that needs no download: the Python standard library's own source files, as bytes (a
vocabulary of 256 tokens), cut into fixed windows. Every rank reads the same files in the same
order, so window i is the same tokens everywhere; `agent.ElasticSampler` decides who trains which.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset


def stdlib_text(max_bytes: int) -> bytes:
    """The first ``max_bytes`` of the standard library's ``.py`` files, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    text = b"".join(chunks)[:max_bytes]
    if len(text) < max_bytes // 2:
        raise RuntimeError(f"found only {len(text)} bytes of Python source under {root}")
    return text


class TokenWindows(Dataset):
    """Window ``i``: (input tokens ``[i*L, (i+1)*L)``, the same shifted by one as targets, ``i``)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        start = index * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].long()
        return window[:-1], window[1:], index


def stdlib_windows(seq_len: int, max_bytes: int) -> TokenWindows:
    return TokenWindows(torch.frombuffer(bytearray(stdlib_text(max_bytes)), dtype=torch.uint8), seq_len)
