"""Finding layer templates (:mod:`.templates`): tensors grouped by the layer number in their name,
every group put in canonical form (names with the layer number replaced by a mark, ranks by their
index among the group's ranks, sorted or rotated), the template's own layouts from a form."""
from __future__ import annotations

import re
from collections import defaultdict
from itertools import groupby, repeat
from operator import attrgetter, itemgetter

from ..box import Box, unchecked_box
from ..layout import Buffer, Layout, Piece, TensorMeta
from .records import Instance, LayerNumbers

LAYER = re.compile(r"layers\.(\d+)\.")
MARK = "\x00"               # stands for the layer number in a canonical name


def layer_number(name: str) -> int | None:
    """The layer number in a tensor or buffer name (``decoder.layers.3.mlp.w`` -> 3), or None."""
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def _canon(name: str, n: int | None) -> str:
    """``name`` with ``layers.<n>.`` replaced by the mark (unchanged when n is None or absent)."""
    return name if n is None else name.replace(f"layers.{n}.", f"layers.{MARK}.")


def _layer_of(src: Layout, dst: Layout) -> dict[str, int | None]:
    """Every tensor name of either side -> its layer number (None: no ``layers.<n>.``)."""
    return {name: layer_number(name) for name in set(src.tensors) | set(dst.tensors)}


def _groups(src: Layout, dst: Layout, layer_of: dict[str, int | None]) -> dict | None:
    """group key (layer number or None) -> {"src"|"dst": [(rank, (buffer names, Buffers, their
    ids))]}, the buffers of each rank in name order, or None when a buffer holds tensors of two
    groups (nothing to template then).  Ranks with the same buffers (replicas) share one tuple
    per group.  ``layer_of``: tensor name -> its layer number (:func:`_layer_of`)."""
    out: dict = defaultdict(lambda: {"src": [], "dst": []})
    group_of: dict[int, object] = {}        # id(buffer) -> its group
    profiles: dict[tuple, dict] = {}
    # a rank's buffer names in insertion order -> (the same sorted, interned; the permutation):
    # ranks built alike list their names alike, so each order is sorted once, not once per rank
    orders: dict[tuple, tuple] = {}
    canon: dict[tuple, tuple] = {}
    shared: dict[tuple, tuple] = {}         # a group's buffer ids on a rank -> its (names, buffers, ids)
    bad = object()
    gget = group_of.get
    pieces_of, tensor_of, first_of = attrgetter("pieces"), attrgetter("tensor"), itemgetter(0)
    for side, lay in (("src", src), ("dst", dst)):
        for r in sorted(lay.buffers):
            bufs = lay.buffers[r]
            ins = tuple(bufs)
            got = orders.get(ins)
            if got is None:
                perm = sorted(range(len(ins)), key=ins.__getitem__)
                srt = tuple(map(ins.__getitem__, perm))
                got = orders[ins] = (canon.setdefault(srt, srt), perm)
            names, perm = got
            vals = list(bufs.values())
            vals = list(map(vals.__getitem__, perm))
            ids = tuple(map(id, vals))
            key = (id(names), ids)      # names interned: one object per name list
            prof = profiles.get(key)
            if prof is None:
                gs = list(map(gget, ids, repeat(bad, len(ids))))
                if bad in gs:           # buffers not seen before: the one layer number of their pieces
                    new = [k for k, g in enumerate(gs) if g is bad]
                    pcs = list(map(pieces_of, map(vals.__getitem__, new)))
                    if all(pcs):
                        got = list(map(layer_of.__getitem__, map(tensor_of, map(first_of, pcs))))
                    else:
                        got = [layer_of[ps[0].tensor] if ps else None for ps in pcs]
                    for ps, g in zip(pcs, got):
                        if len(ps) > 1:
                            for p in ps:
                                if layer_of[p.tensor] != g:
                                    return None
                    for k, g in zip(new, got):
                        gs[k] = g
                    group_of.update(zip(map(ids.__getitem__, new), got))
                # a group's names share their "layers.<n>." prefix: runs in name order, mostly one
                spans: dict = {}
                a = 0
                for g, run in groupby(gs):
                    b = a + len(list(run))
                    at = spans.get(g)
                    if at is None:
                        spans[g] = [(a, b)]
                    else:
                        at.append((a, b))
                    a = b
                vals = tuple(vals)
                prof = profiles[key] = {}
                for g, at in spans.items():
                    items = ((names[at[0][0]:at[0][1]], vals[at[0][0]:at[0][1]], ids[at[0][0]:at[0][1]])
                             if len(at) == 1 else tuple(sum((seq[a:b] for a, b in at), ()) for seq in (names, vals, ids)))
                    # ranks holding the same buffers of a group share one tuple (rows are made per tuple)
                    prof[g] = shared.setdefault(items[2], items)
            for g, items in prof.items():
                out[g][side].append((r, items))
    return out


