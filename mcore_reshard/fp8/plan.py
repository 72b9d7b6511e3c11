"""Quantization plan: BF16 source shards -> block-FP8 target shards (pure: no torch).

``make_fp8_plan(src, dst, block)`` takes a BF16 (or fp32) source layout and an FP8 target layout
(:func:`mcore_reshard.fp8.layout.fp8_target`) and decides, for every quantized tensor, which rank
quantizes which 128x128 block -- each block exactly once -- and how the results travel:

* **ownership**: a block lying wholly inside one source box is quantized by one of that box's
  holders (replicas split the box's aligned interior by block rows; holders that are destinations
  of the block are preferred, so colocated ranks quantize what they keep; otherwise least-loaded
  first, ties to the lowest rank); a block cut by source boxes is owned by a holder of its largest
  part (a destination first, then least-loaded);
* **stage A (assembly)**: cut blocks are gathered on their owner into temporary buffers by an
  ordinary :func:`~mcore_reshard.core.planner.make_plan` (its network bytes are the assembly cost; the
  owner's own part is a local copy);
* **quantize** on the owner (executor: :mod:`mcore_reshard.fp8.refit`) into temporary FP8 and
  fp32-scale buffers, one pair per owned region;
* **stage B**: an ordinary ``make_plan`` from those temporaries (a "quantized source layout") to the
  target's weight and ``weight_scale_inv`` shards;
* unquantized tensors (norms, router, embedding, head) follow one ordinary BF16 plan (``rest``).

Work is chunked into groups so that each rank's temporaries fit ``memory_bytes``: tensors sharing a
destination buffer stay together when they fit, otherwise they are cut by experts (leading dim) or
block rows, and a destination buffer is then written slab by slab (dim-0 views) by several groups.
Every group is planned on its own, and one arena per rank (the largest group, <= ``memory_bytes``)
holds the temporaries of every group in turn.  A unit that cannot fit raises :class:`PlanError`.

Example, ``[40, 32]`` bf16, block 16, source tp=2 over rows on ranks 0-1 (rows 0:20 | 20:40),
destination whole on rank 2::

    block rows | held by            | owner | how
    0:16       | rank 0             | 0     | quantized in place from rank 0's shard
    16:32      | rank 0 (4 rows),   | 1     | stage A: rank 0 sends rows 16:20 (4x32x2 = 256 B) to
               | rank 1 (12 rows)   |       |  rank 1, which copies rows 20:32 locally
    32:40      | rank 1             | 1     | ragged last block, in place
    stage B: 40x32 e4m3 (1280 B) + 3x2 fp32 scales (24 B) to rank 2, against 2560 B in BF16.

The plan is plain data (JSON, never pickle) with one combined sha256 :attr:`Fp8Plan.hash`.
"""
from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..core.box import Box, split_sizes, subtract
from .layout import FP8, SCALE_DTYPE, bf16_target, check_block, quantized_of, scale_name, scale_shape
from ..core.layout import Buffer, Layout, Piece, itemsize
from ..core.planner import ALIGN, DEFAULT_BUDGET, Plan, PlanError, _atoms, _source_index, make_plan

FP8_PLAN_VERSION = 2


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


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


@dataclass
class Fp8Group:
    tensors: list[str]
    regions: list[Region]
    assembly: Plan | None                         # stage A (None: no cut blocks in this group)
    stage_b: Plan
    temp: dict[int, dict[str, list]]              # rank -> temp buffer -> [shape, dtype, arena offset]
    # rank -> stage-B destination name -> [target buffer, dim-0 start, dim-0 end]: slabs of a target
    # buffer that several groups write (each its own slab; the slab is a contiguous view)
    views: dict[int, dict[str, list]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"tensors": self.tensors, "regions": [r.to_json() for r in self.regions],
                "assembly": None if self.assembly is None else self.assembly.to_json(),
                "stage_b": self.stage_b.to_json(),
                "temp": {str(r): t for r, t in sorted(self.temp.items())},
                "views": {str(r): v for r, v in sorted(self.views.items())}}

    @staticmethod
    def from_json(o) -> "Fp8Group":
        return Fp8Group(list(o["tensors"]), [Region.from_json(r) for r in o["regions"]],
                        None if o["assembly"] is None else Plan.from_json(o["assembly"]), Plan.from_json(o["stage_b"]),
                        {int(r): t for r, t in o["temp"].items()}, {int(r): v for r, v in o.get("views", {}).items()})


