"""Layer templates: plan each distinct layer geometry once, instantiate it for every layer that has it.

A full-size model repeats one geometry: 58 of DeepSeek-V3's 61 layers have the same tensors, boxes
and holders up to the layer number in the names and the ranks of their pipeline stage.  Tensors are
grouped by the layer number in their name (``layers.<n>.``; no number: one "rest" group), every
buffer goes with the group of its pieces, and each group is put in canonical form: names with the
layer number replaced by a mark, ranks replaced by their index among the group's sorted ranks.
Groups with the same canonical form share one *template*, planned once by the ordinary planner on
the canonical layouts; an *instance* is (template, layer numbers, ranks), and a copy of the
instance is the template's copy with the names re-numbered and the rank indices mapped to ranks.

Rounds: an *item* is one round of one instance, with the staging it needs on each rank; items are
packed first-fit decreasing into global rounds under the same per-rank budget, and the messages of
one (round, src, dst) from several items are merged (entries back to back, offsets shifted).

Every guarantee of the ordinary planner holds instance by instance (each is an exact, minimal plan
of its own tensors on its own buffers) and the packing keeps every rank's staging per round within
the budget; senders are balanced within each template, so layers with the same holders add the
same balanced loads.  Cost: the distinct geometry (the templates) plus one pass over the layouts'
buffers; copies are only made when someone asks for them (:class:`TemplatedPlan`), one rank's
part without anyone else's (:func:`part_of`).
"""
from __future__ import annotations

import re
from bisect import bisect_left
from collections import defaultdict

from ..box import Box
from ..layout import Buffer, Layout, Piece, TensorMeta
from .plan import PLAN_FORMATS, Copy, Message, Plan, PlanError, _new, _setattr, _tuple_new, paused_gc

LAYER = re.compile(r"layers\.(\d+)\.")
MARK = "\x00"               # stands for the layer number in a canonical name
TEMPLATE_VERSION = 2


def _number(name: str) -> int | None:
    m = LAYER.search(name)
    return int(m.group(1)) if m else None


def _canon(name: str, n: int | None) -> str:
    """``name`` with ``layers.<n>.`` replaced by the mark (unchanged when n is None or absent)."""
    return name if n is None else name.replace(f"layers.{n}.", f"layers.{MARK}.")


class _Namer:
    """Canonical name + layer number -> real name, cached (the same few names recur per layer)."""

    def __init__(self):
        self.cache: dict[tuple[str, int | None], str] = {}

    def __call__(self, canon: str, n: int | None) -> str:
        key = (canon, n)
        got = self.cache.get(key)
        if got is None:
            got = self.cache[key] = canon if n is None or MARK not in canon else canon.replace(MARK, str(n))
        return got


def _groups(src: Layout, dst: Layout) -> dict | None:
    """group key (layer number or None) -> {"src"|"dst": [(rank, ((buffer name, Buffer), ...))]}, the
    buffers of each rank in name order, or None when a buffer holds tensors of two groups (nothing
    to template then).  Ranks with the same buffers (replicas) share one tuple per group."""
    layer_of = {name: _number(name) for name in set(src.tensors) | set(dst.tensors)}
    out: dict = defaultdict(lambda: {"src": [], "dst": []})
    group_of: dict[int, object] = {}
    profiles: dict[tuple, dict] = {}
    bad = object()
    for side, lay in (("src", src), ("dst", dst)):
        for r in sorted(lay.buffers):
            bufs = lay.buffers[r]
            names = sorted(bufs)
            vals = [bufs[n] for n in names]
            key = (tuple(names), tuple(map(id, vals)))
            prof = profiles.get(key)
            if prof is None:
                mine: dict = {}
                for bname, buf in zip(names, vals):
                    g = group_of.get(id(buf), bad)
                    if g is bad:
                        gs = {layer_of[p.tensor] for p in buf.pieces}
                        if len(gs) > 1:
                            return None
                        g = group_of[id(buf)] = gs.pop() if gs else None
                    mine.setdefault(g, []).append((bname, buf))
                prof = profiles[key] = {g: tuple(v) for g, v in mine.items()}
            for g, items in prof.items():
                out[g][side].append((r, items))
    return out


