"""Byte checksums of tensors: the verify-mode trailer (:func:`checksum`) and :func:`digest_of` (sha256)."""
from __future__ import annotations

import hashlib
from typing import Mapping

import torch

_CS_CHUNK = 1 << 20     # bytes per checksum chunk (bounds the temporary memory of verify mode)
_CS_MOD = 65521


def checksum(t: torch.Tensor) -> torch.Tensor:
    """Two int64 sums over the bytes of ``t`` (row-major): plain, and weighted by position (so
    swapped or shifted bytes are caught).  On ``t``'s device; temporaries <= 16 MiB."""
    b = t.detach().reshape(-1)
    if not b.is_contiguous():
        b = b.contiguous()
    b = b.view(torch.uint8)
    out = torch.zeros(2, dtype=torch.int64, device=b.device)
    for lo in range(0, b.numel(), _CS_CHUNK):
        x = b[lo:lo + _CS_CHUNK].to(torch.int64)
        w = torch.arange(lo, lo + x.numel(), dtype=torch.int64, device=b.device).remainder_(_CS_MOD).add_(1)
        out[0] += x.sum()
        out[1] += (x * w).sum()
    return out


def digest_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """sha256 (first 24 hex digits) of every tensor's bytes: to show in tests and tools that a
    refit left its source weights untouched."""
    out = {}
    for name, t in sorted(tensors.items()):
        b = t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes()
        out[name] = hashlib.sha256(b).hexdigest()[:24]
    return out