@dataclass
class Fp8Plan:
    block: tuple[int, int]
    quantized: list[str]
    rest: Plan                                    # unquantized tensors, one ordinary plan
    groups: list[Fp8Group]
    arena: dict[int, int]                         # rank -> bytes of its temporaries (largest group)
    stats: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": FP8_PLAN_VERSION, "block": list(self.block), "quantized": self.quantized,
                "rest": self.rest.to_json(), "groups": [g.to_json() for g in self.groups],
                "arena": {str(r): n for r, n in sorted(self.arena.items())}, "stats": self.stats}

    @staticmethod
    def from_json(o: Mapping) -> "Fp8Plan":
        if o.get("version") != FP8_PLAN_VERSION:
            raise PlanError(f"FP8 plan version {o.get('version')} is not {FP8_PLAN_VERSION}")
        return Fp8Plan(tuple(o["block"]), list(o["quantized"]), Plan.from_json(o["rest"]),
                       [Fp8Group.from_json(g) for g in o["groups"]], {int(r): n for r, n in o["arena"].items()},
                       dict(o["stats"]))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """sha256 over the block, the regions, the temporaries and every sub-plan's own hash."""
        obj = {"version": FP8_PLAN_VERSION, "block": list(self.block), "quantized": self.quantized,
               "rest": self.rest.hash, "arena": {str(r): n for r, n in sorted(self.arena.items())},
               "groups": [{"tensors": g.tensors, "regions": [r.to_json() for r in g.regions],
                           "temp": {str(r): t for r, t in sorted(g.temp.items())},
                           "views": {str(r): v for r, v in sorted(g.views.items())},
                           "assembly": None if g.assembly is None else g.assembly.hash, "stage_b": g.stage_b.hash}
                          for g in self.groups]}
        return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def summary(self) -> str:
        s = self.stats
        return "\n".join([
            f"FP8 block {self.block[0]}x{self.block[1]}, {len(self.quantized)} quantized tensors in {len(self.groups)} group(s)",
            f"assembly (cut blocks)  {s['assembly_network_bytes']:,} B over network, {s['assembly_local_bytes']:,} B local",
            f"FP8 weights + scales   {s['fp8_weight_network_bytes']:,} + {s['fp8_scale_network_bytes']:,} B over network",
            f"unquantized tensors    {s['rest_network_bytes']:,} B over network",
            f"total                  {s['network_bytes']:,} B"
            + (f"  (BF16 refit of the same layouts: {s['bf16_network_bytes']:,} B)" if "bf16_network_bytes" in s else ""),
            f"temporaries (arena)    max {max(self.arena.values(), default=0):,} B per rank"
            + (f" (memory budget {s['memory_bytes']:,} B)" if "memory_bytes" in s else "")
            + (f", {s['split_tensors']} tensor(s) split across groups" if s.get("split_tensors") else ""),
        ])


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
        index = _source_index(restrict(src, set(tensors)))
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
                first.setdefault(h[0], h)
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
        for atom, idx in _atoms(boundary) if boundary else ():
            ebox = _elements(atom, shape, block)
            parts = {}
            for j in idx:
                inter = items[owners_of[j]][0].intersect(ebox)
                parts[owners_of[j]] = inter.numel if inter is not None else 0
            top = max(parts.values())
            holders = sorted({h[0] for i, n in parts.items() if n == top for h in items[i][1]})
            r = pick(name, holders, ebox) if len(holders) > 1 else holders[0]
            load[r] += ebox.numel
            regions.append(Region(name, ebox, atom, r, "assembled", f"fp8/asm/{name}/{k}", Box.full(ebox.sizes),
                                  f"fp8/q/{name}/{k}", f"fp8/s/{name}/{k}"))
            k += 1
    return regions


