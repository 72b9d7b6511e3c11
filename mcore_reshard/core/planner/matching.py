"""Matching: every destination piece against the source boxes it overlaps -> local copies and remote regions."""
from __future__ import annotations

from bisect import bisect_left
from math import prod
from operator import add, sub
from typing import Callable

from ..box import unchecked_box
from ..layout import Layout, Piece, itemsize
from .index import _raise_uncovered
from .plan import Copy, make_copy
from .records import Region, new

ToLocal = Callable[[Piece, tuple, tuple], tuple]


def local_mapper() -> ToLocal:
    """``to_local(piece, offs, sizes)``: the (offsets, sizes) in ``piece``'s buffer of a sub-box of its global box."""
    # id(piece) -> local minus global offsets (a tuple), or for a reshaped piece (size-1 dims differ,
    # see Piece.local_of) a list [local offsets, [(global dim, local dim, local minus global offset)],
    # local ndim]
    local_maps: dict[int, tuple | list] = {}

    def to_local(p: Piece, offs: tuple, sizes: tuple) -> tuple[tuple, tuple]:
        key = id(p)
        delta = local_maps.get(key)
        if delta is None:
            pb, pl = p.box, p.local
            if pb.sizes == pl.sizes:
                delta = tuple(l - g for l, g in zip(pl.offsets, pb.offsets))
            else:
                gdims = [d for d, s in enumerate(pb.sizes) if s != 1]
                ldims = [d for d, s in enumerate(pl.sizes) if s != 1]
                delta = [pl.offsets, [(g, l, pl.offsets[l] - pb.offsets[g]) for g, l in zip(gdims, ldims)], pl.ndim]
            local_maps[key] = delta
        if delta.__class__ is tuple:
            return tuple(map(add, offs, delta)), sizes
        base, pairs, nd = delta
        lo, ls = list(base), [1] * nd
        for g, l, dd in pairs:
            lo[l] = offs[g] + dd
            ls[l] = sizes[g]
        return tuple(lo), tuple(ls)
    return to_local


def _source_windows(index: dict, shared_ranks: bool) -> tuple[dict, list]:
    """(tensor -> ([(holders, holder ranks)] per source box, shape id), shape id -> its windows).

    Tensors whose source boxes are the same (e.g. one per layer) share a shape id, so the geometry
    of a destination piece against them is computed once and reused for every layer.  A shape's
    windows: its source boxes grouped by their *tail* (offsets and ends past dim 0; one group per
    distinct tail, e.g. the gate and the up half of 256 stacked experts), each group
    (tail offsets, tail ends, [(box index, dim-0 start, dim-0 end)] sorted by start, the starts,
    the longest dim-0 size) for a bisect on dim 0 within the group; 0-d tensors: one group, empty
    tail.  A destination piece then meets a group's tail once, and only the boxes of the groups
    whose tail it overlaps, near it in dim 0, are looked at.  Holder ranks (for the local-copy
    check) are only needed where a rank is in both layouts (``shared_ranks``)."""
    sources: dict[str, tuple[list, int]] = {}
    no_ranks: frozenset = frozenset()
    shape_ids: dict[tuple, int] = {}
    windows: list[list[tuple]] = []
    for name, items in index.items():
        keys = tuple((b.offsets, b.sizes) for b, _ in items)
        sid = shape_ids.get(keys)
        if sid is None:
            sid = shape_ids[keys] = len(windows)
            tails: dict[tuple, list] = {}
            for k, (b, _) in enumerate(items):
                o, e = b.offsets, b.ends
                tails.setdefault((o[1:], e[1:]), []).append((k, o[0], e[0]) if o else (k, 0, 1))
            groups = []
            for (to, te), rows in tails.items():
                rows.sort(key=lambda x: x[1])   # stable: box order within equal starts
                groups.append((to, te, rows, [x[1] for x in rows], max(x[2] - x[1] for x in rows)))
            windows.append(groups)
        sources[name] = ([(h, frozenset(x.rank for x in h) if shared_ranks else no_ranks) for _, h in items], sid)
    return sources, windows


