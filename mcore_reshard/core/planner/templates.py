"""Layer templates: plan each distinct layer geometry once, instantiate it for every layer that has it.

A full-size model repeats one geometry: 58 of DeepSeek-V3's 61 layers have the same tensors, boxes
and holders up to the layer number in the names and the ranks of their pipeline stage.  Tensors are
grouped by the layer number in their name (``layers.<n>.``; no number: one "rest" group), every
buffer goes with the group of its pieces, and each group is put in canonical form: names with the
layer number replaced by a mark, ranks replaced by their index among the group's sorted ranks
(where that leaves more templates than distinct tensor sets, also tried rotated: in the order of
``(rank - the group's lowest source rank) % ranks``, so that the pipeline stages of a job whose
inference replicas repeat every stage width share one template; the orientation with fewer
templates is kept, ties the sorted one).
Groups with the same canonical form share one *template*, planned once by the ordinary planner on
the canonical layouts; an *instance* is (template, layer numbers, ranks), and a copy of the
instance is the template's copy with the names re-numbered and the rank indices mapped to ranks.

Rounds: an *item* is one message of one instance (a template message with its ranks mapped), with
the bytes it stages on its two ranks; items are packed first-fit decreasing into global rounds under
the same per-rank budget (the template's own rounds only bound each message's size), and the items
of one (round, src, dst) are merged (entries back to back, offsets shifted, in (instance, message)
order).  Packing messages rather than whole template rounds lets the layers of different pipeline
stages, and the short rounds of one layer, share rounds (fewest possible rounds in brackets):
``nccl_m2n`` 300 -> 90 (80), ``nemo_rl`` 40 -> 34 (33), ``train1024`` 523 -> 126 (117),
``colocated_sglang`` 3,531 -> 1,574 (1,457).  The placement itself: :mod:`.placement`.

Every guarantee of the ordinary planner holds instance by instance (each is an exact, minimal plan
of its own tensors on its own buffers) and the packing keeps every rank's staging per round within
the budget; senders are balanced within each template, so layers with the same holders add the
same balanced loads.  Cost: the distinct geometry (the templates) plus one pass over the layouts'
buffers; copies are only made when someone asks for them (:class:`TemplatedPlan`), one rank's
part without anyone else's (:func:`part_of`).
"""
from __future__ import annotations

from collections import defaultdict

from ..gcpause import paused_gc
from ..layout import Layout
from .forms import MARK, _canonical_layouts, _Forms, _groups, _instances, _layer_of, _rotation_changes
from .placement import WAVE_SLACK, _place, _place_counted  # noqa: F401 (WAVE_SLACK, _place: tests)
from .plan import PLAN_FORMATS, Copy, Message, Plan, PlanBase, PlanError, canonical_hash
from .records import Instance, LayerNumbers, new

TEMPLATE_VERSION = 3


class _Merging:
    """A message being merged from instances' template messages: its entries so far and their bytes."""
    __slots__ = ("nbytes", "entries")

    def __init__(self):
        self.nbytes = 0
        self.entries: list[Copy] = []


class _Renamed(dict):
    """Canonical name -> real name for one layer number ``n``, filled on first use."""
    __slots__ = ("n",)

    def __init__(self, n: int | None):
        super().__init__()
        self.n = n

    def __missing__(self, canon: str) -> str:
        got = self[canon] = canon if self.n is None or MARK not in canon else canon.replace(MARK, str(self.n))
        return got


class _Namer:
    """Canonical name + layer number -> real name, cached (the same few names recur per layer):
    one :class:`_Renamed` table per layer number."""

    def __init__(self):
        self.tables: dict[int | None, _Renamed] = {}

    def table(self, n: int | None) -> _Renamed:
        got = self.tables.get(n)
        if got is None:
            got = self.tables[n] = _Renamed(n)
        return got

    def __call__(self, canon: str, n: int | None) -> str:
        return self.table(n)[canon]


