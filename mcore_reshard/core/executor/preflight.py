"""What a rank checks before a byte moves: its real tensors against the plan, memory aliasing,
and its part of the plan (:func:`check_binding` returns the problems, each naming tensor and rank)."""
from __future__ import annotations

from typing import Mapping, NamedTuple

import torch
import torch.distributed as dist

from ..planner import Plan, validate_plan
from .binding import staging_size
from .common import dtype_name, group_ranks_hint, torch_dtype


def check_arguments(plan, src, dst, layouts) -> None:
    """TypeError naming the argument unless ``plan`` is a plan (:func:`make_plan` /
    ``Plan.from_json``), ``src`` / ``dst`` mappings of names to tensors and ``layouts`` None or a
    (source, destination) pair of layouts; local, before anything is exchanged."""
    from ..layout import Layout
    from ..planner import TemplatedPlan
    if not isinstance(plan, (Plan, TemplatedPlan)):
        raise TypeError(f"plan={type(plan).__name__} {str(plan)[:60]!r}: must be a Plan (make_plan, or Plan.from_json "
                        "for plan JSON)")
    for what, given in (("src", src), ("dst", dst)):
        if not isinstance(given, Mapping):
            raise TypeError(f"{what}={type(given).__name__}: must be a mapping of buffer names to tensors")
    if layouts is not None and not (isinstance(layouts, (tuple, list)) and len(layouts) == 2
                                    and all(isinstance(x, Layout) for x in layouts)):
        raise TypeError(f"layouts={str(layouts)[:60]!r}: must be None or a (source Layout, destination Layout) pair")


def member_rank(group, what: str) -> int:
    """This process's rank in ``group``; ValueError naming it and the group's ranks when it is
    not a member (torch would raise "Invalid process group specified" in the next call)."""
    try:
        rank = dist.get_rank(group)
    except Exception as e:  # noqa: BLE001 - not a process group at all
        raise ValueError(f"group={group!r}: not a process group of this process ({type(e).__name__}: {e})") from e
    if rank < 0:
        try:
            ranks = dist.get_process_group_ranks(group)
        except Exception:  # noqa: BLE001
            ranks = "unknown"
        raise ValueError(f"rank {dist.get_rank()} (global) cannot {what}: it is not a member of the process group "
                         f"given (global ranks {ranks}); only the group's members take part in its refits")
    return rank


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


_EXACT_MAX = 1 << 24    # elements: views up to this size get the exact bytes-touched overlap test


def _starts(t: torch.Tensor) -> torch.Tensor:
    """Sorted byte addresses of every element of ``t`` (int64, on the CPU)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return (offsets.reshape(-1) * t.element_size() + t.data_ptr()).sort().values


def touch_same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether views ``a`` and ``b`` (whose spans overlap) touch a common byte: interleaved strided
    views of one storage (``x[:, :4]`` and ``x[0, 4:12]``) do not.  Exact up to ``_EXACT_MAX``
    elements each; larger views are compared by span (conservative: may refuse disjoint views)."""
    if a.numel() > _EXACT_MAX or b.numel() > _EXACT_MAX:
        return True
    sa, sb = _starts(a), _starts(b)
    ea, eb = a.element_size(), b.element_size()
    # the element of a starting last before each element of b ends; equal sizes: it ends last
    k = torch.searchsorted(sa, sb + eb, right=False) - 1
    ok = k >= 0
    return bool((sa[k.clamp(min=0)] + ea > sb)[ok].any())


class _Span(NamedTuple):
    """The bytes ``[lo, hi)`` a bound tensor can touch, on its device (sorted by device, then start)."""
    device: str
    index: int | None
    lo: int
    hi: int
    side: str      # "src", "dst" or "staging"
    name: str


def check_aliasing(rank: int, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                   staging: torch.Tensor | None = None) -> list[str]:
    """A destination tensor (or the staging buffer) that shares memory with a source tensor, or
    with another destination tensor, would overwrite the source weights or receive two writers."""
    spans = []
    sides = [("src", src), ("dst", dst)] + ([("staging", {"buffer": staging})] if staging is not None else [])
    for side, tensors in sides:
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.numel() and t.device.type != "meta":
                lo, hi = _span(t)
                spans.append(_Span(t.device.type, t.device.index, lo, hi, side, name))
    spans.sort()
    errors = []

    def tensor(x: _Span):
        return staging if x.side == "staging" else (src if x.side == "src" else dst)[x.name]

    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            if (b.device, b.index) != (a.device, a.index) or b.lo >= a.hi:
                break
            if {"dst", "staging"} & {a.side, b.side} and touch_same_bytes(tensor(a), tensor(b)):
                x, y = sorted([a, b], key=lambda t: ({"src": 0, "dst": 1}.get(t.side, 2), t.name))
                errors.append(f"rank {rank}: {x.side} tensor {x.name} and {y.side} "
                              f"{'buffer' if y.side == 'staging' else 'tensor ' + y.name} "
                              "share memory; a refit would " + ("overwrite the source weights" if x.side == "src" else "write both"))
        if len(errors) >= 8:
            break
    return errors


