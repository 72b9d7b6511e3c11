"""Source index (disjoint source boxes per tensor with their holders), layout checks, coverage errors."""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from operator import add, sub

from ..box import Box, subtract
from ..layout import Layout, Piece
from .plan import PlanError
from .records import Holder, SourceBox, new


def _fmt_ranks(holders) -> str:
    return ",".join(str(r) for r in sorted({h.rank for h in holders}))


def atoms(boxes: list[Box]) -> list[tuple[Box, list[int]]]:
    """Split possibly-overlapping boxes into disjoint atoms, each with the indices of the boxes
    that contain it (only needed when one source layout has partially overlapping pieces)."""
    nd = boxes[0].ndim
    cuts = [sorted({c for b in boxes for c in (b.offsets[d], b.ends[d])}) for d in range(nd)]
    found: dict[Box, list[int]] = {}
    for i, b in enumerate(boxes):
        ranges = []
        for d in range(nd):
            cs = cuts[d]
            lo, hi = bisect_left(cs, b.offsets[d]), bisect_left(cs, b.ends[d])
            ranges.append([(cs[k], cs[k + 1] - cs[k]) for k in range(lo, hi)])
        cells = [((), ())]
        for rs in ranges:
            cells = [(o + (a,), s + (n,)) for o, s in cells for a, n in rs]
        for o, s in cells:
            found.setdefault(Box(o, s), []).append(i)
    return sorted(found.items())


def source_index(src: Layout) -> dict[str, list[SourceBox]]:
    """tensor -> its disjoint source boxes, each with its holders (:class:`~.records.Holder`), sorted."""
    by_tensor: dict[str, dict[tuple, tuple[Box, list]]] = defaultdict(dict)
    for r, bufs in sorted(src.buffers.items()):
        for bname in sorted(bufs):
            for p in bufs[bname].pieces:
                b = p.box
                key = (b.offsets, b.sizes)      # orders like the Box itself, hashes much faster
                boxes = by_tensor[p.tensor]
                entry = boxes.get(key)
                if entry is None:
                    entry = boxes[key] = SourceBox(b, [])
                entry.holders.append(new(Holder, (r, bname, p)))
    out = {}
    disjoint: dict[tuple, bool] = {}    # the same boxes recur (one tensor per layer): checked once
    for name, boxes in by_tensor.items():
        keys = sorted(boxes)
        if len(keys) == 1:
            ok = True
        else:
            kt = tuple(keys)
            ok = disjoint.get(kt)
            if ok is None:
                ok = disjoint[kt] = _disjoint(keys)
        if ok:
            out[name] = [boxes[k] for k in keys]
        else:
            items = [boxes[k] for k in keys]
            out[name] = [SourceBox(atom, sorted(h for i in idx for h in items[i].holders)) for atom, idx in atoms([b for b, _ in items])]
    return out


def _disjoint(keys: list[tuple]) -> bool:
    """Whether boxes given as sorted (offsets, sizes) tuples are pairwise disjoint."""
    for i, (ao, asz) in enumerate(keys):
        ae = tuple(map(add, ao, asz))
        for j in range(i + 1, len(keys)):
            bo, bs = keys[j]
            if ao and bo[0] >= ae[0]:
                break                        # sorted by offsets: no later box reaches back into a
            if not asz or min(map(sub, map(min, ae, map(add, bo, bs)), map(max, ao, bo))) > 0:
                return False
    return True


def _check_tensors(src: Layout, dst: Layout, allow_cast: bool, ignore_unused: bool) -> dict[str, dict]:
    missing = sorted(set(dst.tensors) - set(src.tensors))
    if missing:
        raise PlanError(f"{len(missing)} destination tensor(s) have no source: {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
    unused = sorted(set(src.tensors) - set(dst.tensors))
    if unused and not ignore_unused:
        raise PlanError(f"{len(unused)} source tensor(s) have no destination: {', '.join(unused[:8])}"
                        + (" ..." if len(unused) > 8 else "") + " (pass ignore_unused=True to drop them)")
    out = {}
    for name in sorted(dst.tensors):
        s, d = src.tensors[name], dst.tensors[name]
        if s.shape != d.shape:
            raise PlanError(f"tensor {name}: source shape {list(s.shape)} != destination shape {list(d.shape)}")
        if s.dtype != d.dtype and not allow_cast:
            raise PlanError(f"tensor {name}: source dtype {s.dtype} != destination dtype {d.dtype} "
                            "(pass allow_cast=True to cast on the receiver)")
        out[name] = {"shape": list(s.shape), "src_dtype": s.dtype, "dst_dtype": d.dtype}
    return out


def _uncovered(box: Box, covering: list[Box]) -> Box:
    rest = [box]
    for c in covering:
        rest = [r for b in rest for r in subtract(b, c)]
    return rest[0]


def _raise_uncovered(tensors: dict, index: dict, r: int, bname: str, dp: Piece, covering: list[Box]) -> None:
    hole = _uncovered(dp.box, covering)
    have = ", ".join(f"{b} on ranks {_fmt_ranks(h)}" for b, h in index.get(dp.tensor, ())[:6]) or "none"
    raise PlanError(f"tensor {dp.tensor}: destination rank {r} buffer {bname} needs {dp.box} of "
                    f"shape {tensors[dp.tensor]['shape']}, but no source covers {hole} (source boxes: {have})")

