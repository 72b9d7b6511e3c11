"""Self-consistency check of a plan (:func:`validate_plan`), pure Python."""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict

from ..box import Box
from ..gcpause import paused_gc
from ..layout import itemsize
from .index import _uncovered
from .plan import ALIGN, Copy, Plan, contiguous


@paused_gc()
def validate_plan(plan: Plan, rank: int | None = None, limit: int = 20) -> list[str]:
    """Self-consistency of a plan (one received over the wire, loaded from JSON or built by hand),
    pure Python: the problems found, each naming tensor, ranks, buffer and region ([] when sound).

    Checks every copy that involves ``rank`` (every copy when ``rank`` is None): tensor, buffers
    and ranks known to the plan; global/local boxes of equal size, inside their tensor and buffers;
    byte counts; message entries 16-byte aligned, inside their message and not overlapping; at
    most one message per (round, src, dst) and rounds below ``plan.rounds``; each rank's staged
    bytes per round (sends + receives of its messages that are not unstaged) within the budget;
    every entry of an unstaged message contiguous in both its buffers, of a tensor not cast; and, for each
    destination buffer of ``rank``, that the copies and zero padding write every element exactly
    once (two pieces claiming the same region, or a region nobody writes, are reported).
    """
    # a TemplatedPlan is checked through its views (made on first use), i.e. exactly what an executor
    # holding it would run; plan_part(plan, rank) is the cheap way to check one rank of it
    problems: list[str] = []

    def bad(text: str) -> bool:
        if len(problems) < limit:
            problems.append(text)
        return True

    def buffer_meta(side: str, r: int, name: str):
        return plan.buffers.get(side, {}).get(r, {}).get(name)

    writes: dict[tuple[int, str], list[tuple[Box, str]]] = defaultdict(list)
    # (rank, dst buffer) -> (dst local box, copy, stage: -1 local, else round): what a forwarded
    # copy reads must have landed in an earlier stage
    landed: dict[tuple[int, str], list[tuple[Box, Copy, int]]] = defaultdict(list)
    forwarded: list[tuple[Copy, int, str]] = []
    stage = -1

    def ints(*xs) -> bool:
        return all(type(x) is int for x in xs)

    if not ints(plan.budget_bytes, plan.rounds) or plan.budget_bytes < 1024 or plan.rounds < 0:
        bad(f"plan budget_bytes={plan.budget_bytes!r} / rounds={plan.rounds!r}: must be integers (budget >= 1024)")
        if not ints(plan.budget_bytes, plan.rounds):     # every later check compares with them
            return problems
    shape_problems = _malformed_shapes(plan)
    if shape_problems:           # every later check reads these shapes: stop here
        return shape_problems[:limit]

    fulls: dict[tuple, Box] = {}        # shape -> Box.full(shape): a few shapes, checked per copy

    def check_copy(c: Copy, where: str, fwd: bool = False) -> None:
        meta = plan.tensors.get(c.tensor)
        if meta is None:
            bad(f"{where}: tensor {c.tensor} is not in the plan's tensors")
            return
        if not ints(c.src, c.dst, c.nbytes, c.offset, *c.box.offsets, *c.box.sizes, *c.src_local.offsets,
                    *c.src_local.sizes, *c.dst_local.offsets, *c.dst_local.sizes):
            bad(f"{where}: copy of {c.tensor}: ranks, boxes, offset and byte count must be integers: {list(c)}")
            return
        if c.box.ndim != len(meta["shape"]) or not _full(fulls, meta["shape"]).contains(c.box):
            bad(f"{where}: box {c.box} is outside tensor {c.tensor} of shape {list(meta['shape'])}")
        if fwd and meta["src_dtype"] != meta["dst_dtype"]:
            bad(f"{where}: forwarded copy of {c.tensor}{c.box}: the tensor is cast ({meta['src_dtype']} -> "
                f"{meta['dst_dtype']}): rank {c.src}'s destination does not hold the bytes on the wire")
        for side, r, bname, local in (("dst" if fwd else "src", c.src, c.src_buffer, c.src_local),
                                      ("dst", c.dst, c.dst_buffer, c.dst_local)):
            bm = buffer_meta(side, r, bname)
            if bm is None:
                bad(f"{where}: {side} rank {r} has no buffer {bname} in the plan")
                continue
            shape = bm[0]
            if local.ndim != len(shape) or not _full(fulls, shape).contains(local):
                bad(f"{where}: {side} local box {local} is outside rank {r} buffer {bname} of shape {list(shape)}")
            if local.numel != c.box.numel:
                bad(f"{where}: {side} local box {local} of rank {r} buffer {bname} has {local.numel} elements, "
                    f"global box {c.box} has {c.box.numel}")
            elif [x for x in local.sizes if x != 1] != [x for x in c.box.sizes if x != 1]:
                bad(f"{where}: {side} local box {local} of rank {r} buffer {bname} and global box {c.box} of "
                    f"{c.tensor} differ in shape (sizes must agree once size-1 dims are dropped)")
            if bm[1] != meta[f"{side}_dtype"]:
                bad(f"{where}: {side} rank {r} buffer {bname} is {bm[1]}, the plan's tensor {c.tensor} says "
                    f"{side}_dtype {meta[f'{side}_dtype']}")
        want = c.box.numel * itemsize(meta["src_dtype"])
        if c.nbytes != want:
            bad(f"{where}: copy of {c.tensor}{c.box} claims {c.nbytes} B, {c.box.numel} x {meta['src_dtype']} is {want} B")
        if rank is None or c.dst == rank:
            writes[(c.dst, c.dst_buffer)].append((c.dst_local, f"{c.tensor}{c.box} from rank {c.src}"))
            landed[(c.dst, c.dst_buffer)].append((c.dst_local, c, stage))

    for c in plan.local_copies:
        if rank is not None and c.dst != rank and c.src != rank:
            continue
        where = f"local copy on rank {c.dst}"
        if c.src != c.dst:
            bad(f"{where}: local copy of {c.tensor}{c.box} goes from rank {c.src} to rank {c.dst}")
        check_copy(c, where)
    seen: set[tuple] = set()
    staged: dict[tuple[int, int], int] = defaultdict(int)     # (round, rank) -> staged bytes
    for m in plan.messages:
        if rank is not None and rank not in (m.src, m.dst):
            continue
        fwd = getattr(m, "forward", False)
        direct = getattr(m, "unstaged", False)
        where = (f"round {m.round} {'forwarded ' if fwd is True else ''}{'unstaged ' if direct is True else ''}"
                 f"message {m.src}->{m.dst}")
        stage = m.round
        if fwd is not False and fwd is not True or direct is not False and direct is not True:
            bad(f"{where}: forward={fwd!r} / unstaged={direct!r} must be True or False")
            continue
        if not ints(m.round, m.src, m.dst, m.nbytes):
            bad(f"{where}: round, ranks and byte count must be integers")
            continue
        if not 0 <= m.round < plan.rounds:
            bad(f"{where}: round {m.round} is outside the plan's {plan.rounds} round(s)")
        if m.src == m.dst:
            bad(f"{where}: a message from a rank to itself")
        if (m.round, m.src, m.dst, fwd, direct) in seen:
            bad(f"{where}: two messages for the same round and rank pair")
        seen.add((m.round, m.src, m.dst, fwd, direct))
        if not direct:
            staged[(m.round, m.src)] += m.nbytes
            staged[(m.round, m.dst)] += m.nbytes
        spans = []
        for c in m.entries:
            if (c.src, c.dst) != (m.src, m.dst):
                bad(f"{where}: entry {c.tensor}{c.box} goes {c.src}->{c.dst}")
            if c.offset < 0 or c.offset % ALIGN or c.offset + c.nbytes > m.nbytes:
                bad(f"{where}: entry {c.tensor}{c.box} at byte {c.offset} (+{c.nbytes}) is misaligned or outside "
                    f"the {m.nbytes} B message")
            spans.append((c.offset, c.offset + c.nbytes, c.tensor))
            check_copy(c, where, fwd)
            if direct:
                _check_unstaged(plan, c, fwd, where, bad)
            if fwd and (rank is None or c.src == rank):
                forwarded.append((c, m.round, where))
        spans.sort()
        if direct and spans and m.nbytes != (spans[-1][1] + ALIGN - 1) // ALIGN * ALIGN:
            # nothing staged, so no budget bounds it: its byte count is exactly its entries' layout
            bad(f"{where}: claims {m.nbytes} B, its entries end at byte {spans[-1][1]}")
        for (a0, a1, ta), (b0, b1, tb) in zip(spans, spans[1:]):
            if b0 < a1:
                bad(f"{where}: entries {ta} and {tb} overlap in the staging buffer (bytes {b0}..{a1})")
    for (k, r), n in sorted(staged.items()):
        if n > plan.budget_bytes and (rank is None or r == rank):
            bad(f"rank {r} stages {n} B in round {k} (sends + receives of its staged messages), over the plan's "
                f"budget of {plan.budget_bytes} B")
    _check_forwards(forwarded, landed, bad)
    for r, b, box in plan.padding:
        if rank is not None and r != rank:
            continue
        bm = buffer_meta("dst", r, b)
        if bm is None:
            bad(f"padding on rank {r}: no destination buffer {b} in the plan")
        elif box.ndim != len(bm[0]) or not Box.full(bm[0]).contains(box):
            bad(f"padding on rank {r}: region {box} is outside buffer {b} of shape {list(bm[0])}")
        else:
            writes[(r, b)].append((box, "zero padding"))
    _check_writes(plan, rank, writes, bad)
    return problems


