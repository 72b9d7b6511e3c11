"""Test helpers: apply a plan in one process by plain slicing, and an independent lower bound.

``apply_plan`` mirrors what the executor does (local copies, message entries, zero padding) with
plain tensor indexing on per-rank dicts, so planner properties can be checked on thousands of
random cases without processes.  ``brute_lower_bound`` counts, element by element with numpy,
the bytes each destination rank needs and does not hold: it shares no code with the planner.
"""
from __future__ import annotations

import numpy as np
import torch

from mcore_reshard.core.layout import Layout, itemsize


def apply_plan(plan, S: dict, D: dict) -> np.ndarray | None:
    for c in plan.local_copies:
        D[c.dst][c.dst_buffer][c.dst_local.slices()] = S[c.src][c.src_buffer][c.src_local.slices()].reshape(c.dst_local.sizes)
    # round by round: a forwarded message (two-level plans) reads the sender's destination buffer,
    # written in an earlier round
    for m in sorted(plan.messages, key=lambda m: m.round):
        have = D if getattr(m, "forward", False) else S
        for c in m.entries:
            D[c.dst][c.dst_buffer][c.dst_local.slices()] = have[c.src][c.src_buffer][c.src_local.slices()].reshape(c.dst_local.sizes)
    for r, b, box in plan.padding:
        D[r][b][box.slices()] = 0


def write_counts(plan, dst: Layout) -> dict:
    """How many times each destination buffer element is written by the plan (padding included)."""
    counts = {r: {n: np.zeros(b.shape, dtype=np.int64) for n, b in bufs.items()} for r, bufs in dst.buffers.items()}
    for c in list(plan.local_copies) + [c for m in plan.messages for c in m.entries]:
        counts[c.dst][c.dst_buffer][c.dst_local.slices()] += 1
    for r, b, box in plan.padding:
        counts[r][b][box.slices()] += 1
    return counts


def brute_lower_bound(src: Layout, dst: Layout) -> int:
    held = {}
    for r, buf, p in src.iter_pieces():
        key = (r, p.tensor)
        if key not in held:
            held[key] = np.zeros(src.tensors[p.tensor].shape, dtype=bool)
        held[key][p.box.slices()] = True
    total = 0
    for r, buf, p in dst.iter_pieces():
        need = np.ones(p.box.sizes, dtype=bool)
        mine = held.get((r, p.tensor))
        if mine is not None:
            need &= ~mine[p.box.slices()]
        total += int(need.sum()) * itemsize(src.tensors[p.tensor].dtype)
    return total


def random_full(layout: Layout, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(m.shape, generator=g) for n, m in sorted(layout.tensors.items())}