class _Template:
    """One template's plan and what instantiation needs: its messages (in plan order, the index an
    instance's placement refers to), their (src index, dst index, bytes), and per rank index the
    messages, local copies and padding it takes part in."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.msgs: list[Message] = list(plan.messages)
        self.pairs: list[tuple[int, int, int]] = [(m.src, m.dst, m.nbytes) for m in self.msgs]
        self.round_of: list[int] = [m.round for m in self.msgs]
        self.staged: dict[int, int] = defaultdict(int)      # index -> bytes it stages, all rounds
        for s, d, n in self.pairs:
            self.staged[s] += n
            self.staged[d] += n
        b = plan.buffers
        self.nranks = 1 + max((j for side in ("src", "dst") for j in b.get(side, {})), default=-1)
        self.senders = {s for s, _, _ in self.pairs}       # indices that send / receive a message
        self.receivers = {d for _, d, _ in self.pairs}
        self.of_index: dict[int, list[int]] = defaultdict(list)    # index -> its messages (positions)
        for q, m in enumerate(self.msgs):
            self.of_index[m.src].append(q)
            self.of_index[m.dst].append(q)
        self.local_of: dict[int, list[Copy]] = defaultdict(list)
        for c in plan.local_copies:
            self.local_of[c.dst].append(c)
        self.pad_of: dict[int, list] = defaultdict(list)
        for r, b, box in plan.padding:
            self.pad_of[r].append((b, box))
        self._refs: list[tuple] | None = None

    def refs(self) -> list[tuple]:
        """Per message: ((rank index, side, canonical buffer name), ...) of the buffers its entries
        read and write at both ends (made on first use: only parts need them)."""
        if self._refs is None:
            self._refs = [tuple(sorted({(m.src, "dst" if m.forward else "src", c.src_buffer) for c in m.entries}
                                       | {(m.dst, "dst", c.dst_buffer) for c in m.entries})) for m in self.msgs]
        return self._refs


def make_templated(src: Layout, dst: Layout, tensors: dict, budget_bytes: int, allow_cast: bool,
                   plan_fn) -> "TemplatedPlan | None":
    """The templated plan, or None when templates would not help (no geometry repeats) or do not
    apply; ``plan_fn(src, dst, budget, allow_cast, ignore_unused)`` plans one template."""
    layer_of = _layer_of(src, dst)
    groups = _groups(src, dst, layer_of)
    if groups is None or len(groups) < 2:
        return None
    forms = _Forms(layer_of)
    reps, instances = _instances(groups, src, dst, forms, None)
    # rank indices only: groups whose tensors differ never share a template, rotated or not; where
    # the sorted order gives more templates than that, the pipeline stages may match rotated
    # (see _signature): the orientation with fewer templates wins, ties the sorted one
    rotated = None
    if len(reps) > len({tuple(side[1] for side in form) for form in reps}):
        span = 1 + max(max(src.buffers, default=0), max(dst.buffers, default=0))
        if _rotation_changes(groups, span):     # else the rotated forms are the sorted ones
            rotated = _instances(groups, src, dst, forms, span)
            if len(rotated[0]) < len(reps):
                reps, instances = rotated
    if len(reps) == len(instances):
        return None
    templates = []
    for form in reps:
        csrc, cdst = _canonical_layouts(form, forms)
        try:
            templates.append(_Template(plan_fn(csrc, cdst, budget_bytes, allow_cast, True)))
        except PlanError:
            return None         # the ordinary planner names the problem with the real names
    # the groups, canonical forms and layouts are not needed to place the messages: freed first
    del groups, forms, reps, form, csrc, cdst, layer_of, rotated
    return TemplatedPlan(tensors, budget_bytes, templates, instances)


class _Instantiation:
    """A templated plan's copies, messages, padding and buffers made from its templates, instances
    and placement: every rank's (``rank`` / ``wanted`` None) or one rank's, names re-numbered per
    instance (:class:`_Namer`, shared)."""

    def __init__(self, templates: list[_Template], instances: list[Instance], placement: list):
        self.templates = templates
        self.instances = instances
        self.placement = placement
        self.name = _Namer()
        self._index: list[dict[int, int]] | None = None

    def copies(self, copies, inst: Instance, base: int | None) -> list[Copy]:
        """The template's ``copies`` of instance ``inst``: names re-numbered, rank indices mapped,
        offsets shifted by ``base`` (None: offset -1, local copies).

        The one loop of the planner that reads a record (:class:`~.plan.Copy`) by position: it
        makes every copy of a templated plan (~10^5..10^6 in a full-size one), and unpacking each
        template copy in the comprehension's target costs less than ten reads by name: 0.88 against
        1.18 us per copy made (200 k copies, CPython 3.12), i.e. names would add ~35% here."""
        nums, ranks = inst.layers, inst.ranks
        table = self.name.table
        tt, ts, td = table(nums.tensors), table(nums.src), table(nums.dst)
        if base is None:
            return [new(Copy, (tt[t], box, ranks[s], ts[sb], sl, ranks[d], td[db], dl, nb, -1))
                    for t, box, s, sb, sl, d, db, dl, nb, _ in copies]
        return [new(Copy, (tt[t], box, ranks[s], ts[sb], sl, ranks[d], td[db], dl, nb, base + off))
                for t, box, s, sb, sl, d, db, dl, nb, off in copies]

    def index_in(self, i: int, rank: int | None):
        """Rank indices of instance ``i`` to make: all, or the one of ``rank`` (none when it is not in it)."""
        ranks = self.instances[i].ranks
        if rank is None:
            return range(len(ranks))
        index = self._index
        if index is None:       # per instance: rank -> its index (a rotated instance's ranks are not sorted)
            index = self._index = [{r: j for j, r in enumerate(rs)} for _, _, rs in self.instances]
        j = index[i].get(rank)
        return () if j is None else (j,)

    def local(self, rank: int | None) -> list[Copy]:
        out = []
        for i, inst in enumerate(self.instances):
            t = self.templates[inst.template]
            for j in self.index_in(i, rank):
                out.extend(self.copies(t.local_of.get(j, ()), inst, None))
        out.sort(key=lambda c: (c.dst, c.dst_buffer, c.dst_local.offsets, c.dst_local.sizes))
        return out

    def padding(self, rank: int | None) -> list:
        out = []
        for i, inst in enumerate(self.instances):
            t = self.templates[inst.template]
            nd, ranks = inst.layers.dst, inst.ranks
            for j in self.index_in(i, rank):
                out.extend((ranks[j], self.name(b, nd), box) for b, box in t.pad_of.get(j, ()))
        out.sort(key=lambda x: x[:2])     # (rank, buffer name)
        return out

    def messages(self, rank: int | None) -> list[Message]:
        """Every message (``rank`` None) or those ``rank`` sends or receives, sorted by (round, src, dst)."""
        insts, tps, pl = self.instances, self.templates, self.placement
        keys = []
        for i, inst in enumerate(insts):
            t = tps[inst.template]
            if rank is None:
                qs = range(len(t.msgs))
            else:
                j = self.index_in(i, rank)
                if not j:
                    continue
                (j,) = j
                qs = t.of_index.get(j, ())
            gi = pl[i]
            keys.extend((gi[q], i, q) for q in qs)
        keys.sort()
        # every message of a pair with ``rank`` at one end involves ``rank``, and items merge in
        # (instance, message) order: the offsets of a merged message are the same in a part as in
        # the whole plan
        out: list[Message] = []
        merged: dict[tuple[int, int], list] = {}

        def flush(g: int) -> None:
            for (s, d), e in sorted(merged.items()):
                out.append(new(Message, (g, s, d, e.nbytes, tuple(e.entries), False, False)))
            merged.clear()

        cur = None
        for g, i, q in keys:
            if g != cur:
                if cur is not None:
                    flush(cur)
                cur = g
            inst = insts[i]
            ranks = inst.ranks
            m = tps[inst.template].msgs[q]
            key = (ranks[m.src], ranks[m.dst])
            e = merged.get(key)
            if e is None:
                e = merged[key] = _Merging()
            e.entries.extend(self.copies(m.entries, inst, e.nbytes))
            e.nbytes += m.nbytes
        if cur is not None:
            flush(cur)
        return out

    def buffers(self, wanted: set[int] | None) -> dict:
        """``buffers`` of a templated plan: every rank's (``wanted`` None) or those of ``wanted``."""
        out: dict = {"src": {}, "dst": {}}
        for inst in self.instances:
            t = self.templates[inst.template]
            nums, ranks = inst.layers, inst.ranks
            for side, n in (("src", nums.src), ("dst", nums.dst)):
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


