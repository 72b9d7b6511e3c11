"""Grouping: quantized tensors (whole, or cut into experts / block rows) into groups whose temporaries
fit the FP8 memory budget on every rank, each group planned as stage A + stage B."""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

from ..core.box import Box
from ..core.layout import Buffer, Layout, Piece, itemsize
from ..core.planner import Plan, PlanError, make_plan
from ..core.planner.plan import align
from .quant_layout import FP8, SCALE_DTYPE, scale_name, scale_shape
from .regions import Region, _nbytes, _share_temps, _temp_buffers


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
    return (align(numel * asm_isz) if reg.kind == "assembled" else 0) + align(numel) + align(grid_numel * 4)


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



@dataclass
class _Chunks:
    """Chunks (tensor, dim-0 chunk) of the split tensors as union-find nodes, with their memory per
    rank, and the destination slabs that join them."""
    node_of: dict[tuple[str, int], int] = field(default_factory=dict)
    node_key: list[tuple[str, int]] = field(default_factory=list)
    node_mem: list[dict[int, int]] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    # id(buf) -> (buf, slab bounds, nodes per slab); id(buf) -> [(rank, name, buf)] holding it
    slabs: dict[int, tuple[Buffer, list[int], list[list[int]]]] = field(default_factory=dict)
    split_bufs: dict[int, list[tuple[int, str, Buffer]]] = field(default_factory=lambda: defaultdict(list))
    members: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))

    def node(self, t: str, c: int) -> int:
        """The node of chunk ``c`` of tensor ``t`` (made on first use)."""
        k = self.node_of.get((t, c))
        if k is None:
            k = self.node_of[(t, c)] = len(self.node_key)
            self.node_key.append((t, c))
            self.node_mem.append(defaultdict(int))
            self.parent.append(k)
        return k

    def find(self, x: int) -> int:
        """The root of ``x`` (the least node of its set, once every union is done)."""
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, x: int, y: int) -> None:
        x, y = self.find(x), self.find(y)
        if x != y:
            self.parent[max(x, y)] = min(x, y)


def _whole_components(dst: Layout, quantized: set[str], by_tensor: dict, asm_isz: dict, memory: int):
    """Step 1: (components, tensor -> component kept whole, tensors to split, memory per rank of each component)."""
    comps = _components(dst, quantized)
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
    return comps, whole_unit, split, comp_mem


def _chunks(src: Layout, dst: Layout, block: tuple[int, int], split: set[str], by_tensor: dict, asm_isz: dict,
            base_of: dict) -> _Chunks:
    """Step 2: chunks of split tensors, memory per rank, joined when they share a destination slab."""
    from .quant_layout import _dim_map
    ch = _Chunks()
    node = ch.node
    for n in sorted(split):
        shape = src.tensors[n].shape
        g = _granule(shape, block)
        for reg in by_tensor[n]:
            per_row = reg.box.numel // reg.box.sizes[0] if reg.box.sizes[0] else 0
            grid_row = reg.grid.numel // reg.grid.sizes[0] if reg.grid.sizes[0] else 0
            for c, a, e in _chunk_rows(reg, g):
                ch.node_mem[node(n, c)][reg.owner] += _region_bytes(reg, per_row * (e - a), grid_row, asm_isz[n])
    for r in dst.ranks:
        for bname, buf in sorted(dst.buffers[r].items()):
            if not buf.pieces or base_of.get(buf.pieces[0].tensor) not in split:
                continue
            ch.split_bufs[id(buf)].append((r, bname, buf))
            if id(buf) in ch.slabs:
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
                    ch.union(ns[0], x)
            ch.slabs[id(buf)] = (buf, bounds, nodes)
    for k in range(len(ch.node_key)):
        ch.members[ch.find(k)].append(k)
    return ch


def _pack_units(src: Layout, comps: list, whole_unit: dict, comp_mem: list, ch: _Chunks,
                memory: int) -> tuple[dict[tuple, int], int]:
    """Step 3: units in order (whole components, then joined chunks of each split component) packed
    into groups first-fit in order: (unit id -> group, number of groups); a unit over ``memory`` raises."""
    units: list[tuple] = []                       # (sort key, mem per rank, unit id)
    for i, comp in enumerate(comps):
        if comp[0] in whole_unit:
            units.append(((comp[0], -1), dict(comp_mem[i]), ("comp", i)))
    node_key, members = ch.node_key, ch.members
    for root, ks in members.items():
        mem: dict[int, int] = defaultdict(int)
        for k in ks:
            for r, x in ch.node_mem[k].items():
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
    return group_of, ngroups


def _group_regions(src: Layout, block: tuple[int, int], comps: list, whole_unit: dict, split: set[str],
                   by_tensor: dict, gid_of_node, group_of: dict, ngroups: int, ch: _Chunks):
    """Step 4: (regions, tensors) of every group; a split tensor's regions are cut into runs of chunks."""
    g_regions: list[list[Region]] = [[] for _ in range(ngroups)]
    g_tensors: list[list[str]] = [[] for _ in range(ngroups)]
    for i, comp in enumerate(comps):
        if comp[0] in whole_unit:
            gi = group_of[("comp", i)]
            g_tensors[gi] += comp
            for n in comp:
                g_regions[gi] += by_tensor[n]
    node_of = ch.node_of
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
    return g_regions, g_tensors


def _group_dst(dst: Layout, base_of: dict, whole_unit: dict, group_of: dict, gid_of_node, ngroups: int, ch: _Chunks):
    """Step 5: (destination buffers, slab views) of every group: a buffer of split tensors is cut into
    dim-0 slabs, runs of slabs of one group written as one view ``name#a:e``."""
    slabs, split_bufs = ch.slabs, ch.split_bufs
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
    return g_dst, g_views


def _plan_groups(src: Layout, dst: Layout, block: tuple[int, int], g_regions: list, g_tensors: list, g_dst: list,
                 g_views: list, budget_bytes: int) -> list[Fp8Group]:
    """Step 6: every group's temporaries (arena offsets), stage A (assembly) and stage B plans."""
    ngroups = len(g_regions)
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


def _make_groups(src: Layout, dst: Layout, block: tuple[int, int], quantized: set[str], regions: list[Region],
                 memory: int, budget_bytes: int) -> list[Fp8Group]:
    """The regions and destination buffers in groups whose temporaries fit ``memory`` on every rank, each planned."""
    by_tensor: dict[str, list[Region]] = defaultdict(list)
    for reg in regions:
        by_tensor[reg.tensor].append(reg)
    asm_isz = {n: itemsize(src.tensors[n].dtype) for n in quantized}
    base_of = {n: n for n in quantized}
    base_of.update({scale_name(n): n for n in quantized})
    comps, whole_unit, split, comp_mem = _whole_components(dst, quantized, by_tensor, asm_isz, memory)
    ch = _chunks(src, dst, block, split, by_tensor, asm_isz, base_of)
    group_of, ngroups = _pack_units(src, comps, whole_unit, comp_mem, ch, memory)

    def gid_of_node(k: int) -> int:
        return group_of[("chunks", ch.find(k))]
    g_regions, g_tensors = _group_regions(src, block, comps, whole_unit, split, by_tensor, gid_of_node, group_of,
                                          ngroups, ch)
    g_dst, g_views = _group_dst(dst, base_of, whole_unit, group_of, gid_of_node, ngroups, ch)
    return _plan_groups(src, dst, block, g_regions, g_tensors, g_dst, g_views, budget_bytes)