def _check_writes(plan: Plan, rank: int | None, writes: dict, bad) -> None:
    """Every element of each destination buffer (of ``rank``) written exactly once by ``writes``."""
    for r, bufs in sorted(plan.buffers.get("dst", {}).items()):
        if rank is not None and r != rank:
            continue
        for name, (shape, _) in sorted(bufs.items()):
            # a box of another rank than the buffer's was reported where it was found; not compared here
            boxes = sorted((w for w in writes.get((r, name), []) if w[0].ndim == len(shape)), key=lambda x: x[0])
            overlap = False
            for i, (a, what_a) in enumerate(boxes):
                for b, what_b in boxes[i + 1:]:
                    if a.ndim and b.offsets[0] >= a.ends[0]:
                        break
                    inter = a.intersect(b)
                    if inter is not None:
                        overlap = bad(f"destination rank {r} buffer {name}: region {inter} is written twice "
                                      f"({what_a} and {what_b})")
                        break
                if overlap:
                    break
            total = 1
            for s in shape:
                total *= s
            written = sum(b.numel for b, _ in boxes)
            if not overlap and written != total:
                hole = _uncovered(Box.full(shape), [b for b, _ in boxes]) if written < total else None
                bad(f"destination rank {r} buffer {name} of shape {list(shape)}: the plan writes {written} of its "
                    f"{total} elements" + (f"; nothing writes {hole}" if hole is not None else ""))