class _Forms:
    """Canonical forms of rank rows (a rank's buffers of one group), each given a small id."""

    def __init__(self):
        self.ids: dict[tuple, int] = {}
        self.rows: list[tuple] = []         # id -> ((canonical buffer name, (shape, dtype, pieces)), ...)
        self.row_of: dict[tuple, tuple[int, frozenset]] = {}     # (id(items), g, n) -> (row id, tensors)
        # (id(buffer), g) -> ((shape, dtype, canonical pieces), its tensors)
        self.bufs: dict[tuple, tuple[tuple, frozenset]] = {}
        self.names: dict[tuple[str, int | None], str] = {}     # (name, n) -> canonical name

    def canon(self, name: str, n: int | None) -> str:
        key = (name, n)
        got = self.names.get(key)
        if got is None:
            got = self.names[key] = _canon(name, n)
        return got

    def row(self, items: tuple, g, n) -> tuple[int, frozenset]:
        key = (id(items), g, n)
        got = self.row_of.get(key)
        if got is None:
            content = []
            names: set[str] = set()
            canon, bufs = self.canon, self.bufs
            for bname, buf in items:
                s = bufs.get((id(buf), g))
                if s is None:
                    s = bufs[(id(buf), g)] = ((buf.shape, buf.dtype, tuple(
                        (canon(p.tensor, g), p.box.offsets, p.box.sizes, p.local.offsets, p.local.sizes)
                        for p in buf.pieces)), frozenset([p.tensor for p in buf.pieces]))
                names |= s[1]
                content.append((canon(bname, n), s[0]))
            content = tuple(content)
            rid = self.ids.get(content)
            if rid is None:
                rid = self.ids[content] = len(self.rows)
                self.rows.append(content)
            got = self.row_of[key] = (rid, frozenset(names))
        return got


def _signature(g, members: dict, src: Layout, dst: Layout, forms: _Forms) -> tuple:
    """(canonical form, layer numbers (tensors, src buffers, dst buffers), ranks) of one group."""
    nums = [g]
    for side in ("src", "dst"):
        n = None
        if g is not None:
            for _, items in members[side]:
                for bname, _ in items:
                    n = _number(bname)
                    if n is not None:
                        break
                if n is not None:
                    break
        nums.append(n)
    ranks = sorted({r for side in ("src", "dst") for r, _ in members[side]})
    idx = {r: i for i, r in enumerate(ranks)}
    form = []
    for side, lay, n in (("src", src, nums[1]), ("dst", dst, nums[2])):
        rows = []
        names: set[str] = set()
        seen: set[int] = set()
        for r, items in members[side]:
            rid, tn = forms.row(items, g, n)
            if rid not in seen:
                seen.add(rid)
                names |= tn
            rows.append((idx[r], rid))
        metas = tuple(sorted((_canon(t, g), lay.tensors[t].shape, lay.tensors[t].dtype) for t in names))
        form.append((tuple(rows), metas))
    return tuple(form), tuple(nums), tuple(ranks)


def _canonical_layouts(form: tuple, forms: _Forms) -> tuple[Layout, Layout]:
    """The template's own layouts (canonical names, rank indices) from its canonical form."""
    out = []
    for rows, metas in form:
        lay = Layout({t: TensorMeta(t, shape, dt) for t, shape, dt in metas}, {})
        for i, rid in rows:
            mine = lay.buffers.setdefault(i, {})
            for bname, (shape, dtype, pieces) in forms.rows[rid]:
                mine[bname] = Buffer(bname, shape, dtype, tuple(
                    Piece(t, Box(bo, bs), Box(lo, ls)) for t, bo, bs, lo, ls in pieces))
        out.append(lay)
    return out[0], out[1]