def match(src: Layout, dst: Layout, tensors: dict, index: dict, to_local: ToLocal) -> tuple[list[Copy], list[Region], int]:
    """(local copies, remote regions, lower bound in bytes) of every destination piece, in destination order.

    A remote region is a :class:`~.records.Region`: its fields up to the (unique) sequence number
    are the sender greedy's order, so a plain sort gives it without key tuples.  Raises :class:`PlanError` where no source covers a piece."""
    sources, windows = _source_windows(index, not set(src.buffers).isdisjoint(dst.buffers))
    geometry: dict[tuple, tuple[bool, list]] = {}
    lboxes: dict[tuple, object] = {}    # (offsets, sizes) -> one shared Box (boxes are immutable)

    def regions_of(key: tuple, dp: Piece) -> tuple[bool, list]:
        """(whether they cover it, [(source row, offsets, sizes, elements, Box, dst local offsets,
        dst local sizes, dst local Box)] in source box order) of destination piece ``dp`` against
        source boxes ``sid``; ``key`` = (sid, dp's box offsets and sizes, dp's local offsets and
        sizes).  Per window group (:func:`_source_windows`): the tail's overlap once, then the
        dim-0 overlap of each box near the piece; a flat piece's local offsets are the tail's
        shifted once plus dim 0's."""
        dbox = dp.box
        do, de = dbox.offsets, dbox.ends
        nd = len(do)
        pl = dp.local
        flat = nd and dbox.sizes == pl.sizes
        if flat:
            delta = tuple(map(sub, pl.offsets, do))
            dd0 = delta[0]
        d0, e0 = (do[0], de[0]) if nd else (0, 1)
        tdo, tde = do[1:], de[1:]
        out, covered = [], 0
        groups = windows[key[0]]
        for to, te, rows, starts, longest in groups:
            tlo = tuple(map(max, to, tdo))
            tsz = tuple(map(sub, map(min, te, tde), tlo))
            if tsz and min(tsz) <= 0:
                continue
            tn = prod(tsz)
            if flat:
                tdlo = tuple(map(add, tlo, delta[1:]))
            for j in range(bisect_left(starts, d0 - longest + 1), bisect_left(starts, e0)):
                k, s0, s1 = rows[j]
                lo0 = s0 if s0 > d0 else d0
                n0 = (s1 if s1 < e0 else e0) - lo0
                if n0 <= 0:
                    continue
                numel = n0 * tn
                covered += numel
                if nd:
                    lo, sizes = (lo0,) + tlo, (n0,) + tsz
                else:
                    lo = sizes = ()
                if flat:
                    dlo, dls = (lo0 + dd0,) + tdlo, sizes
                else:
                    dlo, dls = to_local(dp, lo, sizes)
                lkey = (dlo, dls)
                dlbox = lboxes.get(lkey)
                if dlbox is None:
                    dlbox = lboxes[lkey] = unchecked_box(dlo, dls)
                out.append((k, lo, sizes, numel, unchecked_box(lo, sizes), dlo, dls, dlbox))
        if len(groups) > 1:
            out.sort()                  # source box order (the box index k is unique)
        got = geometry[key] = (covered == prod(dbox.sizes), out)
        return got

    local: list[Copy] = []
    remote: list[Region] = []
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
                rows, sid = src_rows
                gkey = (sid, dbox.offsets, dbox.sizes, dlocal.offsets, dlocal.sizes)
                got = geometry.get(gkey)
                complete, regions = got if got is not None else regions_of(gkey, dp)
                for k, lo, sizes, numel, rbox, dlo, dls, dlbox in regions:
                    holders, hranks = rows[k]
                    if r in hranks:
                        hr, hb, hp = next(h for h in holders if h.rank == r)
                        slo, sls = to_local(hp, lo, sizes)
                        local.append(make_copy(tname, rbox, hr, hb, unchecked_box(slo, sls), r, bname, dlbox, numel * isz))
                    else:
                        append(new(Region, (-numel * isz, tname, lo, sizes, r, bname, len(remote), holders, dp, isz,
                                            rbox, dlo, dls, dlbox)))
                        lower_bound += numel * isz
                if not complete:
                    _raise_uncovered(tensors, index, r, bname, dp, [rbox for _, _, _, _, rbox, *_ in regions])
    return local, remote, lower_bound