class TemplatedPlan(PlanBase):
    """A plan of copies (:class:`~.plan.CopyPlan`, as :class:`~.plan.Plan`) kept as templates +
    instances + round placement; ``messages``, ``local_copies``, ``padding`` and ``buffers`` are
    made on first use (all ranks', by :class:`_Instantiation`), and :func:`part_of` makes one rank's.  The hash covers the compact form (:meth:`to_json`)."""

    def part(self, rank: int) -> Plan:
        """This rank's part, from the templates alone (:func:`part_of`)."""
        return part_of(self, rank)

    @property
    def views_made(self) -> bool:
        """Whether any of the whole plan's views (``messages``, ``local_copies``, ``padding``,
        ``buffers``) has been made (a caller then holds, and may have edited, those)."""
        return any(k in self._cache for k in ("messages", "local", "padding", "buffers"))

    def __init__(self, tensors: dict, budget_bytes: int, templates: list[_Template], instances: list,
                 placement: list | None = None, rounds: int | None = None, stats: dict | None = None):
        self.tensors = tensors
        self.budget_bytes = budget_bytes
        self.templates = templates
        self.instances = instances
        counted = None
        if placement is None:
            placement, rounds, counted = _place_counted(templates, instances, budget_bytes)
        self.placement = placement      # instance -> the global round of each of its template's messages
        self.rounds = rounds
        self.made = _Instantiation(templates, instances, placement)
        self.name = self.made.name
        self._cache: dict = {}
        # given: a received plan's; ``counted``: the staging totals of the placement just made
        self.stats = (templated_stats(templates, instances, placement, self.ranks, rounds, counted) if stats is None
                      else stats)

    def __eq__(self, other) -> bool:
        """Equal as :class:`~.plan.Plan` compares: the same class, views, budget, rounds and stats."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        return _compared(self) == _compared(other)

    __hash__ = None     # mutable, compared by value (as Plan)

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
        instances = [Instance(tid, LayerNumbers(*nums), tuple(ranks)) for tid, nums, ranks in o["instances"]]
        placement, rounds = [list(x) for x in o["placement"]], o["rounds"]
        _check_placement(templates, instances, placement, rounds)
        return TemplatedPlan(dict(o["tensors"]), o["budget_bytes"], templates, instances, placement, rounds,
                             dict(o["stats"]))

    @property
    def hash(self) -> str:
        got = self._cache.get("hash")
        if got is None:
            got = self._cache["hash"] = canonical_hash(self)
        return got

    # -------------------------------------------------------------- views made on first use
    @property
    @paused_gc()
    def messages(self) -> list[Message]:
        got = self._cache.get("messages")
        if got is None:
            got = self._cache["messages"] = self.made.messages(None)
        return got

    @property
    @paused_gc()
    def local_copies(self) -> list[Copy]:
        got = self._cache.get("local")
        if got is None:
            got = self._cache["local"] = self.made.local(None)
        return got

    @property
    def padding(self) -> list:
        got = self._cache.get("padding")
        if got is None:
            got = self._cache["padding"] = self.made.padding(None)
        return got

    @property
    @paused_gc()
    def buffers(self) -> dict:
        got = self._cache.get("buffers")
        if got is None:
            got = self._cache["buffers"] = self.made.buffers(None)
        return got

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, _, ranks in self.instances for r in ranks})


def _compared(p: TemplatedPlan) -> tuple:
    return (p.tensors, p.buffers, p.messages, p.local_copies, p.padding, p.budget_bytes, p.rounds, p.stats)


def templated_stats(templates: list[_Template], instances: list[Instance], placement: list, ranks: list[int],
                    rounds: int, counted: tuple | None = None) -> dict:
    """The stats of a templated plan, counted from its templates and placement (no copies made);
    ``counted``: the staging totals :func:`~.placement._place_counted` kept while placing (else
    counted here from the placement, one pass over every instance's messages)."""
    from .stats import _totals_dict
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    lower = local = pad = 0
    tstats = []
    for t in templates:
        p = t.plan
        tsent: dict[int, int] = defaultdict(int)
        trecv: dict[int, int] = defaultdict(int)
        for m in p.messages:
            payload = sum(c.nbytes for c in m.entries)
            tsent[m.src] += payload
            trecv[m.dst] += payload
        tstats.append((tsent, trecv, p.stats["lower_bound_bytes"], p.stats["local_bytes"], p.stats["padding_bytes"]))
    for tid, _, iranks in instances:
        tsent, trecv, lb, lc, pd = tstats[tid]
        for j, v in tsent.items():
            sent[iranks[j]] += v
        for j, v in trecv.items():
            recv[iranks[j]] += v
        lower += lb
        local += lc
        pad += pd
    if counted is None:
        counted = _count_staging(templates, instances, placement, ranks)
    # staging per (global round, rank) keyed by round * span + rank: only the maxima of
    # the per-(round, rank) sums are kept, so the key's form does not matter
    stage_send, stage_recv, messages = counted
    stats = _totals_dict(ranks, (sent, recv, stage_send, stage_recv), lower, local, pad, messages, rounds)
    stats["templates"] = len(templates)
    stats["instances"] = len(instances)
    return stats


def _count_staging(templates: list[_Template], instances: list[Instance], placement: list, ranks: list[int]) -> tuple:
    """Staging per (global round, rank) (keys ``round * span + rank``, ``span`` the largest rank
    + 1), sends and receives apart, and the number of (global round, src, dst) messages, from
    the placement."""
    span = max(ranks, default=0) + 1
    ss: dict[int, int] = defaultdict(int)
    sr: dict[int, int] = defaultdict(int)
    pairs: set[int] = set()
    add = pairs.add
    for (tid, _, iranks), gi in zip(instances, placement):
        for (s, d, n), g in zip(templates[tid].pairs, gi):
            rs, rd, gk = iranks[s], iranks[d], g * span
            ss[gk + rs] += n
            sr[gk + rd] += n
            add((gk + rs) * span + rd)
    return ss, sr, len(pairs)


def _check_placement(templates: list[_Template], instances: list, placement: list, rounds) -> None:
    """A received placement's shape: one global round in [0, rounds) per template message of each
    instance, and distinct ranks for every rank index of its template (a rotated instance's are
    not sorted)."""
    if not isinstance(rounds, int) or rounds < 0:
        raise PlanError(f"templated plan: rounds {rounds!r} is not a count")
    if len(placement) != len(instances):
        raise PlanError(f"templated plan: {len(placement)} placement rows for {len(instances)} instances")
    for i, ((tid, _, _), gi) in enumerate(zip(instances, placement)):
        if not (isinstance(tid, int) and 0 <= tid < len(templates)):
            raise PlanError(f"templated plan: instance {i} names template {tid!r} of {len(templates)}")
        want = len(templates[tid].pairs)
        if len(gi) != want or not all(isinstance(g, int) and 0 <= g < rounds for g in gi):
            raise PlanError(f"templated plan: instance {i}'s placement is not {want} rounds in [0, {rounds})")
        ranks, need = instances[i][2], templates[tid].nranks
        if (len(ranks) < need or not all(type(r) is int and r >= 0 for r in ranks)
                or len(set(ranks)) != len(ranks)):
            raise PlanError(f"templated plan: instance {i}'s ranks {list(ranks)[:8]} are not {need} or more "
                            "distinct ranks")


def part_of(plan: TemplatedPlan, rank: int) -> Plan:
    """``rank``'s own part of a templated plan, made from the templates alone (no other rank's copies);
    buffer metadata: all of ``rank``'s, and of each peer the buffers its messages with ``rank`` name
    (what :func:`validate_plan` checks them against).  Its :attr:`Plan.hash` is the whole plan's."""
    made = plan.made
    messages = made.messages(rank)
    local = made.local(rank)
    padding = made.padding(rank)
    buffers = made.buffers({rank})
    for side, r, name, meta in _peer_buffers(plan, rank):
        buffers[side].setdefault(r, {})[name] = meta
    for side in buffers:
        buffers[side] = {r: dict(sorted(b.items())) for r, b in sorted(buffers[side].items())}
    return Plan(plan.tensors, buffers, messages, local, padding, plan.budget_bytes, plan.rounds, {"rank": rank},
                whole=plan)


def _peer_buffers(plan: TemplatedPlan, rank: int):
    """(side, peer, buffer name, [shape, dtype]) of every peer buffer a message of ``rank`` names:
    per template message, the (end, side, canonical name) of the buffers its entries read and
    write, made once per template; then renamed per instance."""
    name = plan.name
    for i, (tid, nums, ranks) in enumerate(plan.instances):
        js = plan.made.index_in(i, rank)
        if not js:
            continue
        t = plan.templates[tid]
        refs = t.refs()
        tb = t.plan.buffers
        (mine,) = js
        for q in t.of_index.get(mine, ()):
            for j, side, cname in refs[q]:
                if j != mine:
                    yield side, ranks[j], name(cname, nums.src if side == "src" else nums.dst), tb[side][j][cname]


PLAN_FORMATS[TEMPLATE_VERSION] = TemplatedPlan.from_json