def _check_unstaged(plan: Plan, c: Copy, fwd: bool, where: str, bad) -> None:
    """An entry of an unstaged message goes straight from its source view into its destination view:
    both must be contiguous in their buffers (as the plan's buffer shapes give them) and of the
    wire's dtype (the tensor not cast)."""
    meta = plan.tensors.get(c.tensor)
    if meta is None:
        return      # reported by check_copy
    if meta["src_dtype"] != meta["dst_dtype"]:
        bad(f"{where}: unstaged copy of {c.tensor}{c.box}: the tensor is cast ({meta['src_dtype']} -> "
            f"{meta['dst_dtype']}): it cannot go straight from one tensor into the other")
        return
    for side, r, bname, local in (("dst" if fwd else "src", c.src, c.src_buffer, c.src_local),
                                  ("dst", c.dst, c.dst_buffer, c.dst_local)):
        bm = plan.buffers.get(side, {}).get(r, {}).get(bname)
        if bm is not None and local.ndim == len(bm[0]) and not contiguous(local.sizes, bm[0]):
            bad(f"{where}: unstaged copy of {c.tensor}{c.box}: {side} local box {local} of rank {r} buffer {bname} "
                f"of shape {list(bm[0])} is not contiguous (an unstaged copy goes straight from / into its tensor)")


def _full(fulls: dict, shape) -> Box:
    """``Box.full(shape)``, made once per shape in ``fulls`` (unhashable sizes, of a tampered plan:
    ``Box.full`` says what is wrong)."""
    try:
        got = fulls.get(tuple(shape))
    except TypeError:
        return Box.full(shape)
    if got is None:
        got = fulls[tuple(shape)] = Box.full(shape)
    return got