def _components(dst: Layout, quantized: set[str]) -> list[list[str]]:
    """Quantized tensors that share a destination buffer, grouped (union-find)."""
    parent = {n: n for n in quantized}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    seen: set[int] = set()
    for r in dst.ranks:
        for buf in dst.buffers[r].values():
            if id(buf) in seen:
                continue
            seen.add(id(buf))
            names = sorted({p.tensor for p in buf.pieces if p.tensor in quantized})
            for a in names[1:]:
                parent[find(a)] = find(names[0])
    comps: dict[str, list[str]] = defaultdict(list)
    for n in sorted(quantized):
        comps[find(n)].append(n)
    return sorted(comps.values())


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
    return _align(n)


# ----------------------------------------------------------------------------------- groups
#
# A group's temporaries must fit ``memory`` bytes on every rank.  Tensors sharing a destination
# buffer (a component) are kept whole when they fit together.  A component that does not fit is
# cut along dim 0 of its tensors into *chunks*: one expert (leading dim of ``[E, rows, cols]``) or
# one block row (``[rows, cols]``).  A destination buffer of such tensors is cut along its own
# dim 0 into *slabs* (contiguous views); every chunk a slab needs is planned in the slab's group, so
# chunks that share a slab are joined (union-find), and the joined units are packed in order.
# Example: vLLM ``w13_weight [256, 512, 7168]`` (TP8) holds experts 0:256 of ``gate_up_proj``; with
# 256 MiB per rank it is written by 4 groups, slabs [0:70], [70:140], ... each a view of the buffer.


def _split_names(groups: Sequence["Fp8Group"]) -> set[str]:
    seen: dict[str, int] = defaultdict(int)
    for g in groups:
        for n in g.tensors:
            seen[n] += 1
    return {n for n, k in seen.items() if k > 1}


def _granule(shape: Sequence[int], block: tuple[int, int]) -> int:
    """Chunk size along dim 0: a block row of a 2-D tensor, one index of a leading (expert) dim."""
    return block[0] if len(shape) == 2 else 1


def _region_bytes(reg: Region, numel: int, grid_numel: int, asm_isz: int) -> int:
    return (_align(numel * asm_isz) if reg.kind == "assembled" else 0) + _align(numel) + _align(grid_numel * 4)


