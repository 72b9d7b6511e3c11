"""Transfer planner: pure computation on layouts (no torch, no torch.distributed).

``make_plan(src, dst)`` answers, for every destination piece, which source rank sends which box,
and packs those boxes into messages (one per ordered rank pair per staging round) under a hard
per-rank staging budget.  Every rank can compute the same plan from the same layouts; the plan is
plain data with a stable hash (:attr:`Plan.hash`).

Guarantees (each raises :class:`PlanError` naming the tensor and region when violated):

* every element of every destination piece is written exactly once;
* a destination rank that already holds a source copy of an element copies it locally (no message);
* network bytes equal the lower bound: the elements each destination rank needs and does not hold;
* among replicas, senders are chosen to balance the bytes each source rank sends.

Example, one ``[4, 2]`` float32 tensor, source tp=2 on ranks 0-1, destination unsharded on ranks
0 and 2 (rank 0 is colocated)::

    kind  | from -> to | box          | bytes
    local | 0 -> 0     | [0:2, 0:2]   | 16
    send  | 1 -> 0     | [2:4, 0:2]   | 16
    send  | 0 -> 2     | [0:2, 0:2]   | 16
    send  | 1 -> 2     | [2:4, 0:2]   | 16
"""
from __future__ import annotations

import gc
import hashlib
import json
from bisect import bisect_left
from heapq import heapify, heapreplace
from math import prod
from operator import add, itemgetter, sub
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple

from .box import Box, split_box, subtract, unchecked_box
from .layout import Layout, Piece, itemsize

DEFAULT_BUDGET = 256 << 20
ALIGN = 16  # byte alignment of every entry in a staging buffer
PLAN_VERSION = 1


