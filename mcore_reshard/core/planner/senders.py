"""Sender choice among replicas (greedy, then :func:`_rebalance`) and the copies of each remote region."""
from __future__ import annotations

from collections import defaultdict
from heapq import heapify, heapreplace
from math import prod
from operator import sub

from ..box import Box, split_box, unchecked_box
from ..layout import Piece
from .matching import ToLocal
from .plan import ALIGN
from .records import Holder, PendingCopy, Region, new


class Copies(list):
    """The :class:`~.records.PendingCopy` records :func:`choose_senders` makes, in sequence-number order (copy ``i`` has
    sequence number ``i``); ``split``: whether some region was split to fit the budget.  Unsplit,
    their packing order (a plain sort) is their order stably sorted by (-bytes, src, dst) alone:
    copies of one (-bytes, src, dst) follow the sorted regions, whose order up to the sequence
    number is (-bytes, tensor, offsets, sizes) (:func:`~.rounds._pack_rounds` groups them so)."""
    __slots__ = ("split",)


def choose_senders(remote: list[Region], budget_bytes: int, to_local: ToLocal) -> Copies:
    """The copies of every remote region (see :func:`~.matching.match`), from its chosen sender.

    Senders among replicas: largest region first, to the least-loaded holder (ties: lowest rank),
    each region's copies made right away (those of a region :func:`_rebalance` moves are remade).
    Sorts ``remote`` in place.  Copies are :class:`~.records.PendingCopy` records, split to fit the
    budget; Copy objects are made once, at packing, with their
    staging offset (in greedy order: the sequence number only orders copies that tie on everything
    before it, so a plain sort is the packing order)."""
    copies = Copies()
    copies.split = False
    # a source local Box depends only on the sub-box's offsets relative to its piece's box, its
    # sizes, and the piece's geometry (box sizes, local offsets and sizes): one Box per distinct
    # such key, shared (e.g. 256 stacked experts, each its own piece, cut alike: 1 Box, not 256)
    geo_ids: dict[tuple, int] = {}      # (box sizes, local offsets, local sizes) -> geometry id
    by_id: dict[int, tuple] = {}        # id(source piece) -> (its box offsets, geometry id)
    src_boxes: dict[tuple, Box] = {}    # (relative offsets, sizes, geometry id) -> source local Box
    max_bytes: dict[int, int] = {}      # itemsize -> largest copy that fits the budget unsplit

    def info(spiece: Piece) -> tuple:
        pb, pl = spiece.box, spiece.local
        g = geo_ids.setdefault((pb.sizes, pl.offsets, pl.sizes), len(geo_ids))
        got = by_id[id(spiece)] = (pb.offsets, g)
        return got

    def copies_of(x: Region, h: Holder, seq: int) -> list[PendingCopy]:
        """The copies of region ``x`` sent by holder ``h``, numbered from ``seq`` (split to fit the budget)."""
        neg, tname, offs, sizes, dr, dbuf, isz, rbox = (x.neg_nbytes, x.tensor, x.offsets, x.sizes, x.dst,
                                                         x.dst_buffer, x.itemsize, x.box)
        sr, sbuf, spiece = h.rank, h.buffer, h.piece
        limit = max_bytes.get(isz)
        if limit is None:
            limit = max_bytes[isz] = max(1, (budget_bytes - ALIGN) // isz) * isz
        if -neg <= limit:
            pi = by_id.get(id(spiece)) or info(spiece)
            poffs, gid = pi
            skey = (tuple(map(sub, offs, poffs)), sizes, gid)
            slbox = src_boxes.get(skey)
            if slbox is None:
                slbox = src_boxes[skey] = unchecked_box(*to_local(spiece, offs, sizes))
            return [new(PendingCopy, (neg, sr, dr, tname, offs, sizes, seq, sbuf, slbox, dbuf, x.dst_local_offsets,
                                      x.dst_local_sizes, rbox, x.dst_local))]
        out = []
        copies.split = True
        for b in split_box(rbox, limit // isz):
            so, ss = b.offsets, b.sizes
            slo, sls = to_local(spiece, so, ss)
            dlo, dls = to_local(x.dst_piece, so, ss)
            out.append(new(PendingCopy, (-prod(ss) * isz, sr, dr, tname, so, ss, seq + len(out), sbuf,
                                         unchecked_box(slo, sls), dbuf, dlo, dls, b, unchecked_box(dlo, dls))))
        return out

    load: dict[int, int] = defaultdict(int)
    remote.sort()
    chosen: list[Holder] = []                      # the sender of remote[p]
    choose = chosen.append
    first_copy: list[int] = []                     # index in copies of remote[p]'s first copy
    heaps: dict[int, list] = {}        # per holder list: (load, rank) min-heap, refreshed lazily
    first_holder: dict[int, dict] = {}
    append, extend, mark = copies.append, copies.extend, first_copy.append
    by_rank: dict[int, list[int]] = defaultdict(list)   # sender -> positions p it sends
    pairs: dict[int, tuple | None] = {}
    last_key = heap = firsts = pair = one = None
    sget = src_boxes.get
    for p, x in enumerate(remote):
        key = id(x.holders)
        if key != last_key:             # consecutive regions often share their holders
            last_key = key
            heap = heaps.get(key)
            if heap is None:
                firsts = first_holder[key] = {}
                for h in x.holders:
                    firsts.setdefault(h.rank, h)
                heap = heaps[key] = [(load[q], q) for q in sorted(firsts)]
                heapify(heap)
                pair = pairs[key] = tuple(sorted(firsts)) if len(firsts) == 2 else None
            else:
                firsts = first_holder[key]
                pair = pairs[key]
            # one holder rank: nothing to choose, the same sender (and its piece) for the whole run
            one = None
            if pair is None and len(heap) == 1:
                best = heap[0][1]
                h = firsts[best]
                one = (best, h, by_rank[best].append, by_id.get(id(h.piece)) or info(h.piece))
        neg = x.neg_nbytes
        if one is not None:
            best, h, add_p, pi = one
            load[best] -= neg
            add_p(p)
        else:
            if pair is not None:        # two holder ranks: the heap's answer, without the heap
                a, b = pair
                best = a if load[a] <= load[b] else b
                load[best] -= neg
            else:
                top = heap[0]
                while top[0] != load[top[1]]:   # loads only grow: a stale top is refreshed and re-sorted
                    heapreplace(heap, (load[top[1]], top[1]))
                    top = heap[0]
                best = top[1]
                load[best] -= neg
                heapreplace(heap, (load[best], best))
            h = firsts[best]
            by_rank[best].append(p)
            pi = None
        choose(h)
        n = len(copies)
        mark(n)
        # copies_of(x, h, n), inlined for the common case: one unsplit copy
        limit = max_bytes.get(x.itemsize)
        if limit is None or -neg > limit:
            extend(copies_of(x, h, n))
            continue
        spiece = h.piece
        if pi is None:
            pi = by_id.get(id(spiece)) or info(spiece)
        offs, sizes = x.offsets, x.sizes
        poffs, gid = pi
        skey = (tuple(map(sub, offs, poffs)), sizes, gid)
        slbox = sget(skey)
        if slbox is None:
            slbox = src_boxes[skey] = unchecked_box(*to_local(spiece, offs, sizes))
        append(new(PendingCopy, (neg, best, x.dst, x.tensor, offs, sizes, n, h.buffer, slbox, x.dst_buffer,
                                 x.dst_local_offsets, x.dst_local_sizes, x.box, x.dst_local)))
    for p in _rebalance(remote, chosen, load, by_rank):
        n = first_copy[p]
        remade = copies_of(remote[p], chosen[p], n)
        copies[n:n + len(remade)] = remade
    return copies


def _rebalance(remote, chosen, load, by_rank, max_moves: int = 100000) -> list[int]:
    """Move regions off the most loaded sender while that lowers the maximum (deterministic).

    ``remote[p]`` (in greedy order) is sent by ``chosen[p]``; ``by_rank[q]`` lists the positions p
    that rank q sends; ties between regions go by their sequence number ``remote[p].seq``.  Returns
    the positions p whose sender changed, in order."""
    moved: set[int] = set()
    sets: dict[int, set[int]] = {}      # by_rank as sets, made for the ranks a move touches only

    def regions(q: int) -> set[int]:
        got = sets.get(q)
        if got is None:
            got = sets[q] = set(by_rank.get(q, ()))
        return got

    seq = lambda p: remote[p].seq
    for _ in range(max_moves):
        if not load:
            break
        top = max(load, key=lambda q: (load[q], -q))
        best_move = None
        for p in sorted(regions(top), key=seq):
            x = remote[p]
            holders, n, i = x.holders, -x.neg_nbytes, x.seq
            for q in sorted({h.rank for h in holders}):
                if q != top and load[q] + n < load[top]:
                    key = (load[q] + n, q, i)
                    if best_move is None or key < best_move[0]:
                        best_move = (key, p, q, n)
        if best_move is None:
            break
        _, p, q, n = best_move
        chosen[p] = next(h for h in remote[p].holders if h.rank == q)
        moved.add(p)
        regions(top).discard(p)
        regions(q).add(p)
        load[top] -= n
        load[q] += n
    return sorted(moved)

