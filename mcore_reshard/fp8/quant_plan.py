"""Quantization plan: BF16 source shards -> block-FP8 target shards (pure: no torch).

``make_fp8_plan(src, dst, block)`` takes a BF16 (or fp32) source layout and an FP8 target layout
(:func:`mcore_reshard.fp8.quant_layout.fp8_target`) and decides, for every quantized tensor, which rank
quantizes which 128x128 block -- each block exactly once -- and how the results travel:

* **ownership**: a block lying wholly inside one source box is quantized by one of that box's
  holders (replicas split the box's aligned interior by block rows; holders that are destinations
  of the block are preferred, so colocated ranks quantize what they keep; otherwise least-loaded
  first, ties to the lowest rank); a block cut by source boxes is owned by a holder of its largest
  part (a destination first, then least-loaded);
* **stage A (assembly)**: cut blocks are gathered on their owner into temporary buffers by an
  ordinary :func:`~mcore_reshard.core.planner.make_plan` (its network bytes are the assembly cost; the
  owner's own part is a local copy);
* **quantize** on the owner (executor: :mod:`mcore_reshard.fp8.quant_resharder`) into temporary FP8 and
  fp32-scale buffers, one pair per owned region;
* **stage B**: an ordinary ``make_plan`` from those temporaries (a "quantized source layout") to the
  target's weight and ``weight_scale_inv`` shards;
* unquantized tensors (norms, router, embedding, head) follow one ordinary BF16 plan (``rest``).

Work is chunked into groups so that each rank's temporaries fit ``memory_bytes``: tensors sharing a
destination buffer stay together when they fit, otherwise they are cut by experts (leading dim) or
block rows, and a destination buffer is then written slab by slab (dim-0 views) by several groups.
Every group is planned on its own, and one arena per rank (the largest group, <= ``memory_bytes``)
holds the temporaries of every group in turn.  A unit that cannot fit raises :class:`PlanError`.

Layers are planned apart (a group never spans two layers), and layers with the same geometry up to
the layer number in the names share one plan (:mod:`.shared`): the first is planned, the others are
its groups renamed, made on first use.  The 671B Megatron TP8 -> vLLM TP8 plan has 2 templates
(the dense layers, the MoE layers with MTP's) for 61 layers.

Example, ``[40, 32]`` bf16, block 16, source tp=2 over rows on ranks 0-1 (rows 0:20 | 20:40),
destination whole on rank 2::

    block rows | held by            | owner | how
    0:16       | rank 0             | 0     | quantized in place from rank 0's shard
    16:32      | rank 0 (4 rows),   | 1     | stage A: rank 0 sends rows 16:20 (4x32x2 = 256 B) to
               | rank 1 (12 rows)   |       |  rank 1, which copies rows 20:32 locally
    32:40      | rank 1             | 1     | ragged last block, in place
    stage B: 40x32 e4m3 (1280 B) + 3x2 fp32 scales (24 B) to rank 2, against 2560 B in BF16.

The plan is plain data (JSON, never pickle: the compact form, templates + instances) with one
combined sha256 :attr:`Fp8Plan.hash` of that form.

Modules: :mod:`.regions` (block ownership, temporaries), :mod:`.groups` (groups under the memory
budget, their sub-plans), :mod:`.shared` (layers split, canonical forms, renamed instances), this one (the plan, its JSON and hash, stats, :func:`make_fp8_plan`).
"""
from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from ..core.gcpause import paused_gc
from ..core.layout import Buffer, Layout, itemsize
from ..core.planner import DEFAULT_BUDGET, Plan, PlanError, check_budget, make_plan
from ..core.planner.index import source_index
from .groups import Fp8Group, _make_groups, _split_names
from .quant_layout import SCALE_DTYPE, bf16_target, check_block, quantized_of, scale_name, scale_shape
from .regions import Region, _nbytes, plan_regions, restrict
from .shared import LayerGroups, split_layers

FP8_PLAN_VERSION = 3


def _group_obj(g: Fp8Group) -> dict:
    """What the plan hash covers of one group: its regions and temporaries, its sub-plans' hashes."""
    return {"tensors": g.tensors, "regions": [r.to_json() for r in g.regions],
            "temp": {str(r): t for r, t in sorted(g.temp.items())},
            "views": {str(r): v for r, v in sorted(g.views.items())},
            "assembly": None if g.assembly is None else g.assembly.hash, "stage_b": g.stage_b.hash}