def _check_forwards(forwarded: list, landed: dict, bad) -> None:
    """:func:`_check_forwarded` for every forwarded copy, against what landed in a bisect window of
    its sender's buffer (by first local offset)."""
    windows: dict[tuple[int, str], tuple] = {}
    for c, k, where in forwarded:
        key = (c.src, c.src_buffer)
        win = windows.get(key)
        if win is None:
            got = sorted(landed.get(key, ()), key=lambda x: x[0].offsets[:1])
            win = windows[key] = (got, [x[0].offsets[0] if x[0].ndim else 0 for x in got],
                                  max((x[0].sizes[0] if x[0].ndim else 1 for x in got), default=1))
        got, starts, widest = win
        if c.src_local.ndim:
            lo = c.src_local.offsets[0]
            got = got[bisect_left(starts, lo - widest + 1):bisect_left(starts, lo + c.src_local.sizes[0])]
        _check_forwarded(c, k, got, where, bad)


def _check_forwarded(c: Copy, k: int, landed, where: str, bad) -> None:
    """A forwarded copy (round ``k``) reads ``c.src_local`` of rank ``c.src``'s destination buffer:
    copies of the same tensor region, landed there in a stage before ``k``, must fill exactly it."""
    want = c.src_local
    if not all(type(x) is int for x in (*want.offsets, *want.sizes, *c.box.offsets, *c.box.sizes)):
        return          # non-integer boxes: reported by the copy's own check
    delta = tuple(a - b for a, b in zip(want.offsets, c.box.offsets)) if want.ndim == c.box.ndim else None
    covered = 0
    for box, w, stage in landed:
        if box.ndim != want.ndim or not all(type(x) is int for x in (*box.offsets, *box.sizes)):   # another buffer's geometry: reported where that copy was checked
            bad(f"{where}: forwarded copy of {c.tensor}{c.box} reads {want} of rank {c.src} buffer {c.src_buffer}, "
                f"which also receives {w.tensor}{w.box} as {box} (a box of another rank)")
            continue
        inter = box.intersect(want)
        if inter is None:
            continue
        if stage >= k:
            bad(f"{where}: forwarded copy of {c.tensor}{c.box} reads rank {c.src} buffer {c.src_buffer}{want}, "
                f"which {w.tensor}{w.box} from rank {w.src} writes only in round {stage} (forwarding round {k} "
                "must come after)")
            return
        wdelta = tuple(a - b for a, b in zip(box.offsets, w.box.offsets)) if box.ndim == w.box.ndim else None
        if w.tensor != c.tensor or wdelta != delta:
            bad(f"{where}: forwarded copy of {c.tensor}{c.box} reads rank {c.src} buffer {c.src_buffer}{want}, "
                f"which holds {w.tensor}{w.box} there, not those elements")
            return
        covered += inter.numel
    if covered != want.numel:
        bad(f"{where}: forwarded copy of {c.tensor}{c.box} reads rank {c.src} buffer {c.src_buffer}{want}: only "
            f"{covered} of its {want.numel} elements land there before round {k}")


def _is_shape(x) -> bool:
    return isinstance(x, (list, tuple)) and all(type(d) is int and d >= 0 for d in x)


def _malformed_shapes(plan) -> list[str]:
    """Tensor and buffer entries that are not ``shape`` (a list of integers >= 0) + dtype name."""
    out = []
    if not isinstance(plan.tensors, dict):
        return [f"plan tensors is a {type(plan.tensors).__name__}, not an object"]
    for name, meta in plan.tensors.items():
        if not isinstance(meta, dict) or not _is_shape(meta.get("shape")) or not all(
                isinstance(meta.get(k), str) for k in ("src_dtype", "dst_dtype")):
            out.append(f"plan tensors[{name}] = {str(meta)[:120]}: needs a shape of integers >= 0 and dtype names")
    if not isinstance(plan.buffers, dict):
        return out + [f"plan buffers is a {type(plan.buffers).__name__}, not an object"]
    for side, ranks in plan.buffers.items():
        for r, bufs in (ranks.items() if isinstance(ranks, dict) else [("?", None)]):
            for name, meta in (bufs.items() if isinstance(bufs, dict) else [("?", bufs)]):
                if not (isinstance(meta, (list, tuple)) and len(meta) == 2 and _is_shape(meta[0])
                        and isinstance(meta[1], str)):
                    out.append(f"plan buffers[{side}][{r}][{name}] = {str(meta)[:120]}: needs [shape of integers >= 0, "
                               "dtype name]")
    return out

