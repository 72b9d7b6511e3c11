"""What a rank checks before a byte moves: its real tensors against the plan, memory aliasing,
and its part of the plan (:func:`check_binding` returns the problems, each naming tensor and rank)."""
from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist

from ..planner import Plan, validate_plan
from .common import dtype_name, group_ranks_hint


def check_tensors(plan: Plan, rank: int, side: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """Every tensor the plan gives ``rank`` on ``side`` is there, of its shape and dtype; nothing extra."""
    errors, missing = [], []
    want = plan.buffers[side].get(rank, {})
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            missing.append(f"rank {rank}: {side} tensor {name} {shape} {dtype} is missing")
        elif not isinstance(t, torch.Tensor):
            errors.append(f"rank {rank}: {side} tensor {name} is a {type(t).__name__}, not a torch.Tensor")
        elif list(t.shape) != list(shape) or dtype_name(t.dtype) != dtype:
            errors.append(f"rank {rank}: {side} tensor {name} is {list(t.shape)} {dtype_name(t.dtype)}, plan says {shape} {dtype}")
        elif side == "dst" and not t.is_contiguous():
            errors.append(f"rank {rank}: dst tensor {name} is not contiguous")
    if missing and len(missing) == len(want):   # all of them: a layout read for another rank, not one lost tensor
        missing = [f"{missing[0]}, and so is every other of the {len(want)} {side} tensor(s) the plan puts on this "
                   f"rank{_WRONG_RANK}"]
    errors = missing + errors
    extra = sorted(set(tensors) - set(want))
    if extra:
        errors.append(f"rank {rank}: {len(extra)} {side} tensor(s) the plan does not have on this rank: "
                      + ", ".join(extra[:8]) + (" ..." if len(extra) > 8 else "")
                      + (" (a destination tensor the plan never writes would silently keep old weights)" if side == "dst" else "")
                      + (_WRONG_RANK if not want else ""))
    return errors


_WRONG_RANK = (": was this side's layout read for another rank? read_hf_layout(model, rank) and read_layout(chunks, rank) "
               "take this process's rank in the refit group, dist.get_rank(group), not its global dist.get_rank()")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, last byte + 1) of the memory a tensor view can touch."""
    if t.numel() == 0:
        return 0, 0
    extent = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + extent * t.element_size()


def check_aliasing(rank: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor]) -> list[str]:
    """A destination tensor that shares memory with a source tensor (or another destination
    tensor) would overwrite the source weights or receive two writers."""
    spans = []
    for side, tensors in (("src", src), ("dst", dst)):
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.numel():
                lo, hi = _span(t)
                spans.append((t.device.type, t.device.index, lo, hi, side, name))
    spans.sort()
    errors = []
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            if b[:2] != a[:2] or b[2] >= a[3]:
                break
            if "dst" in (a[4], b[4]):
                x, y = sorted([a, b], key=lambda t: (t[4] != "src", t[5]))
                errors.append(f"rank {rank}: {x[4]} tensor {x[5]} and {y[4]} tensor {y[5]} share memory; a refit would "
                              + ("overwrite the source weights" if x[4] == "src" else "write both"))
        if len(errors) >= 8:
            break
    return errors


def check_binding(plan: Plan, rank: int, world: int, group, src: Mapping[str, torch.Tensor],
                  dst: Mapping[str, torch.Tensor], overlap: bool | None) -> list[str]:
    """Every problem that makes binding ``plan`` on ``rank`` unsafe ([] when sound)."""
    errors = []
    outside = [q for q in plan.ranks if not 0 <= q < world]
    if outside:
        errors.append(f"rank {rank}: plan ranks {outside[:8]}{' ...' if len(outside) > 8 else ''} are outside the "
                      f"process group of {world} rank(s) ({group_ranks_hint(world)})")
    errors += check_tensors(plan, rank, "src", src) + check_tensors(plan, rank, "dst", dst)
    errors += check_aliasing(rank, src, dst)
    backend = dist.get_backend(group)
    if overlap and backend != "gloo":
        errors.append(f"rank {rank}: overlap=True needs the gloo backend; this group uses {backend}, whose "
                      "point-to-point operations must stay in one batch_isend_irecv per round")
    errors += [f"rank {rank}: plan is inconsistent: {p}" for p in validate_plan(plan, rank, limit=5)]
    return errors