@dataclass
class Fp8Plan:
    block: tuple[int, int]
    quantized: list[str]
    rest: Plan                                    # unquantized tensors, one ordinary plan
    groups: LayerGroups                           # (a list is taken as one template, not renamed)
    arena: dict[int, int]                         # rank -> bytes of its temporaries (largest group)
    stats: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.groups, LayerGroups):
            self.groups = LayerGroups([list(self.groups)], [(0, None, None)])

    def to_json(self) -> dict:
        """The compact form: each template's groups once, and the instances (template, its layer
        number, the instance's) that rename them (:mod:`.shared`)."""
        gs = self.groups
        return {"version": FP8_PLAN_VERSION, "block": list(self.block), "quantized": self.quantized,
                "rest": self.rest.to_json(), "templates": [[g.to_json() for g in t] for t in gs.templates],
                "instances": [list(x) for x in gs.instances],
                "arena": {str(r): n for r, n in sorted(self.arena.items())}, "stats": self.stats}

    @staticmethod
    def from_json(o: Mapping) -> "Fp8Plan":
        if o.get("version") != FP8_PLAN_VERSION:
            raise PlanError(f"FP8 plan version {o.get('version')} is not {FP8_PLAN_VERSION}")
        groups = LayerGroups([[Fp8Group.from_json(g) for g in t] for t in o["templates"]],
                             [tuple(x) for x in o["instances"]])
        return Fp8Plan(tuple(o["block"]), list(o["quantized"]), Plan.from_json(o["rest"]), groups,
                       {int(r): n for r, n in o["arena"].items()}, dict(o["stats"]))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    @property
    @paused_gc()
    def hash(self) -> str:
        """sha256 over the block, each template's regions, temporaries and sub-plans' own hashes,
        and the instances (the compact form: renamed groups follow from it)."""
        gs = self.groups
        obj = {"version": FP8_PLAN_VERSION, "block": list(self.block), "quantized": self.quantized,
               "rest": self.rest.hash, "arena": {str(r): n for r, n in sorted(self.arena.items())},
               "templates": [[_group_obj(g) for g in t] for t in gs.templates],
               "instances": [list(x) for x in gs.instances]}
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


def quantized_tensors(layout: Layout, family: str = "deepseek_v3", block: Sequence[int] | None = None) -> set[str]:
    """The tensors of a (BF16, canonical) layout that ``family``'s FP8 checkpoint quantizes
    (``[fp8]`` of ``layouts/<family>.toml``)."""
    from ..mapper.family import load_family
    return load_family(family).fp8_rules().quantized(layout.tensors.values(), block)


@paused_gc()
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
    budget_bytes = check_budget(budget_bytes)
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
    split = split_layers(src, dst, quantized, rest_names)
    if split is None:           # a destination buffer holds two layers: one sub-problem
        layers = {None: (sorted(quantized), restrict(src, quantized), restrict(dst, quantized | scales), None)}
        rest_src, rest_dst = restrict(src, rest_names), restrict(dst, rest_names, whole=True, keep_empty=True)
    else:
        layers, rest_src, rest_dst = split
    rest = make_plan(rest_src, rest_dst, budget_bytes=budget_bytes, allow_cast=allow_cast)
    names = sorted(quantized)
    dtypes = {n: src.tensors[n].dtype for n in quantized} if compare_bf16 else None
    groups, bf16 = _plan_layers(layers, b, memory, budget_bytes, dtypes)
    arena: dict[int, int] = defaultdict(int)
    for g, _ in groups.counted():
        for r, t in g.temp.items():
            arena[r] = max(arena[r], max((off + _nbytes(Buffer("", tuple(shape), dt, ())) for shape, dt, off in t.values()),
                                         default=0))

    plan = Fp8Plan(b, names, rest, groups, dict(arena))
    plan.stats = fp8_stats(plan, scales)
    plan.stats["unused_tensors"] = unused
    plan.stats["memory_bytes"] = memory
    plan.stats["arena_bytes"] = {str(r): n for r, n in sorted(plan.arena.items())}
    plan.stats["split_tensors"] = sum(len(_split_names(t)) * k for t, k in zip(groups.templates, groups.uses()))
    plan.stats["templates"], plan.stats["instances"] = len(groups.templates), len(groups.instances)
    if compare_bf16:
        net, loc = bf16_bytes(rest_src, rest_dst)
        plan.stats["bf16_network_bytes"] = net + bf16[0]
        plan.stats["bf16_local_bytes"] = loc + bf16[1]
    return plan