def check_devices(rank: int, group, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                  staging) -> list[str]:
    """No tensor on the meta device (no storage: nothing would land), all on one device, and on
    NCCL that device is this rank's current CUDA device; a user staging buffer is a 1-D
    contiguous uint8 tensor."""
    errors = []
    items = [(side, n, t) for side, d in (("src", src), ("dst", dst)) for n, t in d.items() if isinstance(t, torch.Tensor)]
    if staging is not None:
        if not isinstance(staging, torch.Tensor):
            return [f"rank {rank}: staging is a {type(staging).__name__}, not a torch.Tensor"]
        if staging.dtype != torch.uint8 or staging.dim() != 1 or not staging.is_contiguous():
            errors.append(f"rank {rank}: staging must be a 1-D contiguous uint8 tensor, got {list(staging.shape)} "
                          f"{dtype_name(staging.dtype)}{'' if staging.is_contiguous() else ' (not contiguous)'}")
        items.append(("staging", "buffer", staging))
    for side, n, t in items:
        if t.device.type == "meta":
            errors.append(f"rank {rank}: {side} {'tensor ' + n if side != 'staging' else 'buffer'} is on the meta "
                          "device (no storage: nothing would land)")
    devices = sorted({str(t.device) for _, _, t in items})
    if len(devices) > 1:
        by = {d: [f"{side} {n}" for side, n, t in items if str(t.device) == d][:3] for d in devices}
        errors.append(f"rank {rank}: tensors on more than one device: " + "; ".join(f"{d}: {', '.join(v)}" for d, v in by.items()))
    if dist.get_backend(group) == "nccl" and devices:
        want = f"cuda:{torch.cuda.current_device()}"
        for side, n, t in items:
            if str(t.device) != want:
                errors.append(f"rank {rank}: {side} {n} is on {t.device}; this NCCL group communicates on {want}")
                break
    return errors


def check_unstaged_views(plan: Plan, rank: int, src: Mapping[str, torch.Tensor],
                         dst: Mapping[str, torch.Tensor]) -> list[str]:
    """Every entry of an unstaged message (:attr:`Message.unstaged`) of ``rank`` goes straight from /
    into a view of this rank's tensor: that view must be contiguous and of the wire's dtype (the
    plan's source dtype), or the message cannot go without staging.  A forwarded message reads
    this rank's destination tensors."""
    errors = []
    for m in plan.messages:
        if not m.unstaged or rank not in (m.src, m.dst):
            continue
        for c in m.entries:
            want = torch_dtype(plan.tensors[c.tensor]["src_dtype"])
            for side, r, bname, local in (("dst" if m.forward else "src", c.src, c.src_buffer, c.src_local),
                                          ("dst", c.dst, c.dst_buffer, c.dst_local)):
                if r != rank:
                    continue
                t = (dst if side == "dst" else src)[bname]
                v = t[local.slices()]
                if not v.is_contiguous() or v.dtype != want or v.numel() * v.element_size() != c.nbytes:
                    errors.append(f"rank {rank}: round {m.round} unstaged message {m.src}->{m.dst}: {c.tensor}{c.box} "
                                  f"{side} tensor {bname} {list(t.shape)} {dtype_name(t.dtype)} region {local} is "
                                  + ("not contiguous" if not v.is_contiguous() else f"not {dtype_name(want)}")
                                  + f" (strides {list(t.stride())}): it cannot go straight from / into the tensor")
                    if len(errors) >= 8:
                        return errors
    return errors


