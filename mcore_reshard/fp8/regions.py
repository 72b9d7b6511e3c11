"""Block ownership: which rank quantizes which block (:func:`plan_regions`), and each owner's temporaries."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..core.box import Box, split_sizes, subtract
from ..core.layout import Buffer, Layout, Piece, itemsize
from ..core.planner import PlanError
from ..core.planner.index import atoms, source_index
from ..core.planner.plan import align
from .quant_layout import FP8, SCALE_DTYPE, scale_name


@dataclass(frozen=True)
class Region:
    """``owner`` quantizes element box ``box`` (block box ``grid``) of ``tensor``.  ``kind`` is
    ``"shard"`` (read in place from source buffer ``input`` at ``input_local``) or ``"assembled"``
    (read from the temporary buffer ``input`` that stage A fills).  Results go to temporaries
    ``q_buffer`` (float8_e4m3fn, shape of ``box``) and ``s_buffer`` (fp32, shape of ``grid``)."""
    tensor: str
    box: Box
    grid: Box
    owner: int
    kind: str
    input: str
    input_local: Box
    q_buffer: str
    s_buffer: str
    q_local: Box | None = None      # where the region lies in q_buffer / s_buffer (None: all of it);
    s_local: Box | None = None      # regions of one owner adjacent along dim 0 share the two buffers

    def to_json(self) -> list:
        out = [self.tensor, self.box.to_json(), self.grid.to_json(), self.owner, self.kind, self.input,
               self.input_local.to_json(), self.q_buffer, self.s_buffer]
        if self.q_local is not None:
            out += [self.q_local.to_json(), self.s_local.to_json()]
        return out

    @staticmethod
    def from_json(o) -> "Region":
        more = (Box.from_json(o[9]), Box.from_json(o[10])) if len(o) > 9 else (None, None)
        return Region(o[0], Box.from_json(o[1]), Box.from_json(o[2]), o[3], o[4], o[5], Box.from_json(o[6]), o[7], o[8],
                      *more)




# ----------------------------------------------------------------------------------- layouts

def restrict(layout: Layout, names: set[str], *, whole: bool = False, keep_empty: bool = False) -> Layout:
    """Only the pieces of ``names`` (buffers keep their shape).  ``whole``: a buffer must hold only
    such pieces or none (destination buffers are written completely by one plan)."""
    out = Layout({n: m for n, m in layout.tensors.items() if n in names}, {})
    for r in layout.ranks:
        bufs = {}
        for bname, buf in layout.buffers[r].items():
            mine = tuple(p for p in buf.pieces if p.tensor in names)
            if whole and mine and len(mine) != len(buf.pieces):
                other = next(p.tensor for p in buf.pieces if p.tensor not in names)
                raise PlanError(f"rank {r} buffer {bname} holds {mine[0].tensor} and {other}, planned apart")
            if mine:
                bufs[bname] = buf if len(mine) == len(buf.pieces) else Buffer(buf.name, buf.shape, buf.dtype, mine)
            elif keep_empty and not buf.pieces:
                bufs[bname] = buf
        if bufs:
            out.buffers[r] = bufs
    return out


def _grid_of(box: Box, shape: Sequence[int], block: tuple[int, int]) -> tuple[Box, Box | None]:
    """(blocks the box touches, blocks wholly inside it or None), as block boxes."""
    nd = len(shape)
    t_off, t_size = list(box.offsets[:-2]), list(box.sizes[:-2])
    i_off, i_size = list(t_off), list(t_size)
    empty = False
    for k, d in enumerate((nd - 2, nd - 1)):
        B, o, e, n = block[k], box.offsets[d], box.ends[d], shape[d]
        lo, hi = o // B, -(-e // B)
        t_off.append(lo)
        t_size.append(hi - lo)
        ilo, ihi = -(-o // B), (-(-e // B) if e == n else e // B)
        empty |= ihi <= ilo
        i_off.append(ilo)
        i_size.append(max(0, ihi - ilo))
    return Box(tuple(t_off), tuple(t_size)), None if empty else Box(tuple(i_off), tuple(i_size))


def _elements(grid: Box, shape: Sequence[int], block: tuple[int, int]) -> Box:
    nd = len(shape)
    offs, sizes = list(grid.offsets[:-2]), list(grid.sizes[:-2])
    for k, d in enumerate((nd - 2, nd - 1)):
        lo = grid.offsets[d] * block[k]
        hi = min((grid.offsets[d] + grid.sizes[d]) * block[k], shape[d])
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def _split_among(grid: Box, n: int) -> list[Box]:
    """``grid`` in ``n`` parts along its first dim with >= n blocks (else its longest dim)."""
    if n == 1:
        return [grid]
    dims = [d for d, s in enumerate(grid.sizes) if s >= n]
    d = dims[0] if dims else max(range(grid.ndim), key=lambda k: (grid.sizes[k], -k))
    out, pos = [], grid.offsets[d]
    for s in split_sizes(grid.sizes[d], n, "even"):
        if s:
            offs, sizes = list(grid.offsets), list(grid.sizes)
            offs[d], sizes[d] = pos, s
            out.append(Box(tuple(offs), tuple(sizes)))
        pos += s
    return out


def plan_regions(src: Layout, tensors: Sequence[str], block: tuple[int, int], dst: Layout | None = None,
                 index: Mapping | None = None) -> list[Region]:
    """Every block of every tensor in ``tensors`` owned exactly once (see the module doc).

    With ``dst``, owners are chosen where the quantized bytes are needed: the aligned interior of
    a source box is split among the holders that are destinations of some of it (each part to the
    one needing most of it), or among all its holders when none is; a cut block goes to a holder of
    its largest part, preferring one that needs it.  Remaining ties: least-loaded, then lowest rank.
    """
    if index is None:
        index = source_index(restrict(src, set(tensors)))
    index = {n: index[n] for n in tensors if n in index}
    wants: dict[tuple[str, int], list[Box]] = defaultdict(list)       # (tensor, rank) -> boxes it needs
    if dst is not None:
        for r, _, p in dst.iter_pieces():
            if p.tensor in index:
                wants[(p.tensor, r)].append(p.box)
    load: dict[int, int] = defaultdict(int)         # elements quantized per rank so far
    regions: list[Region] = []
    geometry: dict[tuple, tuple] = {}

    def need(name: str, rank: int, box: Box) -> int:
        n = 0
        for b in wants.get((name, rank), ()):
            inter = b.intersect(box)
            n += inter.numel if inter is not None else 0
        return n

    def pick(name: str, ranks, box: Box) -> int:
        return min(ranks, key=lambda q: (-need(name, q, box), load[q], q))

    for name in tensors:
        shape = src.tensors[name].shape
        items = index.get(name, [])
        k = 0
        boundary: list[Box] = []
        owners_of: list[int] = []                   # boundary box -> item index
        for i, (sbox, holders) in enumerate(items):
            first: dict[int, tuple] = {}
            for h in holders:
                first.setdefault(h.rank, h)
            gkey = (shape, sbox.offsets, sbox.sizes)    # the same for every layer: computed once
            geo = geometry.get(gkey)
            if geo is None:
                touched, inner = _grid_of(sbox, shape, block)
                geo = geometry[gkey] = (inner, [touched] if inner is None else subtract(touched, inner),
                                        None if inner is None else _elements(inner, shape, block))
            inner, rest, ibox = geo
            if inner is not None:
                free = ({q for q in first if need(name, q, ibox)} or set(first)) if len(first) > 1 else set(first)
                parts = [inner] if len(free) == 1 else sorted(_split_among(inner, len(free)), key=lambda b: (-b.numel, b))
                for part in parts:           # largest part first, one part per replica
                    ebox = ibox if part is inner else _elements(part, shape, block)
                    r = pick(name, free, ebox) if len(free) > 1 else next(iter(free))
                    free.discard(r)
                    hr, hb, hp = first[r]
                    regions.append(Region(name, ebox, part, r, "shard", hb, hp.local_of(ebox),
                                          f"fp8/q/{name}/{k}", f"fp8/s/{name}/{k}"))
                    load[r] += ebox.numel
                    k += 1
            for b in rest:
                boundary.append(b)
                owners_of.append(i)
        for atom, idx in atoms(boundary) if boundary else ():
            ebox = _elements(atom, shape, block)
            parts = {}
            for j in idx:
                inter = items[owners_of[j]][0].intersect(ebox)
                parts[owners_of[j]] = inter.numel if inter is not None else 0
            top = max(parts.values())
            holders = sorted({h.rank for i, n in parts.items() if n == top for h in items[i].holders})
            r = pick(name, holders, ebox) if len(holders) > 1 else holders[0]
            load[r] += ebox.numel
            regions.append(Region(name, ebox, atom, r, "assembled", f"fp8/asm/{name}/{k}", Box.full(ebox.sizes),
                                  f"fp8/q/{name}/{k}", f"fp8/s/{name}/{k}"))
            k += 1
    return regions



def _temp_buffers(regions: Sequence[Region], src: Layout) -> dict[int, list[tuple[str, Buffer]]]:
    """rank -> [(role, buffer)] of its temporaries: assembly (source dtype), fp8, scales.  Regions
    sharing a q / s buffer (``q_local``) get one buffer spanning them all (they tile it along dim 0)."""
    out: dict[int, list[tuple[str, Buffer]]] = defaultdict(list)
    shared: dict[str, list[Region]] = defaultdict(list)
    for g in regions:
        if g.q_local is not None:
            shared[g.q_buffer].append(g)
    done: set[str] = set()
    for g in regions:
        full = Box.full(g.box.sizes)
        if g.kind == "assembled":
            dt = src.tensors[g.tensor].dtype
            out[g.owner].append(("asm", Buffer(g.input, g.box.sizes, dt, (Piece(g.tensor, g.box, full),))))
        if g.q_local is None:
            box, grid = g.box, g.grid
        elif g.q_buffer in done:
            continue
        else:
            done.add(g.q_buffer)
            rs = shared[g.q_buffer]
            lo, glo = min(r.box.offsets[0] for r in rs), min(r.grid.offsets[0] for r in rs)
            box = Box((lo,) + g.box.offsets[1:], (sum(r.box.sizes[0] for r in rs),) + g.box.sizes[1:])
            grid = Box((glo,) + g.grid.offsets[1:], (sum(r.grid.sizes[0] for r in rs),) + g.grid.sizes[1:])
        out[g.owner].append(("q", Buffer(g.q_buffer, box.sizes, FP8, (Piece(g.tensor, box, Box.full(box.sizes)),))))
        out[g.owner].append(("s", Buffer(g.s_buffer, grid.sizes, SCALE_DTYPE,
                                         (Piece(scale_name(g.tensor), grid, Box.full(grid.sizes)),))))
    return out


def _share_temps(regions: list[Region]) -> list[Region]:
    """Regions of one owner and tensor that are adjacent along dim 0 (e.g. one per expert, as
    Megatron holds experts) write one q and one s buffer together: stage B then moves one box
    instead of one per expert."""
    by: dict[tuple, list[int]] = defaultdict(list)
    for i, reg in enumerate(regions):
        by[(reg.owner, reg.tensor, reg.box.offsets[1:], reg.box.sizes[1:], reg.grid.offsets[1:],
            reg.grid.sizes[1:])].append(i)
    out = list(regions)
    for idx in by.values():
        if len(idx) < 2:
            continue
        idx.sort(key=lambda i: regions[i].box.offsets[0])
        runs: list[list[int]] = []
        for i in idx:
            prev = regions[runs[-1][-1]] if runs else None
            cur = regions[i]
            if (prev is not None and prev.box.offsets[0] + prev.box.sizes[0] == cur.box.offsets[0]
                    and prev.grid.offsets[0] + prev.grid.sizes[0] == cur.grid.offsets[0]):
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            if len(run) < 2:
                continue
            head = regions[run[0]]
            a, ga = head.box.offsets[0], head.grid.offsets[0]
            for i in run:
                r = regions[i]
                out[i] = Region(r.tensor, r.box, r.grid, r.owner, r.kind, r.input, r.input_local,
                                head.q_buffer + "+", head.s_buffer + "+",
                                Box((r.box.offsets[0] - a,) + (0,) * (r.box.ndim - 1), r.box.sizes),
                                Box((r.grid.offsets[0] - ga,) + (0,) * (r.grid.ndim - 1), r.grid.sizes))
    return out


def _nbytes(buf: Buffer) -> int:
    n = itemsize(buf.dtype)
    for s in buf.shape:
        n *= s
    return align(n)

