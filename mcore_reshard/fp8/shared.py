"""Layers planned once per geometry (pure: no torch).

A full-size model repeats one layer geometry: 58 of DeepSeek-V3's 61 layers quantize the same
tensors with the same boxes on the same ranks, up to the layer number in the names.  The FP8 plan
is made layer by layer (:func:`split_layers`: every layer's quantized tensors with their source
and destination buffers, a sub-problem of its own), each layer is put in canonical form
(every name with ``layers.<n>.`` replaced by a mark; ranks as they are, so
layers on other ranks, e.g. other pipeline stages, are other geometries), and layers of one form
share the groups planned for the first of them: a *template*.  An *instance* is (template, the
template's layer number, this layer's number); its groups are the template's with every name
renamed (:func:`rename_group`), made on first use by :class:`LayerGroups`.

Renaming is exact: layers with the same canonical form have the same sub-problem up to the
names, and every name the planner derives (temporaries ``fp8/q/<tensor>/<k>``, slabs
``<buffer>#a:e``) is a real name with a suffix, so ``str.replace("layers.<m>.", "layers.<n>.")``
on the template's plan gives the plan of layer n planned on its own
(``tests/core/planner/test_fp8.py::test_shared_layers_equal_layers_planned_alone`` checks it entry by entry).
Even where it would not be (two names of a layer whose order flips with the number's digits, as
``a.layers.3.x`` against ``a.layers.3x`` do at layer 12: no real layout names so), the renamed plan
is a correct plan of layer n: renaming is a bijection between two sub-problems that are equal up
to it, and a plan refers to tensors and buffers only by name.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterator, Sequence

from ..core.gcpause import paused_gc
from ..core.layout import Buffer, Layout
from ..core.planner import Message, Plan, PlanError
from ..core.planner.forms import MARK, layer_number
from ..core.planner.plan import make_copy
from .groups import Fp8Group
from .quant_layout import scale_name
from .regions import Region

_NONE = object()        # a piece of neither a quantized nor a kept tensor (an unused source tensor)
_REST = object()        # a piece of a tensor of the ordinary plan


def split_layers(src: Layout, dst: Layout, quantized: set[str], rest_names: set[str]):
    """One pass over both layouts: ``(layers, rest_src, rest_dst)``, or None when a destination
    buffer holds quantized tensors (or scales) of two layers.  ``layers``: layer number (None: names
    without one) -> ``(tensors, source sub-layout, destination sub-layout, canonical form)`` (form
    None for None): the layer's quantized tensors, the buffers holding them (a buffer keeps only
    their pieces; shared, not copied, where it holds nothing else), and the form every name with
    ``layers.<n>.`` replaced by a mark, ranks as they are.  ``rest_*``: :func:`~.regions.restrict`
    to ``rest_names`` (the destination ``whole``, with its empty buffers), made in the same pass."""
    layer_of: dict[str, object] = {n: layer_number(n) for n in quantized}
    layer_of.update({scale_name(n): layer_of[n] for n in quantized})
    layer_of.update({n: _REST for n in rest_names})
    layers: dict = {}
    for n in sorted(quantized):
        k = layer_of[n]
        if k not in layers:
            mark = (f"layers.{k}.", f"layers.{MARK}.") if k is not None else None
            layers[k] = [[], Layout(), Layout(), [], mark, {}]
        L = layers[k]
        L[0].append(n)
        L[1].tensors[n] = src.tensors[n]
        for t in (n, scale_name(n)):
            L[2].tensors[t] = dst.tensors[t]
            L[5][t] = t if k is None else t.replace(*L[4])
    rest_src = Layout({n: m for n, m in src.tensors.items() if n in rest_names}, {})
    rest_dst = Layout({n: m for n, m in dst.tensors.items() if n in rest_names}, {})
    get = layer_of.get
    for li, lay, rest in ((1, src, rest_src), (2, dst, rest_dst)):
        for r in lay.ranks:
            mine_rest: dict = {}
            slots: dict = {}        # layer -> (its buffers on rank r, its form's append, mark, canonical names)

            def slot(k):
                L = layers[k]
                bufs = L[li].buffers[r] = {}
                add = None
                if k is not None:
                    add = L[3].append
                    add(r)
                got = slots[k] = (bufs, add, L[4][0] if L[4] else None, L[4][1] if L[4] else None, L[5])
                return got
            for bname, buf in lay.buffers[r].items():
                ps = buf.pieces
                if len(ps) == 1:                # most buffers: one piece
                    p = ps[0]
                    k = get(p.tensor, _NONE)
                    if k is _REST:
                        mine_rest[bname] = buf
                    elif k is not _NONE:
                        bufs, add, a, b, canon = slots.get(k) or slot(k)
                        bufs[bname] = buf
                        if add is not None:
                            x, y = p.box, p.local
                            add((bname.replace(a, b), buf.shape, buf.dtype, canon[p.tensor], x.offsets, x.sizes,
                                 y.offsets, y.sizes))
                    continue
                if not ps:
                    if li == 2:
                        mine_rest[bname] = buf
                    continue
                k = get(ps[0].tensor, _NONE)
                for p in ps:
                    if get(p.tensor, _NONE) is not k:
                        bins: dict = {}
                        for p in ps:
                            bins.setdefault(get(p.tensor, _NONE), []).append(p)
                        bins.pop(_NONE, None)
                        break
                else:                           # all of one layer (Megatron's [gate; up] halves), or the rest
                    bins = {} if k is _NONE else {k: ps}
                if li == 2 and len(bins) > 1:
                    if _REST in bins:
                        other = next(p.tensor for p in ps if layer_of[p.tensor] is not _REST)
                        raise PlanError(f"rank {r} buffer {bname} holds {bins[_REST][0].tensor} and {other}, "
                                        "planned apart")
                    return None
                for k, mine in bins.items():
                    part = buf if len(mine) == len(ps) else Buffer(buf.name, buf.shape, buf.dtype, tuple(mine))
                    if k is _REST:
                        mine_rest[bname] = part
                        continue
                    bufs, add, a, b, canon = slots.get(k) or slot(k)
                    bufs[bname] = part
                    if add is not None:
                        add((bname.replace(a, b), buf.shape, buf.dtype,
                             tuple((canon[p.tensor], p.box.offsets, p.box.sizes, p.local.offsets, p.local.sizes)
                                   for p in mine)))
            if mine_rest:
                rest.buffers[r] = mine_rest
        for L in layers.values():
            L[3].append(None)               # the end of a side
    out = {}
    for k, (names, lsrc, ldst, items, _, canon) in layers.items():
        form = None
        if k is not None:
            items.append(tuple((canon[n], m.shape, m.dtype) for n, m in lsrc.tensors.items()))
            items.append(tuple((canon[n], m.shape, m.dtype) for n, m in ldst.tensors.items()))
            form = tuple(items)
        out[k] = (names, lsrc, ldst, form)
    return out, rest_src, rest_dst


class _Rename:
    """``layers.<m>.`` -> ``layers.<n>.`` in a name, cached (a tensor's name recurs in many copies)."""

    def __init__(self, m: int, n: int):
        self.a, self.b = f"layers.{m}.", f"layers.{n}."
        self.cache: dict[str, str] = {}

    def __call__(self, s: str) -> str:
        got = self.cache.get(s)
        if got is None:
            got = self.cache[s] = s.replace(self.a, self.b)
        return got


def rename_plan(p: Plan, f) -> Plan:
    """An ordinary plan with every tensor and buffer name renamed by ``f``."""
    def cp(c):
        return make_copy(f(c.tensor), c.box, c.src, f(c.src_buffer), c.src_local, c.dst, f(c.dst_buffer), c.dst_local,
                     c.nbytes, c.offset)
    stats = dict(p.stats)
    if "unused_tensors" in stats:
        stats["unused_tensors"] = [f(n) for n in stats["unused_tensors"]]
    return Plan({f(n): v for n, v in p.tensors.items()},
                {side: {r: {f(b): v for b, v in bufs.items()} for r, bufs in ranks.items()}
                 for side, ranks in p.buffers.items()},
                [Message(m.round, m.src, m.dst, m.nbytes, tuple(cp(c) for c in m.entries), m.forward)
                 for m in p.messages],
                [cp(c) for c in p.local_copies], [(r, f(b), box) for r, b, box in p.padding],
                p.budget_bytes, p.rounds, stats)


@paused_gc()
def rename_group(g: Fp8Group, m: int, n: int) -> Fp8Group:
    """Group ``g`` of layer ``m`` as the same group of layer ``n``."""
    f = _Rename(m, n)
    regions = [Region(f(r.tensor), r.box, r.grid, r.owner, r.kind, f(r.input), r.input_local, f(r.q_buffer),
                      f(r.s_buffer), r.q_local, r.s_local) for r in g.regions]
    return Fp8Group([f(t) for t in g.tensors], regions, None if g.assembly is None else rename_plan(g.assembly, f),
                    rename_plan(g.stage_b, f),
                    {r: {f(b): v for b, v in t.items()} for r, t in g.temp.items()},
                    {r: {f(b): [f(v[0]), v[1], v[2]] for b, v in vs.items()} for r, vs in g.views.items()})


class LayerGroups(Sequence):
    """The plan's groups in order: every instance's groups, the template's own for its first layer,
    renamed copies (made on first use, kept) for the others.  ``templates[t]``: template t's groups;
    ``instances``: [(template, its layer number, this layer's number)] (numbers None: not renamed)."""

    def __init__(self, templates: list[list[Fp8Group]], instances: list[tuple[int, int | None, int | None]]):
        self.templates = templates
        self.instances = [tuple(x) for x in instances]
        self.starts: list[int] = []
        total = 0
        for tid, _, _ in self.instances:
            self.starts.append(total)
            total += len(templates[tid])
        self.total = total
        self._made: dict[int, Fp8Group] = {}

    def __len__(self) -> int:
        return self.total

    def __eq__(self, other) -> bool:
        if not isinstance(other, LayerGroups):
            return NotImplemented
        return self.templates == other.templates and self.instances == other.instances

    __hash__ = None                                  # mutable, like the list it stands for

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.total))]
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(i)
        got = self._made.get(i)
        if got is None:
            k = bisect_right(self.starts, i) - 1
            tid, m, n = self.instances[k]
            g = self.templates[tid][i - self.starts[k]]
            got = self._made[i] = g if m == n else rename_group(g, m, n)
        return got

    def __iter__(self) -> Iterator[Fp8Group]:
        if len(self._made) < self.total:
            with paused_gc():               # every group made in one go (the executor binds them all)
                for i in range(self.total):
                    self[i]
        return (self._made[i] for i in range(self.total))

    def uses(self) -> list[int]:
        """Per template, its number of instances."""
        out = [0] * len(self.templates)
        for tid, _, _ in self.instances:
            out[tid] += 1
        return out

    def counted(self) -> Iterator[tuple[Fp8Group, int]]:
        """(template group, number of instances): what the plan's totals need, without renaming."""
        uses = self.uses()
        for tid, gs in enumerate(self.templates):
            for g in gs:
                yield g, uses[tid]


__all__ = ["LayerGroups", "rename_group", "rename_plan", "split_layers"]