def check_layouts(plan: Plan, rank: int, src_layout, dst_layout) -> list[str]:
    """``plan`` is what the layouts it claims to come from give ``rank``: tensor shapes and
    dtypes, this rank's buffers, and every copy's local boxes (the piece holding its global box,
    mapped to local coordinates) on this rank's side."""
    errors = []
    for name, meta in plan.tensors.items():
        s, d = src_layout.tensors.get(name), dst_layout.tensors.get(name)
        if s is None or d is None:
            errors.append(f"rank {rank}: tensor {name} of the plan is not in the {'source' if s is None else 'destination'} layout")
        elif list(meta["shape"]) != list(d.shape) or meta["src_dtype"] != s.dtype or meta["dst_dtype"] != d.dtype:
            errors.append(f"rank {rank}: tensor {name}: plan says {list(meta['shape'])} {meta['src_dtype']} -> "
                          f"{meta['dst_dtype']}, the layouts say {list(d.shape)} {s.dtype} -> {d.dtype}")
    for side, lay in (("src", src_layout), ("dst", dst_layout)):
        have = lay.buffers.get(rank, {})
        for name, (shape, dtype) in plan.buffers.get(side, {}).get(rank, {}).items():
            b = have.get(name)
            if b is None or list(b.shape) != list(shape) or b.dtype != dtype:
                errors.append(f"rank {rank}: {side} buffer {name} {list(shape)} {dtype} of the plan is "
                              + ("not in the layout" if b is None else f"{list(b.shape)} {b.dtype} in the layout"))
    copies = [(c, False) for c in plan.local_copies if c.dst == rank] + [
        (c, m.forward) for m in plan.messages if rank in (m.src, m.dst) for c in m.entries]
    for c, fwd in copies:       # a forwarded copy's source is in the sender's destination layout
        for side, lay, r, bname, local in (("dst" if fwd else "src", dst_layout if fwd else src_layout, c.src,
                                            c.src_buffer, c.src_local),
                                           ("dst", dst_layout, c.dst, c.dst_buffer, c.dst_local)):
            if r != rank:
                continue
            b = lay.buffers.get(rank, {}).get(bname)
            pieces = [p for p in (b.pieces if b else ()) if p.tensor == c.tensor and p.box.contains(c.box)]
            if not any(p.local_of(c.box) == local for p in pieces):
                errors.append(f"rank {rank}: copy of {c.tensor}{c.box} {side} {bname}{local} is not where the {side} "
                              f"layout holds it ({[str(p.local_of(c.box)) for p in pieces] or 'no piece holds that box'})")
        if len(errors) >= 8:
            break
    return errors


def own_part(plan: Plan, rank: int) -> tuple[Plan, list[str]]:
    """(what ``rank`` binds, problems): a templated plan's part of ``rank`` (from its templates alone),
    unless the caller already made its whole views (``messages``, ``local_copies``, ``padding`` or
    ``buffers``: those are then what is checked and bound, as they are, edits included); any other
    plan as it is.  A part that cannot be made is a problem (the plan itself then)."""
    part = getattr(plan, "part", None)
    if part is None or plan.views_made:
        return plan, []
    try:
        return part(rank), []
    except Exception as e:  # noqa: BLE001 - a crash on a tampered plan must still reach every rank
        return plan, [f"rank {rank}: the plan's part of this rank cannot be made: {type(e).__name__}: {str(e)[:300]}"]


def check_binding(plan: Plan, rank: int, world: int, group, src: Mapping[str, torch.Tensor],
                  dst: Mapping[str, torch.Tensor], overlap: bool | None, staging=None, layouts=None,
                  ranks=None) -> list[str]:
    """Every problem that makes binding ``plan`` (the whole plan, or this rank's part of it) on
    ``rank`` unsafe ([] when sound); ``ranks``: the whole plan's ranks (default: ``plan.ranks``)."""
    errors = []
    outside = [q for q in (plan.ranks if ranks is None else ranks) if not 0 <= q < world]
    if outside:
        errors.append(f"rank {rank}: plan ranks {outside[:8]}{' ...' if len(outside) > 8 else ''} are outside the "
                      f"process group of {world} rank(s) ({group_ranks_hint(world)})")
    errors += check_tensors(plan, rank, "src", src) + check_tensors(plan, rank, "dst", dst)
    errors += check_devices(rank, group, src, dst, staging)
    errors += check_aliasing(rank, src, dst, staging if isinstance(staging, torch.Tensor) else None)
    backend = dist.get_backend(group)
    if overlap and backend != "gloo":
        errors.append(f"rank {rank}: overlap=True needs the gloo backend; this group uses {backend}, whose "
                      "point-to-point operations must stay in one batch_isend_irecv per round")
    problems = validate_plan(plan, rank, limit=5)
    if not problems:
        need = staging_size(plan, rank)     # staged messages only: an unstaged one takes no staging
        if need > plan.budget_bytes:
            problems.append(f"rank {rank} would stage {need} B in one round, over the plan's budget of {plan.budget_bytes} B")
    errors += [f"rank {rank}: plan is inconsistent: {p}" for p in problems]
    if not problems and not errors:
        errors += check_unstaged_views(plan, rank, src, dst)
    if layouts is not None and not problems:
        errors += check_layouts(plan, rank, *layouts)
    return errors