class _Template:
    """One template's plan and what instantiation needs: its messages per round and per rank index."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.by_round: dict[int, list[Message]] = defaultdict(list)
        # round -> index -> staged bytes sent / received / both
        self.send: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.recv: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.of_index: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (round, index) -> its messages
        self.use: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))   # round -> index -> staged
        for m in plan.messages:
            self.by_round[m.round].append(m)
            self.send[m.round][m.src] += m.nbytes
            self.recv[m.round][m.dst] += m.nbytes
            self.of_index[(m.round, m.src)].append(m)
            self.of_index[(m.round, m.dst)].append(m)
            self.use[m.round][m.src] += m.nbytes
            self.use[m.round][m.dst] += m.nbytes
        self.local_of: dict[int, list[Copy]] = defaultdict(list)
        for c in plan.local_copies:
            self.local_of[c.dst].append(c)
        self.pad_of: dict[int, list] = defaultdict(list)
        for r, b, box in plan.padding:
            self.pad_of[r].append((b, box))


def make_templated(src: Layout, dst: Layout, tensors: dict, budget_bytes: int, allow_cast: bool,
                   plan_fn) -> "TemplatedPlan | None":
    """The templated plan, or None when templates would not help (no geometry repeats) or do not
    apply; ``plan_fn(src, dst, budget, allow_cast, ignore_unused)`` plans one template."""
    groups = _groups(src, dst)
    if groups is None or len(groups) < 2:
        return None
    forms = _Forms()
    tids: dict[tuple, int] = {}
    reps: list[tuple] = []
    instances: list[tuple[int, tuple, tuple]] = []
    for g in sorted(groups, key=lambda k: (k is not None, k or 0)):
        form, nums, ranks = _signature(g, groups[g], src, dst, forms)
        tid = tids.get(form)
        if tid is None:
            tid = tids[form] = len(reps)
            reps.append(form)
        instances.append((tid, nums, ranks))
    if len(reps) == len(instances):
        return None
    templates = []
    for form in reps:
        csrc, cdst = _canonical_layouts(form, forms)
        try:
            templates.append(_Template(plan_fn(csrc, cdst, budget_bytes, allow_cast, True)))
        except PlanError:
            return None         # the ordinary planner names the problem with the real names
    return TemplatedPlan(tensors, budget_bytes, templates, instances)


def _place(templates: list[_Template], instances: list, budget: int) -> tuple[list[tuple[int, int, int]], int]:
    """Items (instance, template round) first-fit into global rounds: [(instance, round, global
    round)] in placement order, and the number of global rounds.

    A template's round k tends to load some ranks (its first-fit fills the lowest destination ranks
    first), and instances share ranks: items go in diagonal order, round (k + instance) mod rounds,
    so that one wave mixes different rounds of different instances (40 rounds for ``nemo_rl``, lower
    bound 33, against 52 largest-first)."""
    items = []
    for i, (tid, _, ranks) in enumerate(instances):
        t = templates[tid]
        for k in range(t.plan.rounds):
            use = sorted((ranks[q], v) for q, v in t.use[k].items())
            items.append(((k + i) % t.plan.rounds, i, k, use))
    items.sort(key=lambda x: x[:3])
    used: dict[int, list[int]] = defaultdict(list)
    out, rounds = [], 0
    for _, i, k, use in items:
        g, moved = 0, True
        while moved:                    # the lowest round where every rank of the item has room
            moved = False
            for r, b in use:
                ur = used[r]
                while g < len(ur) and ur[g] + b > budget:
                    g += 1
                    moved = True
        for r, b in use:
            ur = used[r]
            if len(ur) <= g:
                ur.extend([0] * (g + 1 - len(ur)))
            ur[g] += b
        out.append((i, k, g))
        rounds = max(rounds, g + 1)
    return out, rounds


class TemplatedPlan(Plan):
    """A :class:`Plan` kept as templates + instances + round placement; ``messages``,
    ``local_copies``, ``padding`` and ``buffers`` are made on first use (all ranks'), and
    :func:`part_of` makes one rank's.  The hash covers the compact form (:meth:`to_json`)."""

    def part(self, rank: int) -> Plan:
        """This rank's part, from the templates alone (:func:`part_of`)."""
        return part_of(self, rank)

    def __init__(self, tensors: dict, budget_bytes: int, templates: list[_Template], instances: list,
                 placement: list | None = None, rounds: int | None = None):
        self.tensors = tensors
        self.budget_bytes = budget_bytes
        self.templates = templates
        self.instances = instances
        if placement is None:
            placement, rounds = _place(templates, instances, budget_bytes)
        self.placement = placement
        self.rounds = rounds
        self.items_in: dict[int, list[tuple[int, int]]] = defaultdict(list)   # global round -> [(instance, k)]
        for i, k, g in placement:
            self.items_in[g].append((i, k))
        self.name = _Namer()
        self._cache: dict = {}
        self.stats = _templated_stats(self)

    # -------------------------------------------------------------- compact form
    def to_json(self) -> dict:
        return {"version": TEMPLATE_VERSION, "tensors": self.tensors, "budget_bytes": self.budget_bytes,
                "rounds": self.rounds,
                "templates": [{k: v for k, v in t.plan.to_json().items() if k != "stats"} for t in self.templates],
                "instances": [[tid, list(nums), list(ranks)] for tid, nums, ranks in self.instances],
                "placement": [list(x) for x in self.placement], "stats": self.stats}

    @staticmethod
    def from_json(o) -> "TemplatedPlan":
        if o.get("version") != TEMPLATE_VERSION:
            raise PlanError(f"templated plan version {o.get('version')} is not {TEMPLATE_VERSION}")
        from .stats import plan_stats
        plans = [Plan.from_json(dict(t, version=1, stats={})) for t in o["templates"]]
        for t in plans:
            t.stats = plan_stats(t)         # a sound plan's network bytes are its lower bound
        templates = [_Template(t) for t in plans]
        instances = [(tid, tuple(nums), tuple(ranks)) for tid, nums, ranks in o["instances"]]
        p = TemplatedPlan(dict(o["tensors"]), o["budget_bytes"], templates, instances,
                          [tuple(x) for x in o["placement"]], o["rounds"])
        p.stats = dict(o["stats"])
        return p

    @property
    def hash(self) -> str:
        got = self._cache.get("hash")
        if got is None:
            got = self._cache["hash"] = Plan.hash.fget(self)
        return got

    # -------------------------------------------------------------- views made on first use
    @property
    @paused_gc()
    def messages(self) -> list[Message]:
        got = self._cache.get("messages")
        if got is None:
            got = self._cache["messages"] = self._messages(None)
        return got

    @property
    @paused_gc()
    def local_copies(self) -> list[Copy]:
        got = self._cache.get("local")
        if got is None:
            got = self._cache["local"] = self._local(None)
        return got

    @property
    def padding(self) -> list:
        got = self._cache.get("padding")
        if got is None:
            got = self._cache["padding"] = self._padding(None)
        return got

    @property
    @paused_gc()
    def buffers(self) -> dict:
        got = self._cache.get("buffers")
        if got is None:
            got = self._cache["buffers"] = _templated_buffers(self, None)
        return got

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, _, ranks in self.instances for r in ranks})

    # -------------------------------------------------------------- instantiation
    def _copy(self, c: Copy, inst: tuple, offset: int) -> Copy:
        _, (nt, ns, nd), ranks = inst
        name = self.name
        return _tuple_new(Copy, (name(c.tensor, nt), c.box, ranks[c.src], name(c.src_buffer, ns), c.src_local,
                                 ranks[c.dst], name(c.dst_buffer, nd), c.dst_local, c.nbytes, offset))

    def _messages(self, rank: int | None) -> list[Message]:
        """Every message (``rank`` None) or those ``rank`` sends or receives, sorted by (round, src, dst)."""
        out = []
        insts, tps = self.instances, self.templates
        for g in sorted(self.items_in):
            merged: dict[tuple[int, int], list] = {}
            for i, k in self.items_in[g]:
                inst = insts[i]
                t = tps[inst[0]]
                ranks = inst[2]
                if rank is None:
                    ms = t.by_round.get(k, ())
                else:
                    j = bisect_left(ranks, rank)
                    if j == len(ranks) or ranks[j] != rank:
                        continue
                    ms = t.of_index.get((k, j), ())
                # every message of a pair with ``rank`` at one end involves ``rank``: the offsets of a
                # merged message are the same in a part as in the whole plan
                for m in ms:
                    key = (ranks[m.src], ranks[m.dst])
                    e = merged.get(key)
                    if e is None:
                        e = merged[key] = [0, []]
                    base = e[0]
                    e[1].extend(self._copy(c, inst, base + c.offset) for c in m.entries)
                    e[0] = base + m.nbytes
            for (s, d), (nbytes, entries) in sorted(merged.items()):
                msg = _new(Message)
                _setattr(msg, "__dict__", {"round": g, "src": s, "dst": d, "nbytes": nbytes, "entries": tuple(entries)})
                out.append(msg)
        return out

    def _index_in(self, inst: tuple, rank: int | None):
        """Rank indices of ``inst`` to make: all, or the one of ``rank`` (none when it is not in it)."""
        ranks = inst[2]
        if rank is None:
            return range(len(ranks))
        j = bisect_left(ranks, rank)
        return (j,) if j < len(ranks) and ranks[j] == rank else ()

    def _local(self, rank: int | None) -> list[Copy]:
        out = []
        for inst in self.instances:
            t = self.templates[inst[0]]
            for j in self._index_in(inst, rank):
                out.extend(self._copy(c, inst, -1) for c in t.local_of.get(j, ()))
        out.sort(key=lambda c: (c.dst, c.dst_buffer, c.dst_local.offsets, c.dst_local.sizes))
        return out

    def _padding(self, rank: int | None) -> list:
        out = []
        for inst in self.instances:
            t = self.templates[inst[0]]
            nd, ranks = inst[1][2], inst[2]
            for j in self._index_in(inst, rank):
                out.extend((ranks[j], self.name(b, nd), box) for b, box in t.pad_of.get(j, ()))
        out.sort(key=lambda x: (x[0], x[1]))
        return out