class _Forms:
    """Canonical forms of rank rows (a rank's buffers of one group), each given a small id.

    A row's key is (its canonical buffer names, the form id of each buffer): a buffer's form
    (shape, dtype, canonical pieces) is made and given an id once per Buffer object, and canonical
    names are cached per layer number, so a row costs two lookups per buffer and one hash of two
    flat tuples (not a hash of every piece of every buffer again)."""

    def __init__(self, layer_of: dict[str, int | None]):
        # tensor name -> its canonical name (a buffer's pieces are all of its group g = their
        # tensors' layer number, so this is ``_canon(tensor, g)``)
        self.tcanon = {t: _canon(t, n) for t, n in layer_of.items()}
        self.ids: dict[tuple, int] = {}
        self.rows: list[tuple] = []         # id -> (canonical buffer names, form ids)
        self.row_of: dict[tuple, int] = {}  # (id(items), g, n) -> row id
        self.fid: dict[int, int] = {}       # id(buffer) -> form id (buffers outlive the planning)
        self.fids: dict[tuple, int] = {}    # form -> form id
        self.forms: list[tuple] = []        # form id -> (shape, dtype, canonical pieces)
        self.names: dict[int | None, dict[str, str]] = {}     # n -> name -> canonical name
        self.row_tensors: dict[int, list[str]] = {}         # row id -> canonical names of its tensors

    def tensors(self, rid: int, items: tuple) -> list[str]:
        """The canonical names of the tensors row ``rid`` holds pieces of (``items``: a row with that
        id), made once per row id."""
        got = self.row_tensors.get(rid)
        if got is None:
            tc = self.tcanon
            got = self.row_tensors[rid] = sorted({tc[p.tensor] for buf in items[1] for p in buf.pieces})
        return got

    def form(self, buf: Buffer) -> int:
        tc = self.tcanon
        f = (buf.shape, buf.dtype, tuple([(tc[p.tensor], p.box.offsets, p.box.sizes, p.local.offsets, p.local.sizes)
                                          for p in buf.pieces]))
        i = self.fids.get(f)
        if i is None:
            i = self.fids[f] = len(self.forms)
            self.forms.append(f)
        self.fid[id(buf)] = i
        return i

    def row(self, items: tuple, g, n) -> int:
        key = (id(items), g, n)
        got = self.row_of.get(key)
        if got is None:
            names = self.names.get(n)
            if names is None:
                names = self.names[n] = {}
            bnames, bufs, ids = items
            cn = list(map(names.get, bnames))
            if None in cn:
                cn = [c if c is not None else names.setdefault(b, _canon(b, n)) for c, b in zip(cn, bnames)]
            fs = list(map(self.fid.get, ids))
            if None in fs:
                form = self.form
                fs = [f if f is not None else form(buf) for f, buf in zip(fs, bufs)]
            content = (tuple(cn), tuple(fs))
            got = self.ids.get(content)
            if got is None:
                got = self.ids[content] = len(self.rows)
                self.rows.append(content)
            self.row_of[key] = got
        return got