def _plan_layers(layers: dict, b: tuple[int, int], memory: int, budget_bytes: int,
                 dtypes: dict | None) -> tuple[LayerGroups, tuple[int, int]]:
    """The groups of every layer (:mod:`.shared`; ``layers`` as :func:`~.shared.split_layers` makes
    them): each distinct layer geometry planned once, the others renamed from it; and the BF16
    refit's (network, local) bytes of the quantized tensors (with ``dtypes``: their source dtypes)."""
    templates: list[list[Fp8Group]] = []
    instances: list[tuple] = []
    seen: dict[tuple, tuple[int, int | None, tuple[int, int]]] = {}
    net = loc = 0
    for k in sorted(layers, key=lambda x: layers[x][0][0]):
        names, lsrc, ldst, form = layers[k]
        hit = seen.get(form) if form is not None else None
        if hit is None:
            index = source_index(lsrc)
            regions = plan_regions(lsrc, names, b, ldst, index)
            templates.append(_make_groups(lsrc, ldst, b, set(names), regions, memory, budget_bytes))
            counts = bf16_bytes(lsrc, bf16_target(ldst, dtypes), index) if dtypes is not None else (0, 0)
            hit = (len(templates) - 1, k, counts)
            if form is not None:
                seen[form] = hit
        tid, first, (hnet, hloc) = hit
        instances.append((tid, first, k))
        net, loc = net + hnet, loc + hloc
    return LayerGroups(templates, instances), (net, loc)


def bf16_bytes(src: Layout, dst: Layout, index: Mapping | None = None) -> tuple[int, int]:
    """(network, local) bytes of ``make_plan(src, dst)`` without planning it: every element a
    destination rank needs travels once, over the network unless that rank holds it (the
    planner's guarantee: its network bytes are this lower bound).  Counted in source bytes."""
    index = source_index(src) if index is None else index
    windows = {}
    shapes: dict[tuple, int] = {}          # tensors with the same source boxes (one per layer) share one id
    for name, items in index.items():
        items = sorted(items, key=lambda it: it[0].offsets[0] if it[0].ndim else 0)
        ranks = [frozenset(h.rank for h in hs) for _, hs in items]
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
    """The plan's totals, from each template group times its instances (renaming moves no byte)."""
    asm_net = asm_local = w_net = s_net = w_local = s_local = nregions = 0
    work: dict[str, int] = defaultdict(int)
    blocks: dict[str, int] = defaultdict(int)
    for g, k in plan.groups.counted():
        if g.assembly is not None:
            asm_net += k * g.assembly.stats["network_bytes"]
            asm_local += k * g.assembly.stats["local_bytes"]
        for m in g.stage_b.messages:
            for c in m.entries:
                if c.tensor in scales:
                    s_net += k * c.nbytes
                else:
                    w_net += k * c.nbytes
        for c in g.stage_b.local_copies:
            if c.tensor in scales:
                s_local += k * c.nbytes
            else:
                w_local += k * c.nbytes
        for reg in g.regions:
            work[str(reg.owner)] += k * reg.box.numel
            blocks[str(reg.owner)] += k * reg.grid.numel
        nregions += k * len(g.regions)
    rest = plan.rest.stats["network_bytes"]
    return {
        "network_bytes": asm_net + w_net + s_net + rest,
        "assembly_network_bytes": asm_net, "assembly_local_bytes": asm_local,
        "fp8_weight_network_bytes": w_net, "fp8_scale_network_bytes": s_net,
        "fp8_weight_local_bytes": w_local, "fp8_scale_local_bytes": s_local,
        "rest_network_bytes": rest, "rest_local_bytes": plan.rest.stats["local_bytes"],
        "lower_bound_bytes": w_net + s_net + plan.rest.stats["lower_bound_bytes"],
        "quantized_elements": dict(sorted(work.items())), "quantized_blocks": dict(sorted(blocks.items())),
        "groups": len(plan.groups), "regions": nregions,
        "max_temp_bytes": max(plan.arena.values(), default=0),
    }


__all__ = ["Fp8Group", "Fp8Plan", "LayerGroups", "Region", "make_fp8_plan", "plan_regions", "quantized_tensors", "restrict"]