def _templated_buffers(self: "TemplatedPlan", wanted: set[int] | None) -> dict:
    """``buffers`` of a templated plan: every rank's (``wanted`` None) or those of ``wanted``."""
    out: dict = {"src": {}, "dst": {}}
    for inst in self.instances:
        t = self.templates[inst[0]]
        nums, ranks = inst[1], inst[2]
        for side, n in (("src", nums[1]), ("dst", nums[2])):
            tb = t.plan.buffers[side]
            for j, bufs in tb.items():
                r = ranks[j]
                if wanted is not None and r not in wanted:
                    continue
                mine = out[side].setdefault(r, {})
                for bname, meta in bufs.items():
                    mine[self.name(bname, n)] = meta
    for side in out:
        out[side] = {r: dict(sorted(b.items())) for r, b in sorted(out[side].items())}
    return out


def _templated_stats(self: "TemplatedPlan") -> dict:
    """The stats of a templated plan, counted from its templates and placement (no copies made)."""
    from .stats import _totals_dict
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    stage_send: dict[tuple[int, int], int] = defaultdict(int)
    stage_recv: dict[tuple[int, int], int] = defaultdict(int)
    lower = local = pad = 0
    tstats = []
    for t in self.templates:
        p = t.plan
        tsent: dict[int, int] = defaultdict(int)
        trecv: dict[int, int] = defaultdict(int)
        for m in p.messages:
            payload = sum(c.nbytes for c in m.entries)
            tsent[m.src] += payload
            trecv[m.dst] += payload
        tstats.append((tsent, trecv, p.stats["lower_bound_bytes"], p.stats["local_bytes"], p.stats["padding_bytes"]))
    for tid, _, ranks in self.instances:
        tsent, trecv, lb, lc, pd = tstats[tid]
        for j, v in tsent.items():
            sent[ranks[j]] += v
        for j, v in trecv.items():
            recv[ranks[j]] += v
        lower += lb
        local += lc
        pad += pd
    messages = 0
    for g, items in self.items_in.items():
        pairs = set() if len(items) > 1 else None
        for i, k in items:
            tid, _, ranks = self.instances[i]
            t = self.templates[tid]
            for j, v in t.send.get(k, {}).items():
                stage_send[(g, ranks[j])] += v
            for j, v in t.recv.get(k, {}).items():
                stage_recv[(g, ranks[j])] += v
            ms = t.by_round.get(k, ())
            if pairs is None:
                messages += len(ms)
            else:
                pairs.update((ranks[m.src], ranks[m.dst]) for m in ms)
        if pairs is not None:
            messages += len(pairs)
    stats = _totals_dict(self.ranks, (sent, recv, stage_send, stage_recv), lower, local, pad, messages, self.rounds)
    stats["templates"] = len(self.templates)
    stats["instances"] = len(self.instances)
    return stats


def part_of(plan: TemplatedPlan, rank: int) -> Plan:
    """``rank``'s own part of a templated plan, made from the templates alone (no other rank's copies);
    buffer metadata for ``rank`` and the peers its messages name.  Its :attr:`Plan.hash` is the whole plan's."""
    messages = plan._messages(rank)
    local = plan._local(rank)
    padding = plan._padding(rank)
    peers = {rank} | {m.src for m in messages} | {m.dst for m in messages}
    part = Plan(plan.tensors, _templated_buffers(plan, peers), messages, local, padding, plan.budget_bytes, plan.rounds)
    part.stats = {"rank": rank}
    part.__dict__["_whole"] = plan
    return part


PLAN_FORMATS[TEMPLATE_VERSION] = TemplatedPlan.from_json