def _signature(g, members: dict, src: Layout, dst: Layout, forms: _Forms, span: int | None = None) -> tuple:
    """(canonical form, layer numbers (tensors, src buffers, dst buffers), ranks) of one group.
    Rank indices: the group's ranks in increasing order, or with ``span`` in increasing order of
    ``(rank - base) % span`` (``base``: the group's lowest source rank), i.e. rotated so that the
    source ranks of two pipeline stages of a colocated job get the same indices.  Example: training
    tp=2 per stage (stage 0 on ranks 0-1, stage 1 on 2-3), two inference replicas of tp=2 on the
    same ranks (rank r holds shard r % 2), ``span`` 4::

        group           | its ranks | sorted order -> index | rotated order -> index
        a stage-0 layer | 0 1 2 3   | 0 1 2 3 -> 0 1 2 3   | 0 1 2 3 -> 0 1 2 3
        a stage-1 layer | 0 1 2 3   | 0 1 2 3 -> 0 1 2 3   | 2 3 0 1 -> 0 1 2 3

    sorted, the stage-1 layer's sources are indices 2-3 (another form); rotated, indices 0-1 hold
    sources and 0-3 shards 0 1 0 1 in both: one template (tests/core/planner/test_planner_templates.py)."""
    nums = [g]
    for side in ("src", "dst"):
        n = None
        if g is not None:
            for _, items in members[side]:
                for bname in items[0]:
                    n = layer_number(bname)
                    if n is not None:
                        break
                if n is not None:
                    break
        nums.append(n)
    ranks = _rank_order(members, span)
    idx = {r: i for i, r in enumerate(ranks)}
    form = []
    nums = LayerNumbers(*nums)
    for side, lay, n in (("src", src, nums.src), ("dst", dst, nums.dst)):
        rows = []
        names: set[str] = set()
        seen: set[int] = set()
        for r, items in members[side]:
            rid = forms.row(items, g, n)
            if rid not in seen:         # equal rows of one group hold the same tensors
                seen.add(rid)
                names.update(forms.tensors(rid, items))
            rows.append((idx[r], rid))
        tm = lay.tensors
        # names are canonical (the group's layer number g marked): the real name puts g back
        metas = tuple(sorted((t, m.shape, m.dtype) for t, m in
                             ((t, tm[t if g is None else t.replace(MARK, str(g))]) for t in names)))
        rows.sort()                 # index order (rank order unless rotated)
        form.append((tuple(rows), metas))
    return tuple(form), nums, tuple(ranks)


def _rank_order(members: dict, span: int | None) -> list[int]:
    """A group's ranks in index order (:func:`_signature`): increasing, or with ``span`` rotated to
    start at the group's lowest source rank."""
    ranks = sorted({r for side in ("src", "dst") for r, _ in members[side]})
    if span is not None and ranks:
        base = min((r for r, _ in members["src"]), default=ranks[0])
        ranks.sort(key=lambda r: (r - base) % span)
    return ranks


def _rotation_changes(groups: dict, span: int) -> bool:
    """Whether rotating changes some group's rank order (else its forms are the sorted ones)."""
    return any(_rank_order(m, span) != _rank_order(m, None) for m in groups.values())


def _canonical_layouts(form: tuple, forms: _Forms) -> tuple[Layout, Layout]:
    """The template's own layouts (canonical names, rank indices) from its canonical form; ranks
    with the same row (replicas) share its Buffer objects, and so do ranks whose rows have a
    buffer of the same name and form; equal boxes one Box (the pieces come from checked layouts:
    no checks again)."""
    out = []
    boxes: dict[tuple, Box] = {}

    def box(o: tuple, z: tuple) -> Box:
        b = boxes.get((o, z))
        if b is None:
            b = boxes[(o, z)] = unchecked_box(o, z)
        return b

    for rows, metas in form:
        lay = Layout({t: TensorMeta(t, shape, dt) for t, shape, dt in metas}, {})
        built: dict[int, dict] = {}
        made: dict[tuple[str, int], Buffer] = {}    # (canonical name, form id) -> its Buffer
        for i, rid in rows:
            mine = built.get(rid)
            if mine is None:
                mine = built[rid] = {}
                for bname, f in zip(*forms.rows[rid]):
                    b = made.get((bname, f))
                    if b is None:       # rows differing in some buffers share the others
                        shape, dtype, pieces = forms.forms[f]
                        b = made[(bname, f)] = Buffer(bname, shape, dtype, tuple(
                            Piece(t, box(bo, bs), box(lo, ls)) for t, bo, bs, lo, ls in pieces))
                    mine[bname] = b
            lay.buffers.setdefault(i, {}).update(mine)
        out.append(lay)
    return out[0], out[1]


def _instances(groups: dict, src: Layout, dst: Layout, forms: _Forms, span: int | None) -> tuple[list, list]:
    """(canonical forms of the templates, instances (template id, layer numbers, ranks)), the
    groups in layer order (the unnumbered one first); ``span``: rank indices rotated (:func:`_signature`)."""
    tids: dict[tuple, int] = {}
    reps: list[tuple] = []
    instances: list[tuple[int, tuple, tuple]] = []
    for g in sorted(groups, key=lambda k: (k is not None, k or 0)):
        form, nums, ranks = _signature(g, groups[g], src, dst, forms, span)
        tid = tids.get(form)
        if tid is None:
            tid = tids[form] = len(reps)
            reps.append(form)
        instances.append(Instance(tid, nums, ranks))
    return reps, instances