class PlanError(ValueError):
    """The two layouts cannot be reconciled; the message names tensor, ranks, shapes and region."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Copy(NamedTuple):
    """One box of ``tensor`` from ``src_buffer[src_local]`` on ``src`` to ``dst_buffer[dst_local]`` on ``dst``.

    Immutable, with fields by name like a frozen dataclass; a named tuple because a full-size plan
    makes ~10^5..10^7 of them and a tuple is several times cheaper to build."""
    tensor: str
    box: Box
    src: int
    src_buffer: str
    src_local: Box
    dst: int
    dst_buffer: str
    dst_local: Box
    nbytes: int          # bytes on the wire (source dtype)
    offset: int = -1     # byte offset in the message's staging buffer (-1 for local copies)

    def to_json(self) -> list:
        return [self.tensor, self.box.to_json(), self.src, self.src_buffer, self.src_local.to_json(),
                self.dst, self.dst_buffer, self.dst_local.to_json(), self.nbytes, self.offset]

    @staticmethod
    def from_json(o) -> "Copy":
        if len(o) == 10 and all(isinstance(x, int) for x in (o[2], o[5], o[8], o[9])):
            return _copy(o[0], _box_json(o[1]), o[2], o[3], _box_json(o[4]), o[5], o[6], _box_json(o[7]), o[8], o[9])
        return Copy(o[0], Box.from_json(o[1]), o[2], o[3], Box.from_json(o[4]), o[5], o[6], Box.from_json(o[7]), o[8], o[9])


_new = object.__new__
_setattr = object.__setattr__
_tuple_new = tuple.__new__


def _copy(tensor, box, src, src_buffer, src_local, dst, dst_buffer, dst_local, nbytes, offset=-1) -> Copy:
    """``Copy(...)`` without the keyword-argument handling (same object)."""
    return _tuple_new(Copy, (tensor, box, src, src_buffer, src_local, dst, dst_buffer, dst_local, nbytes, offset))


def _box_json(o) -> Box:
    offs, sizes = tuple(o[0]), tuple(o[1])
    if len(offs) == len(sizes) and (not sizes or (min(sizes) >= 0 and min(offs) >= 0)):
        return unchecked_box(offs, sizes)
    return Box(offs, sizes)     # raises the checked constructor's error


@dataclass(frozen=True)
class Message:
    round: int
    src: int
    dst: int
    nbytes: int                 # staging bytes (entries aligned to 16 bytes)
    entries: tuple[Copy, ...]

    def to_json(self) -> dict:
        return {"round": self.round, "src": self.src, "dst": self.dst, "nbytes": self.nbytes,
                "entries": [c.to_json() for c in self.entries]}

    @staticmethod
    def from_json(o) -> "Message":
        return Message(o["round"], o["src"], o["dst"], o["nbytes"], tuple(Copy.from_json(c) for c in o["entries"]))


@dataclass
class Plan:
    """Plain-data plan.  ``buffers[side][rank][name] = (shape, dtype)`` lets every rank check its
    real tensors against the plan before anything moves."""
    tensors: dict[str, dict]                         # name -> {"shape", "src_dtype", "dst_dtype"}
    buffers: dict[str, dict[int, dict[str, list]]]   # "src"/"dst" -> rank -> name -> [shape, dtype]
    messages: list[Message]
    local_copies: list[Copy]
    padding: list[tuple[int, str, Box]]              # (rank, dst buffer, local region) zero-filled
    budget_bytes: int
    rounds: int
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "tensors": self.tensors,
            "buffers": {side: {str(r): bufs for r, bufs in sorted(ranks.items())} for side, ranks in self.buffers.items()},
            "budget_bytes": self.budget_bytes,
            "rounds": self.rounds,
            "messages": [m.to_json() for m in self.messages],
            "local_copies": [c.to_json() for c in self.local_copies],
            "padding": [[r, b, box.to_json()] for r, b, box in self.padding],
            "stats": self.stats,
        }

    @staticmethod
    def from_json(o: Mapping) -> "Plan":
        if o.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {o.get('version')} is not {PLAN_VERSION}")
        return Plan(
            tensors=dict(o["tensors"]),
            buffers={side: {int(r): bufs for r, bufs in ranks.items()} for side, ranks in o["buffers"].items()},
            messages=[Message.from_json(m) for m in o["messages"]],
            local_copies=[Copy.from_json(c) for c in o["local_copies"]],
            padding=[(r, b, Box.from_json(box)) for r, b, box in o["padding"]],
            budget_bytes=o["budget_bytes"], rounds=o["rounds"], stats=dict(o["stats"]))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """sha256 of the canonical JSON, stats excluded (they hold timings)."""
        obj = self.to_json()
        obj.pop("stats")
        return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.buffers["src"]) | set(self.buffers["dst"]))

    def summary(self) -> str:
        s = self.stats
        lines = [
            f"tensors            {len(self.tensors)}",
            f"bytes over network {s['network_bytes']:,} (lower bound {s['lower_bound_bytes']:,})",
            f"bytes copied local {s['local_bytes']:,}",
            f"messages           {s['messages']} in {self.rounds} round(s), budget {self.budget_bytes:,} B/rank",
            f"max sent / rank    {s['max_send_bytes']:,}  max received / rank {s['max_recv_bytes']:,}",
            f"staging / rank     {s.get('max_stage_bytes', 0):,} B (send + receive, one round)",
            f"padding regions    {len(self.padding)} ({s['padding_bytes']:,} B zero-filled)",
        ]
        return "\n".join(lines)


def _fmt_ranks(holders) -> str:
    return ",".join(str(r) for r in sorted({h[0] for h in holders}))


def _atoms(boxes: list[Box]) -> list[tuple[Box, list[int]]]:
    """Split possibly-overlapping boxes into disjoint atoms, each with the indices of the boxes
    that contain it (only needed when one source layout has partially overlapping pieces)."""
    nd = boxes[0].ndim
    cuts = [sorted({c for b in boxes for c in (b.offsets[d], b.ends[d])}) for d in range(nd)]
    atoms: dict[Box, list[int]] = {}
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
            atoms.setdefault(Box(o, s), []).append(i)
    return sorted(atoms.items())


def _source_index(src: Layout) -> dict[str, list[tuple[Box, list[tuple[int, str, Piece]]]]]:
    """tensor -> disjoint source boxes, each with its holders (rank, buffer, piece), sorted."""
    by_tensor: dict[str, dict[tuple, tuple[Box, list]]] = defaultdict(dict)
    for r, bufs in sorted(src.buffers.items()):
        for bname in sorted(bufs):
            for p in bufs[bname].pieces:
                b = p.box
                key = (b.offsets, b.sizes)      # orders like the Box itself, hashes much faster
                boxes = by_tensor[p.tensor]
                entry = boxes.get(key)
                if entry is None:
                    entry = boxes[key] = (b, [])
                entry[1].append((r, bname, p))
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
            out[name] = [(atom, sorted(h for i in idx for h in items[i][1])) for atom, idx in _atoms([b for b, _ in items])]
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


def make_plan(src: Layout, dst: Layout, *, budget_bytes: int = DEFAULT_BUDGET, allow_cast: bool = False,
              ignore_unused: bool = False) -> Plan:
    """Plan the transfer of every destination piece from the source layout.

    ``budget_bytes`` is the hard per-rank staging limit per round: the bytes a rank stages to send
    plus the bytes it stages to receive in one round never exceed it (the executor allocates one
    staging buffer per rank of at most this size); larger copies are split.  Raises :class:`PlanError` before anything is planned to move
    when the layouts disagree (names, shapes, dtypes) or a destination region has no source.
    """
    if budget_bytes < 1024:
        raise PlanError(f"staging budget {budget_bytes} B is below the 1 KiB minimum")
    # planning allocates millions of small acyclic objects: the cyclic garbage collector would
    # rescan the (large) layouts many times over for nothing, so it is paused while planning
    paused = gc.isenabled()
    gc.disable()
    try:
        return _make_plan(src, dst, budget_bytes, allow_cast, ignore_unused)
    finally:
        if paused:
            gc.enable()


def _make_plan(src: Layout, dst: Layout, budget_bytes: int, allow_cast: bool, ignore_unused: bool) -> Plan:
    tensors = _check_tensors(src, dst, allow_cast, ignore_unused)
    index = _source_index(src)

    # source boxes of every tensor as plain tuples (offsets, ends, holders, holder ranks), sorted
    # by dim-0 offset, with the dim-0 starts and the longest dim-0 size for a bisect window; tensors
    # whose source boxes are the same (e.g. one per layer) share a shape id, so the geometry of a
    # destination piece against them is computed once (``regions_of``) and reused for every layer
    sources: dict[str, tuple[list, int]] = {}
    # holder ranks per source box, for the local-copy check: only needed where a rank is in both layouts
    shared_ranks = not set(src.buffers).isdisjoint(dst.buffers)
    no_ranks: frozenset = frozenset()
    shape_ids: dict[tuple, int] = {}
    windows: list[tuple[list, list[int], int]] = []
    for name, items in index.items():
        keys = tuple((b.offsets, b.sizes) for b, _ in items)
        sid = shape_ids.get(keys)
        if sid is None:
            sid = shape_ids[keys] = len(windows)
            windows.append(([(b.offsets, b.ends) for b, _ in items], [b.offsets[0] if b.ndim else 0 for b, _ in items],
                            max((b.sizes[0] if b.ndim else 1) for b, _ in items)))
        sources[name] = ([(h, frozenset(x[0] for x in h) if shared_ranks else no_ranks) for _, h in items], sid)
    local_maps: dict[int, tuple | None] = {}     # id(piece) -> local minus global offsets (None: reshaped)

    def to_local(p: Piece, offs: tuple, sizes: tuple) -> tuple[tuple, tuple]:
        key = id(p)
        if key in local_maps:
            delta = local_maps[key]
        else:
            delta = local_maps[key] = (tuple(l - g for l, g in zip(p.local.offsets, p.box.offsets))
                                       if p.box.sizes == p.local.sizes else None)
        if delta is not None:
            return tuple(map(add, offs, delta)), sizes
        b = p.local_of(unchecked_box(offs, sizes))
        return b.offsets, b.sizes

    geometry: dict[tuple, tuple[bool, list]] = {}

    def regions_of(key: tuple, dp: Piece) -> tuple[bool, list]:
        """(whether they cover it, [(source row, offsets, sizes, elements, Box, dst local offsets,
        dst local sizes, dst local Box)]) of destination piece ``dp`` against source boxes ``sid``;
        ``key`` = (sid, dp's box offsets and sizes, dp's local offsets and sizes)."""
        sid = key[0]
        dbox = dp.box
        spans, first, longest = windows[sid]
        do, de = dbox.offsets, dbox.ends
        lo_i, hi_i = (bisect_left(first, do[0] - longest + 1), bisect_left(first, de[0])) if do else (0, len(spans))
        out, covered = [], 0
        for k in range(lo_i, hi_i):
            so, se = spans[k]
            lo = tuple(map(max, so, do))
            sizes = tuple(map(sub, map(min, se, de), lo))
            if sizes and min(sizes) <= 0:
                continue
            numel = prod(sizes)
            covered += numel
            dlo, dls = to_local(dp, lo, sizes)
            out.append((k, lo, sizes, numel, unchecked_box(lo, sizes), dlo, dls, unchecked_box(dlo, dls)))
        got = geometry[key] = (covered == prod(dbox.sizes), out)
        return got

    local: list[Copy] = []
    # remote regions: (-bytes, tensor, offsets, sizes, dst rank, dst buffer, sequence number,
    # holders, dst piece, itemsize, Box, dst local offsets, dst local sizes, dst local Box): the
    # fields up to the (unique) sequence number are the sender greedy's order, so a plain sort
    # gives it without key tuples
    remote: list[tuple] = []
    lower_bound = 0
    isz_of = {name: itemsize(t["src_dtype"]) for name, t in tensors.items()}
    append = remote.append
    for r, bufs in sorted(dst.buffers.items()):
        for bname in sorted(bufs):
            for dp in bufs[bname].pieces:
                tname = dp.tensor
                isz = isz_of[tname]
                src_rows = sources.get(tname)
                dbox, dlocal = dp.box, dp.local
                if src_rows is None:
                    if prod(dbox.sizes):
                        _raise_uncovered(tensors, index, r, bname, dp, [])
                    continue
                gkey = (src_rows[1], dbox.offsets, dbox.sizes, dlocal.offsets, dlocal.sizes)
                got = geometry.get(gkey)
                complete, regions = got if got is not None else regions_of(gkey, dp)
                rows = src_rows[0]
                for k, lo, sizes, numel, rbox, dlo, dls, dlbox in regions:
                    holders, hranks = rows[k]
                    if r in hranks:
                        hr, hb, hp = next(h for h in holders if h[0] == r)
                        slo, sls = to_local(hp, lo, sizes)
                        local.append(_copy(tname, rbox, hr, hb, unchecked_box(slo, sls), r, bname, dlbox, numel * isz))
                    else:
                        append((-numel * isz, tname, lo, sizes, r, bname, len(remote), holders, dp, isz, rbox,
                                dlo, dls, dlbox))
                        lower_bound += numel * isz
                if not complete:
                    _raise_uncovered(tensors, index, r, bname, dp, [reg[4] for reg in regions])

    # choose senders among replicas: largest first, to the least-loaded holder (ties: lowest rank),
    # and make each region's copies right away (those of a region _rebalance moves are remade)
    #
    # copies as tuples: (-bytes, src, dst, tensor, offsets, sizes, sequence number, src buffer, src
    # local Box, dst buffer, dst local offsets, dst local sizes, Box, dst local Box); Copy objects
    # are made once, at packing, with their staging offset (in greedy order: the sequence number
    # only orders copies that tie on everything before it, so a plain sort is the packing order)
    copies: list[tuple] = []
    src_boxes: dict[tuple, Box] = {}
    piece_keys: dict[int, tuple] = {}   # id(source piece) -> what its local box of a sub-box depends on
    max_bytes: dict[int, int] = {}      # itemsize -> largest copy that fits the budget unsplit

    def copies_of(x: tuple, h: tuple, seq: int) -> list[tuple]:
        """The copies of region ``x`` sent by holder ``h``, numbered from ``seq`` (split to fit the budget)."""
        neg, tname, offs, sizes, dr, dbuf, _, _, dpiece, isz, rbox, dlo, dls, dlbox = x
        sr, sbuf, spiece = h
        limit = max_bytes.get(isz)
        if limit is None:
            limit = max_bytes[isz] = max(1, (budget_bytes - ALIGN) // isz) * isz
        if -neg <= limit:
            pk = piece_keys.get(id(spiece))
            if pk is None:
                pb, pl = spiece.box, spiece.local
                pk = piece_keys[id(spiece)] = ((tuple(map(sub, pl.offsets, pb.offsets)),) if pb.sizes == pl.sizes
                                               else (pb.offsets, pb.sizes, pl.offsets, pl.sizes))
            skey = (id(rbox), pk)       # rbox is shared (and alive) per geometry: same id, same box
            slbox = src_boxes.get(skey)
            if slbox is None:
                slbox = src_boxes[skey] = unchecked_box(*to_local(spiece, offs, sizes))
            return [(neg, sr, dr, tname, offs, sizes, seq, sbuf, slbox, dbuf, dlo, dls, rbox, dlbox)]
        out = []
        for b in split_box(rbox, limit // isz):
            so, ss = b.offsets, b.sizes
            slo, sls = to_local(spiece, so, ss)
            dlo, dls = to_local(dpiece, so, ss)
            out.append((-prod(ss) * isz, sr, dr, tname, so, ss, seq + len(out), sbuf, unchecked_box(slo, sls), dbuf,
                        dlo, dls, b, unchecked_box(dlo, dls)))
        return out

    load: dict[int, int] = defaultdict(int)
    remote.sort()
    chosen: list[tuple[int, str, Piece]] = []      # the sender of remote[p]
    choose = chosen.append
    first_copy: list[int] = []                     # index in copies of remote[p]'s first copy
    heaps: dict[int, list] = {}        # per holder list: (load, rank) min-heap, refreshed lazily
    first_holder: dict[int, dict] = {}
    append, extend, mark = copies.append, copies.extend, first_copy.append
    by_rank: dict[int, list[int]] = defaultdict(list)   # sender -> positions p it sends
    pairs: dict[int, tuple | None] = {}
    last_key = heap = firsts = pair = None
    for p, x in enumerate(remote):
        key = id(x[7])
        if key != last_key:             # consecutive regions often share their holders
            last_key = key
            heap = heaps.get(key)
            if heap is None:
                firsts = first_holder[key] = {}
                for h in x[7]:
                    firsts.setdefault(h[0], h)
                heap = heaps[key] = [(load[q], q) for q in sorted(firsts)]
                heapify(heap)
                pair = pairs[key] = tuple(sorted(firsts)) if len(firsts) == 2 else None
            else:
                firsts = first_holder[key]
                pair = pairs[key]
        if pair is not None:            # two holder ranks: the heap's answer, without the heap
            a, b = pair
            best = a if load[a] <= load[b] else b
            load[best] -= x[0]
        elif len(heap) == 1:            # one holder rank: nothing to choose
            best = heap[0][1]
            load[best] -= x[0]
        else:
            top = heap[0]
            while top[0] != load[top[1]]:   # loads only grow: a stale top is refreshed and re-sorted
                heapreplace(heap, (load[top[1]], top[1]))
                top = heap[0]
            best = top[1]
            load[best] -= x[0]
            heapreplace(heap, (load[best], best))
        h = firsts[best]
        choose(h)
        by_rank[best].append(p)
        n = len(copies)
        mark(n)
        # copies_of(x, h, n), inlined for the common case: one unsplit copy
        isz = x[9]
        limit = max_bytes.get(isz)
        spiece = h[2]
        pk = piece_keys.get(id(spiece))
        if pk is None:
            pb, pl = spiece.box, spiece.local
            pk = piece_keys[id(spiece)] = ((tuple(map(sub, pl.offsets, pb.offsets)),) if pb.sizes == pl.sizes
                                           else (pb.offsets, pb.sizes, pl.offsets, pl.sizes))
        if limit is None or -x[0] > limit:
            extend(copies_of(x, h, n))
            continue
        slbox = src_boxes.get((id(x[10]), pk))
        if slbox is None:
            extend(copies_of(x, h, n))
            continue
        append((x[0], best, x[4], x[1], x[2], x[3], n, h[1], slbox, x[5], x[11], x[12], x[10], x[13]))
    for p in _rebalance(remote, chosen, load, by_rank):
        n = first_copy[p]
        new = copies_of(remote[p], chosen[p], n)
        copies[n:n + len(new)] = new
    del remote, chosen, by_rank, first_copy     # freed before packing allocates the messages

    messages, rounds, totals = _pack_rounds(copies, budget_bytes)
    metas: dict[tuple, list] = {}       # [shape, dtype] lists shared between equal buffers (read-only)
    padding: list[tuple[int, str, Box]] = []

    def side(layout: Layout, pad: bool) -> dict:
        """rank -> buffer name -> [shape, dtype], sorted; with ``pad``, the zero padding of each buffer."""
        out = {}
        for r, bufs in sorted(layout.buffers.items()):
            metas_r = out[r] = {}
            for n in sorted(bufs):
                b = bufs[n]
                shape = b.shape
                mkey = (shape, b.dtype)
                m = metas.get(mkey)
                if m is None:
                    m = metas[mkey] = [list(shape), b.dtype]
                metas_r[n] = m
                if pad:
                    ps = b.pieces
                    if ((len(ps) != 1 or ps[0].local.sizes != shape)
                            and sum(prod(p.local.sizes) for p in ps) != prod(shape)):
                        padding.extend((r, b.name, box) for box in b.padding())
        return out

    buffers = {"src": side(src, False), "dst": side(dst, True)}
    local.sort(key=lambda c: (c.dst, c.dst_buffer, c.dst_local.offsets, c.dst_local.sizes))
    plan = Plan(tensors, buffers, messages, local, padding, budget_bytes, rounds)
    plan.stats = _stats(plan, lower_bound, totals)
    plan.stats["unused_tensors"] = sorted(set(src.tensors) - set(dst.tensors))
    return plan


def _rebalance(remote, chosen, load, by_rank, max_moves: int = 100000) -> list[int]:
    """Move regions off the most loaded sender while that lowers the maximum (deterministic).

    ``remote[p]`` (in greedy order) is sent by ``chosen[p]``; ``by_rank[q]`` lists the positions p
    that rank q sends; ties between regions go by their sequence number ``remote[p][6]``.  Returns
    the positions p whose sender changed, in order."""
    moved: set[int] = set()
    sets: dict[int, set[int]] = {}      # by_rank as sets, made for the ranks a move touches only

    def regions(q: int) -> set[int]:
        got = sets.get(q)
        if got is None:
            got = sets[q] = set(by_rank.get(q, ()))
        return got

    seq = lambda p: remote[p][6]
    for _ in range(max_moves):
        if not load:
            break
        top = max(load, key=lambda q: (load[q], -q))
        best_move = None
        for p in sorted(regions(top), key=seq):
            x = remote[p]
            holders, n, i = x[7], -x[0], x[6]
            for q in sorted({h[0] for h in holders}):
                if q != top and load[q] + n < load[top]:
                    key = (load[q] + n, q, i)
                    if best_move is None or key < best_move[0]:
                        best_move = (key, p, q, n)
        if best_move is None:
            break
        _, p, q, n = best_move
        chosen[p] = next(h for h in remote[p][7] if h[0] == q)
        moved.add(p)
        regions(top).discard(p)
        regions(q).add(p)
        load[top] -= n
        load[q] += n
    return sorted(moved)


def _pack_rounds(copies: list[tuple], budget: int) -> tuple[list[Message], int, tuple]:
    """First-fit decreasing (each copy, largest first, to the lowest round where both its ranks
    still have room) into rounds so that, in every round, what a rank stages to send plus
    what it stages to receive stays within ``budget`` bytes (one staging buffer per rank, split
    between the send and the receive part of each round); then one message per (round, src, dst)
    with 16-byte aligned entries.  Every copy is at most ``budget`` bytes once aligned (split
    before), and a remote copy's two ranks differ, so a fresh round always has room for it.

    ``copies`` are the tuples ``make_plan`` builds (-bytes, src, dst, tensor, offsets, sizes,
    sequence number (unique: ties keep the order given, as a stable sort would), src buffer, src
    local Box, dst buffer, dst local offsets, dst local sizes, Box, dst local Box).  Also returns
    the per-rank totals of :func:`plan_stats` (bytes sent, received, staged per round)."""
    # per rank: staged bytes per round (rounds past the end: 0), and a bit mask of the rounds
    # k < len(used) with used[k] <= lim for the lim it was last computed for; a copy goes to the
    # lowest round where both its ranks have room: the lowest bit of the two masks' AND, each
    # extended with ones past its end.  Copies come largest first, so lim only grows; a mask is
    # recomputed only when lim reaches the least usage among the rounds it leaves out (usage only
    # grows, so that least usage, kept as a lower bound, never misses a round that gained room).
    used: dict[int, list[int]] = {}
    masks: dict[int, list] = {}         # rank -> [lim, mask, least usage of a left-out round]
    placed: dict[tuple[int, int, int], list[tuple]] = defaultdict(list)
    rounds = 0
    inf = float("inf")

    def mask_of(r: int, lim: int) -> int:
        u = used.get(r)
        if u is None:
            u = used[r] = []
        m = masks.get(r)
        if m is None:
            m = masks[r] = [lim, 0, inf]
        elif m[0] != lim:
            m[0] = lim
            if lim >= m[2]:
                m[1] = int("".join(["1" if x <= lim else "0" for x in reversed(u)]) or "0", 2)
                m[2] = min((x for x in u if x > lim), default=inf)
        return m[1] | (-1 << len(u))

    # copies come in runs of equal (size, src, dst): first-fit puts a run's copies, in order, into
    # the lowest round where both ranks have room until one of them is full, then the next such
    # round (lower rounds never regain room), so a run is placed round by round, as many at once
    # as fit -- the same rounds as one copy at a time
    copies.sort()                       # in place: the caller hands the list over
    srt = copies
    j, total = 0, len(srt)
    while j < total:
        c = srt[j]
        key0, s, d = c[0], c[1], c[2]
        end = j + 1
        while end < total and srt[end][0] == key0 and srt[end][1] == s and srt[end][2] == d:
            end += 1
        n = (-key0 + ALIGN - 1) // ALIGN * ALIGN
        lim = budget - n
        while j < end:
            both = mask_of(s, lim) & mask_of(d, lim)
            k = (both & -both).bit_length() - 1
            us, ud = used[s], used[d]
            room = budget - max(us[k] if k < len(us) else 0, ud[k] if k < len(ud) else 0)
            cnt = min(room // n, end - j)
            add_n = cnt * n
            for r, u in ((s, us), (d, ud)):
                m = masks[r]
                if len(u) <= k:             # new rounds start empty: room in every one of them
                    m[1] |= ((1 << (k + 1)) - 1) ^ ((1 << len(u)) - 1)
                    u.extend([0] * (k + 1 - len(u)))
                u[k] += add_n
                if u[k] > lim:
                    m[1] &= ~(1 << k)
                    if u[k] < m[2]:
                        m[2] = u[k]
            if k >= rounds:
                rounds = k + 1
            placed[(k, s, d)].extend(srt[j:j + cnt])
            j += cnt
    messages = []
    entry_key = itemgetter(3, 4, 5, 9, 10, 11, 6)     # tensor, box, dst buffer, dst local box
    # the plan's per-rank totals (``plan_stats``), summed here rather than in another pass
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    stage_send: dict[tuple[int, int], int] = defaultdict(int)
    stage_recv: dict[tuple[int, int], int] = defaultdict(int)
    for key in sorted(placed):
        k, s, d = key
        group = placed[key]
        if len(group) > 1:
            group.sort(key=entry_key)
        entries, off, payload = [], 0, 0
        add = entries.append
        for c in group:
            nb = -c[0]
            add(_tuple_new(Copy, (c[3], c[12], s, c[7], c[8], d, c[9], c[13], nb, off)))     # _copy(...) inlined
            off += (nb + ALIGN - 1) // ALIGN * ALIGN
            payload += nb
        m = _new(Message)               # as Message(...) without the frozen dataclass __init__
        _setattr(m, "__dict__", {"round": k, "src": s, "dst": d, "nbytes": off, "entries": tuple(entries)})
        messages.append(m)
        sent[s] += payload
        recv[d] += payload
        stage_send[(k, s)] += off
        stage_recv[(k, d)] += off
    return messages, rounds, (sent, recv, stage_send, stage_recv)


def plan_part(plan: Plan, rank: int) -> Plan:
    """One rank's own part of ``plan``: the messages it sends or receives, its local copies and its
    padding, with the plan's tensors, buffers (all ranks: peers' buffer metadata is what
    :func:`validate_plan` checks a message against), budget and round numbers unchanged, so every
    entry is exactly the whole plan's (same rounds, offsets, senders).  Ranks still agree on the
    whole plan's :attr:`Plan.hash` before a transfer (a part's own hash differs from rank to rank).

    There is no cheaper way to get the part than from the whole plan: the sender of a replicated
    region is chosen by a greedy over *all* regions (a rank's load depends on every other
    choice), and a message's round by a first-fit over *all* copies (a round's room on a rank
    depends on its other peers), so a rank-local computation would give a different plan.
    ``validate_plan(plan_part(p, r), r)`` checks the same things as ``validate_plan(p, r)``."""
    messages = [m for m in plan.messages if m.src == rank or m.dst == rank]
    local = [c for c in plan.local_copies if c.dst == rank or c.src == rank]
    padding = [x for x in plan.padding if x[0] == rank]
    part = Plan(plan.tensors, plan.buffers, messages, local, padding, plan.budget_bytes, plan.rounds)
    part.stats = {"rank": rank}
    return part


def plan_stats(plan: Plan, lower_bound: int | None = None) -> dict:
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    stage_send: dict[tuple[int, int], int] = defaultdict(int)
    stage_recv: dict[tuple[int, int], int] = defaultdict(int)
    for m in plan.messages:
        payload = sum(c.nbytes for c in m.entries)
        sent[m.src] += payload
        recv[m.dst] += payload
        stage_send[(m.round, m.src)] += m.nbytes
        stage_recv[(m.round, m.dst)] += m.nbytes
    return _stats(plan, lower_bound, (sent, recv, stage_send, stage_recv))


def _stats(plan: Plan, lower_bound: int | None, totals: tuple) -> dict:
    sent, recv, stage_send, stage_recv = totals
    stage: dict[tuple[int, int], int] = defaultdict(int)
    for key, v in stage_send.items():
        stage[key] += v
    for key, v in stage_recv.items():
        stage[key] += v
    network = sum(sent.values())
    pad = 0
    for r, b, box in plan.padding:
        pad += box.numel * itemsize(plan.buffers["dst"][r][b][1])
    ranks = plan.ranks
    return {
        "network_bytes": network,
        "lower_bound_bytes": network if lower_bound is None else lower_bound,
        "local_bytes": sum(c.nbytes for c in plan.local_copies),
        "padding_bytes": pad,
        "messages": len(plan.messages),
        "rounds": plan.rounds,
        "sent_bytes": {str(r): sent.get(r, 0) for r in ranks},
        "recv_bytes": {str(r): recv.get(r, 0) for r in ranks},
        "max_send_bytes": max(sent.values(), default=0),
        "max_recv_bytes": max(recv.values(), default=0),
        "max_stage_send_bytes": max(stage_send.values(), default=0),
        "max_stage_recv_bytes": max(stage_recv.values(), default=0),
        # one staging buffer per rank holds a round's sends and receives together: its size
        "max_stage_bytes": max(stage.values(), default=0),
    }


def validate_plan(plan: Plan, rank: int | None = None, limit: int = 20) -> list[str]:
    """Self-consistency of a plan (one received over the wire, loaded from JSON or built by hand),
    pure Python: the problems found, each naming tensor, ranks, buffer and region ([] when sound).

    Checks every copy that involves ``rank`` (every copy when ``rank`` is None): tensor, buffers
    and ranks known to the plan; global/local boxes of equal size, inside their tensor and buffers;
    byte counts; message entries 16-byte aligned, inside their message and not overlapping; at
    most one message per (round, src, dst) and rounds below ``plan.rounds``; and, for each
    destination buffer of ``rank``, that the copies and zero padding write every element exactly
    once (two pieces claiming the same region, or a region nobody writes, are reported).
    """
    problems: list[str] = []

    def bad(text: str) -> bool:
        if len(problems) < limit:
            problems.append(text)
        return True

    def buffer_meta(side: str, r: int, name: str):
        return plan.buffers.get(side, {}).get(r, {}).get(name)

    writes: dict[tuple[int, str], list[tuple[Box, str]]] = defaultdict(list)

    def ints(*xs) -> bool:
        return all(type(x) is int for x in xs)

    if not ints(plan.budget_bytes, plan.rounds) or plan.budget_bytes < 1024 or plan.rounds < 0:
        bad(f"plan budget_bytes={plan.budget_bytes!r} / rounds={plan.rounds!r}: must be integers (budget >= 1024)")

    def check_copy(c: Copy, where: str) -> None:
        meta = plan.tensors.get(c.tensor)
        if meta is None:
            bad(f"{where}: tensor {c.tensor} is not in the plan's tensors")
            return
        if not ints(c.src, c.dst, c.nbytes, c.offset, *c.box.offsets, *c.box.sizes, *c.src_local.offsets,
                    *c.src_local.sizes, *c.dst_local.offsets, *c.dst_local.sizes):
            bad(f"{where}: copy of {c.tensor}: ranks, boxes, offset and byte count must be integers: {list(c)}")
            return
        if c.box.ndim != len(meta["shape"]) or not Box.full(meta["shape"]).contains(c.box):
            bad(f"{where}: box {c.box} is outside tensor {c.tensor} of shape {list(meta['shape'])}")
        for side, r, bname, local in (("src", c.src, c.src_buffer, c.src_local), ("dst", c.dst, c.dst_buffer, c.dst_local)):
            bm = buffer_meta(side, r, bname)
            if bm is None:
                bad(f"{where}: {side} rank {r} has no buffer {bname} in the plan")
                continue
            shape = bm[0]
            if local.ndim != len(shape) or not Box.full(shape).contains(local):
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

    for c in plan.local_copies:
        if rank is not None and c.dst != rank and c.src != rank:
            continue
        where = f"local copy on rank {c.dst}"
        if c.src != c.dst:
            bad(f"{where}: local copy of {c.tensor}{c.box} goes from rank {c.src} to rank {c.dst}")
        check_copy(c, where)
    seen: set[tuple[int, int, int]] = set()
    for m in plan.messages:
        if rank is not None and rank not in (m.src, m.dst):
            continue
        where = f"round {m.round} message {m.src}->{m.dst}"
        if not ints(m.round, m.src, m.dst, m.nbytes):
            bad(f"{where}: round, ranks and byte count must be integers")
            continue
        if not 0 <= m.round < plan.rounds:
            bad(f"{where}: round {m.round} is outside the plan's {plan.rounds} round(s)")
        if m.src == m.dst:
            bad(f"{where}: a message from a rank to itself")
        if (m.round, m.src, m.dst) in seen:
            bad(f"{where}: two messages for the same round and rank pair")
        seen.add((m.round, m.src, m.dst))
        spans = []
        for c in m.entries:
            if (c.src, c.dst) != (m.src, m.dst):
                bad(f"{where}: entry {c.tensor}{c.box} goes {c.src}->{c.dst}")
            if c.offset < 0 or c.offset % ALIGN or c.offset + c.nbytes > m.nbytes:
                bad(f"{where}: entry {c.tensor}{c.box} at byte {c.offset} (+{c.nbytes}) is misaligned or outside "
                    f"the {m.nbytes} B message")
            spans.append((c.offset, c.offset + c.nbytes, c.tensor))
            check_copy(c, where)
        spans.sort()
        for (a0, a1, ta), (b0, b1, tb) in zip(spans, spans[1:]):
            if b0 < a1:
                bad(f"{where}: entries {ta} and {tb} overlap in the staging buffer (bytes {b0}..{a1})")
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
    for r, bufs in sorted(plan.buffers.get("dst", {}).items()):
        if rank is not None and r != rank:
            continue
        for name, (shape, _) in sorted(bufs.items()):
            boxes = sorted(writes.get((r, name), []), key=lambda x: x[0])
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
    return problems