def _chunk_rows(reg: Region, g: int) -> list[tuple[int, int, int, int]]:
    """(chunk, dim-0 start, dim-0 end) of every chunk a region crosses."""
    lo = reg.box.offsets[0]
    hi = lo + reg.box.sizes[0]
    return [(c, max(lo, c * g), min(hi, (c + 1) * g)) for c in range(lo // g, -(-hi // g))]


def _slab(buf: Buffer, a: int, b: int, name: str) -> Buffer:
    """Rows ``a:b`` of ``buf`` (dim 0) as a buffer of its own."""
    nd = len(buf.shape)
    box = Box((a,) + (0,) * (nd - 1), (b - a,) + tuple(buf.shape[1:]))
    pieces = []
    for p in buf.pieces:
        inter = p.local.intersect(box)
        if inter is not None:
            pieces.append(Piece(p.tensor, p.global_of(inter), Box((inter.offsets[0] - a,) + inter.offsets[1:], inter.sizes)))
    return Buffer(name, box.sizes, buf.dtype, tuple(pieces))


def _make_groups(src: Layout, dst: Layout, block: tuple[int, int], quantized: set[str], regions: list[Region],
                 memory: int, budget_bytes: int) -> list["Fp8Group"]:
    from .layout import _dim_map
    by_tensor: dict[str, list[Region]] = defaultdict(list)
    for reg in regions:
        by_tensor[reg.tensor].append(reg)
    asm_isz = {n: itemsize(src.tensors[n].dtype) for n in quantized}
    base_of = {n: n for n in quantized}
    base_of.update({scale_name(n): n for n in quantized})

    # 1. components that fit stay whole; the others are cut into chunks
    comps = _components(dst, quantized)
    units: list[tuple] = []                       # (sort key, mem per rank, unit id)
    whole_unit: dict[str, int] = {}               # tensor -> unit id (tensors kept whole)
    split: set[str] = set()
    comp_mem = []
    for i, comp in enumerate(comps):
        mem: dict[int, int] = defaultdict(int)
        for n in comp:
            for reg in by_tensor[n]:
                mem[reg.owner] += _region_bytes(reg, reg.box.numel, reg.grid.numel, asm_isz[n])
        comp_mem.append(mem)
        if max(mem.values(), default=0) <= memory:
            for n in comp:
                whole_unit[n] = i
        else:
            split.update(comp)

    # 2. chunks of split tensors: memory per rank, joined when they share a destination slab
    node_of: dict[tuple[str, int], int] = {}
    node_mem: list[dict[int, int]] = []
    node_key: list[tuple[str, int]] = []

    def node(t: str, c: int) -> int:
        k = node_of.get((t, c))
        if k is None:
            k = node_of[(t, c)] = len(node_key)
            node_key.append((t, c))
            node_mem.append(defaultdict(int))
        return k
    for n in sorted(split):
        shape = src.tensors[n].shape
        g = _granule(shape, block)
        for reg in by_tensor[n]:
            per_row = reg.box.numel // reg.box.sizes[0] if reg.box.sizes[0] else 0
            grid_row = reg.grid.numel // reg.grid.sizes[0] if reg.grid.sizes[0] else 0
            for c, a, e in _chunk_rows(reg, g):
                node_mem[node(n, c)][reg.owner] += _region_bytes(reg, per_row * (e - a), grid_row, asm_isz[n])
    parent = list(range(len(node_key)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(x: int, y: int) -> None:
        x, y = find(x), find(y)
        if x != y:
            parent[max(x, y)] = min(x, y)

    slabs: dict[int, tuple[Buffer, list[int], list[list[int]]]] = {}   # id(buf) -> (buf, bounds, nodes per slab)
    split_bufs: dict[int, list[tuple[int, str, Buffer]]] = defaultdict(list)
    for r in dst.ranks:
        for bname, buf in sorted(dst.buffers[r].items()):
            if not buf.pieces or base_of.get(buf.pieces[0].tensor) not in split:
                continue
            split_bufs[id(buf)].append((r, bname, buf))
            if id(buf) in slabs:
                continue
            spans = []
            for p in buf.pieces:
                t = base_of[p.tensor]
                g = _granule(src.tensors[t].shape, block) if p.tensor == t else 1
                o, e = p.box.offsets[0], p.box.ends[0]
                chunks = range(o // g, -(-e // g))
                if _dim_map(p).get(0) == 0:
                    for c in chunks:
                        ga, gb = max(o, c * g), min(e, (c + 1) * g)
                        la = p.local.offsets[0] + ga - o
                        spans.append((la, la + gb - ga, [node(t, c)]))
                else:               # dim 0 of the tensor is not the buffer's: the piece is one slab
                    spans.append((p.local.offsets[0], p.local.ends[0], [node(t, c) for c in chunks]))
            bounds = sorted({0, buf.shape[0]} | {x for a, b_, _ in spans for x in (a, b_)})
            nodes: list[list[int]] = [[] for _ in bounds[:-1]]
            for a, b_, ns in spans:
                for i in range(bisect_left(bounds, a), bisect_left(bounds, b_)):
                    nodes[i].extend(ns)
            for ns in nodes:
                for x in ns[1:]:
                    union(ns[0], x)
            slabs[id(buf)] = (buf, bounds, nodes)
    members: dict[int, list[int]] = defaultdict(list)
    for k in range(len(node_key)):
        members[find(k)].append(k)

    # 3. units in order (whole components, then joined chunks of each split component), packed
    for i, comp in enumerate(comps):
        if comp[0] in whole_unit:
            units.append(((comp[0], -1), dict(comp_mem[i]), ("comp", i)))
    for root, ks in members.items():
        mem: dict[int, int] = defaultdict(int)
        for k in ks:
            for r, x in node_mem[k].items():
                mem[r] += x
        units.append((min(node_key[k] for k in ks), dict(mem), ("chunks", root)))
    units.sort(key=lambda u: u[0])
    group_of: dict[tuple, int] = {}
    cur: dict[int, int] = defaultdict(int)
    ngroups = 0
    for key, mem, uid in units:
        over = [(r, x) for r, x in sorted(mem.items()) if x > memory]
        if over:
            r, x = over[0]
            ks = members[uid[1]]
            t = node_key[ks[0]][0]
            rows = sorted(node_key[k][1] for k in ks if node_key[k][0] == t)
            what = ("expert" if len(src.tensors[t].shape) > 2 else "block row") + ("s" if len(rows) > 1 else "")
            raise PlanError(f"FP8 temporaries of {t} ({what} {rows[0]}" + (f"..{rows[-1]}" if len(rows) > 1 else "")
                            + (f" with {len(ks) - len(rows)} chunk(s) of tensors sharing its buffers" if len(ks) > len(rows) else "")
                            + f") need {x:,} B on rank {r}, over the FP8 memory budget of {memory:,} B; this is the "
                            "smallest unit the plan can quantize and send on its own: raise memory_bytes")
        if ngroups == 0 or any(cur[r] + x > memory for r, x in mem.items()):
            ngroups += 1
            cur = defaultdict(int)
        for r, x in mem.items():
            cur[r] += x
        group_of[uid] = ngroups - 1

    def gid_of_node(k: int) -> int:
        return group_of[("chunks", find(k))]

    # 4. per group: regions (split ones cut into runs of chunks), temporaries, destination slabs
    g_regions: list[list[Region]] = [[] for _ in range(ngroups)]
    g_tensors: list[list[str]] = [[] for _ in range(ngroups)]
    for i, comp in enumerate(comps):
        if comp[0] in whole_unit:
            gi = group_of[("comp", i)]
            g_tensors[gi] += comp
            for n in comp:
                g_regions[gi] += by_tensor[n]
    for n in sorted(split):
        g = _granule(src.tensors[n].shape, block)
        seen_in: set[int] = set()
        for reg in by_tensor[n]:
            rows = _chunk_rows(reg, g)
            runs: list[list] = []
            for c, a, e in rows:
                gi = gid_of_node(node_of[(n, c)])
                if runs and runs[-1][0] == gi:
                    runs[-1][2], runs[-1][4] = e, c + 1
                else:
                    runs.append([gi, a, e, c, c + 1])
            for gi, a, e, c0, c1 in runs:
                seen_in.add(gi)
                if len(runs) == 1:
                    g_regions[gi].append(reg)
                    continue
                box = Box((a,) + reg.box.offsets[1:], (e - a,) + reg.box.sizes[1:])
                grid = Box((c0,) + reg.grid.offsets[1:], (c1 - c0,) + reg.grid.sizes[1:])
                suffix = f"/{c0}"
                if reg.kind == "shard":
                    inp, loc = reg.input, Piece(reg.tensor, reg.box, reg.input_local).local_of(box)
                else:
                    inp, loc = reg.input + suffix, Box.full(box.sizes)
                g_regions[gi].append(Region(n, box, grid, reg.owner, reg.kind, inp, loc,
                                            reg.q_buffer + suffix, reg.s_buffer + suffix))
        for gi in sorted(seen_in):
            g_tensors[gi].append(n)
    g_dst: list[dict[int, dict[str, Buffer]]] = [defaultdict(dict) for _ in range(ngroups)]
    g_views: list[dict[int, dict[str, list]]] = [defaultdict(dict) for _ in range(ngroups)]
    for r in dst.ranks:
        for bname, buf in sorted(dst.buffers[r].items()):
            if not buf.pieces:
                continue
            base = base_of.get(buf.pieces[0].tensor)
            if base is None:
                continue
            if base in whole_unit:
                g_dst[group_of[("comp", whole_unit[base])]][r][bname] = buf
    cut_cache: dict[int, list[tuple[int, int, int, Buffer | None]]] = {}
    for key, (buf, bounds, nodes) in slabs.items():
        gids = [gid_of_node(ns[0]) if ns else None for ns in nodes]
        known = [x for x in gids if x is not None]
        for i in range(len(gids)):              # slabs of padding only go with their neighbour
            if gids[i] is None:
                gids[i] = gids[i - 1] if i else known[0]
        runs: list[list[int]] = []
        for i, gi in enumerate(gids):
            if runs and runs[-1][2] == gi:
                runs[-1][1] = bounds[i + 1]
            else:
                runs.append([bounds[i], bounds[i + 1], gi])
        cut_cache[key] = [(a, e, gi, None if len(runs) == 1 else _slab(buf, a, e, f"{buf.name}#{a}:{e}"))
                          for a, e, gi in runs]
        for r, bname, _ in split_bufs[key]:
            for a, e, gi, sub in cut_cache[key]:
                if sub is None:
                    g_dst[gi][r][bname] = buf
                else:
                    name = f"{bname}#{a}:{e}"
                    g_dst[gi][r][name] = sub if sub.name == name else Buffer(name, sub.shape, sub.dtype, sub.pieces)
                    g_views[gi][r][name] = [bname, a, e]

    holders: dict[str, list[tuple[int, str, Buffer]]] = defaultdict(list)   # tensor -> source buffers
    for r in src.ranks:
        for bname, buf in src.buffers[r].items():
            for t in {p.tensor for p in buf.pieces}:
                holders[t].append((r, bname, buf))

    def src_of(names: set[str]) -> Layout:
        """``restrict(src, names)`` without scanning every source buffer (one call per group)."""
        out = Layout({n: m for n, m in src.tensors.items() if n in names}, {})
        for n in sorted(names):
            for r, bname, buf in holders.get(n, ()):
                mine = tuple(p for p in buf.pieces if p.tensor in names)
                out.buffers.setdefault(r, {})[bname] = buf if len(mine) == len(buf.pieces) else Buffer(
                    buf.name, buf.shape, buf.dtype, mine)
        return out

    groups: list[Fp8Group] = []
    for gi in range(ngroups):
        gnames = g_tensors[gi]
        g_regions[gi] = _share_temps(g_regions[gi])
        temps = _temp_buffers(g_regions[gi], src)
        asm, qsrc = Layout(), Layout()
        for n in gnames:
            meta = src.tensors[n]
            qsrc.add_tensor(n, meta.shape, FP8)
            qsrc.add_tensor(scale_name(n), scale_shape(meta.shape, block), SCALE_DTYPE)
        temp: dict[int, dict[str, list]] = {}
        for r in sorted(temps):
            off, temp[r] = 0, {}
            for role, buf in temps[r]:
                temp[r][buf.name] = [list(buf.shape), buf.dtype, off]
                off += _nbytes(buf)
                if role == "asm":
                    asm.add_tensor(buf.pieces[0].tensor, src.tensors[buf.pieces[0].tensor].shape, buf.dtype)
                    asm.add_buffer(r, buf)
                else:
                    qsrc.add_buffer(r, buf)
        gset = set(gnames) | {scale_name(n) for n in gnames}
        gdst = Layout({n: dst.tensors[n] for n in sorted(gset)}, {r: dict(b) for r, b in sorted(g_dst[gi].items())})
        assembly = None
        if asm.tensors:
            assembly = make_plan(src_of(set(asm.tensors)), asm, budget_bytes=budget_bytes)
        stage_b = make_plan(qsrc, gdst, budget_bytes=budget_bytes)
        groups.append(Fp8Group(gnames, g_regions[gi], assembly, stage_b, temp,
                               {r: dict(sorted(v.items())) for r, v in sorted(g_views[gi].items())}))
    return groups



def quantized_tensors(layout: Layout, family: str = "deepseek_v3", block: Sequence[int] | None = None) -> set[str]:
    """The tensors of a (BF16, canonical) layout that ``family``'s FP8 checkpoint quantizes
    (``[fp8]`` of ``layouts/<family>.toml``)."""
    from ..mapper.family import load_family
    return load_family(family).fp8_rules().quantized(layout.tensors.values(), block)


def make_fp8_plan(src: Layout, dst: Layout, block: Sequence[int], *, budget_bytes: int = DEFAULT_BUDGET,
                  memory_bytes: int | None = None, allow_cast: bool = False, ignore_unused: bool = False,
                  compare_bf16: bool = True) -> Fp8Plan:
    """Plan a refit from a BF16 source layout into an FP8 target layout (see the module doc).

    ``budget_bytes``: the staging budget of every sub-plan; ``memory_bytes`` (default: the staging
    budget): hard per-rank bound on the temporaries (assembled blocks, FP8 results, scales) of any
    group, i.e. on the arena; tensors are cut by experts / block rows to fit it, and
    :class:`PlanError` names tensor, rank, bytes and budget when one expert or block row cannot
    (``stats["arena_bytes"]``: the arena per rank).  ``allow_cast`` and
    ``ignore_unused`` are :func:`make_plan`'s, for the unquantized tensors and the source's unused
    tensors.  ``compare_bf16`` also counts the plain BF16 refit of the same layouts for the stats
    (:func:`bf16_bytes`: its network and local bytes, without planning it).
    """
    b = check_block(block)
    memory = budget_bytes if memory_bytes is None else int(memory_bytes)
    quantized = quantized_of(dst)
    scales = {scale_name(n) for n in quantized}
    for name in sorted(quantized):
        if name not in src.tensors:
            raise PlanError(f"FP8 tensor {name} has no source")
        s, d = src.tensors[name], dst.tensors[name]
        if s.shape != d.shape:
            raise PlanError(f"tensor {name}: source shape {list(s.shape)} != destination shape {list(d.shape)}")
        sc = dst.tensors.get(scale_name(name))
        want = scale_shape(d.shape, b)
        if sc is None or sc.shape != want or sc.dtype != SCALE_DTYPE:
            raise PlanError(f"tensor {name}: the FP8 layout needs scale tensor {scale_name(name)} {list(want)} "
                            f"{SCALE_DTYPE} for block {b}, it has {None if sc is None else (list(sc.shape), sc.dtype)}")
    unused = sorted(set(src.tensors) - set(dst.tensors))
    if unused and not ignore_unused:
        raise PlanError(f"{len(unused)} source tensor(s) have no destination: {', '.join(unused[:8])}"
                        + (" ..." if len(unused) > 8 else "") + " (pass ignore_unused=True to drop them)")
    rest_names = set(dst.tensors) - quantized - scales
    rest = make_plan(restrict(src, rest_names), restrict(dst, rest_names, whole=True, keep_empty=True),
                     budget_bytes=budget_bytes, allow_cast=allow_cast)
    names = sorted(quantized)
    index = _source_index(src)
    regions = plan_regions(src, names, b, dst, index)
    by_tensor: dict[str, list[Region]] = defaultdict(list)
    for g in regions:
        by_tensor[g.tensor].append(g)

    groups = _make_groups(src, dst, b, quantized, regions, memory, budget_bytes)
    arena: dict[int, int] = defaultdict(int)
    for g in groups:
        for r, t in g.temp.items():
            arena[r] = max(arena[r], max((off + _nbytes(Buffer("", tuple(shape), dt, ())) for shape, dt, off in t.values()),
                                         default=0))

    plan = Fp8Plan(b, names, rest, groups, dict(arena))
    plan.stats = fp8_stats(plan, scales)
    plan.stats["unused_tensors"] = unused
    plan.stats["memory_bytes"] = memory
    plan.stats["arena_bytes"] = {str(r): n for r, n in sorted(plan.arena.items())}
    plan.stats["split_tensors"] = len(_split_names(groups))
    if compare_bf16:
        dtypes = {n: src.tensors[n].dtype for n in quantized}
        net, loc = bf16_bytes(src, bf16_target(dst, dtypes), index)
        plan.stats["bf16_network_bytes"] = net
        plan.stats["bf16_local_bytes"] = loc
    return plan


def bf16_bytes(src: Layout, dst: Layout, index: Mapping | None = None) -> tuple[int, int]:
    """(network, local) bytes of ``make_plan(src, dst)`` without planning it: every element a
    destination rank needs travels once, over the network unless that rank holds it (the
    planner's guarantee: its network bytes are this lower bound).  Counted in source bytes."""
    index = _source_index(src) if index is None else index
    windows = {}
    shapes: dict[tuple, int] = {}          # tensors with the same source boxes (one per layer) share one id
    for name, items in index.items():
        items = sorted(items, key=lambda it: it[0].offsets[0] if it[0].ndim else 0)
        ranks = [frozenset(h[0] for h in hs) for _, hs in items]
        sid = shapes.setdefault(tuple((b.offsets, b.sizes, rs) for (b, _), rs in zip(items, ranks)), len(shapes))
        first = [b.offsets[0] if b.ndim else 0 for b, _ in items]
        longest = max((b.sizes[0] if b.ndim else 1) for b, _ in items)
        windows[name] = (items, first, longest, ranks, sid)
    cache: dict[tuple, list[tuple[int, frozenset]]] = {}
    net = loc = 0
    for r, _, p in dst.iter_pieces():
        w = windows.get(p.tensor)
        if w is None:
            continue
        items, first, longest, ranks, sid = w
        key = (sid, p.box.offsets, p.box.sizes)
        parts = cache.get(key)
        if parts is None:
            b = p.box
            lo, hi = ((bisect_left(first, b.offsets[0] - longest + 1), bisect_left(first, b.ends[0])) if b.ndim
                      else (0, len(items)))
            parts = cache[key] = []
            for k in range(lo, hi):
                inter = items[k][0].intersect(b)
                if inter is not None:
                    parts.append((inter.numel, ranks[k]))
        isz = itemsize(src.tensors[p.tensor].dtype)
        for n, holders in parts:
            if r in holders:
                loc += n * isz
            else:
                net += n * isz
    return net, loc


def fp8_stats(plan: Fp8Plan, scales: set[str]) -> dict:
    asm_net = asm_local = w_net = s_net = w_local = s_local = 0
    work: dict[str, int] = defaultdict(int)
    blocks: dict[str, int] = defaultdict(int)
    for g in plan.groups:
        if g.assembly is not None:
            asm_net += g.assembly.stats["network_bytes"]
            asm_local += g.assembly.stats["local_bytes"]
        for m in g.stage_b.messages:
            for c in m.entries:
                if c.tensor in scales:
                    s_net += c.nbytes
                else:
                    w_net += c.nbytes
        for c in g.stage_b.local_copies:
            if c.tensor in scales:
                s_local += c.nbytes
            else:
                w_local += c.nbytes
        for reg in g.regions:
            work[str(reg.owner)] += reg.box.numel
            blocks[str(reg.owner)] += reg.grid.numel
    rest = plan.rest.stats["network_bytes"]
    return {
        "network_bytes": asm_net + w_net + s_net + rest,
        "assembly_network_bytes": asm_net, "assembly_local_bytes": asm_local,
        "fp8_weight_network_bytes": w_net, "fp8_scale_network_bytes": s_net,
        "fp8_weight_local_bytes": w_local, "fp8_scale_local_bytes": s_local,
        "rest_network_bytes": rest, "rest_local_bytes": plan.rest.stats["local_bytes"],
        "lower_bound_bytes": w_net + s_net + plan.rest.stats["lower_bound_bytes"],
        "quantized_elements": dict(sorted(work.items())), "quantized_blocks": dict(sorted(blocks.items())),
        "groups": len(plan.groups), "regions": sum(len(g.regions) for g in plan.groups),
        "max_temp_bytes": max(plan.arena.values(), default=0),
    }


__all__ = ["Fp8Group", "Fp8Plan", "Region", "make_fp8_plan", "plan_regions", "quantized_tensors", "restrict"]
