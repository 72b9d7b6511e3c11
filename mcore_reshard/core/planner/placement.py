"""Round placement of a templated plan (:mod:`.templates`): every instance's messages first-fit into
global rounds under the per-rank budget, items packed into one int each.  ``templates`` here are
:mod:`.templates`' ``_Template`` objects (``pairs``, ``round_of``, ``staged``, ``senders``, ``receivers``,
``plan.rounds``)."""
from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Generator, Mapping
from operator import add
from typing import NamedTuple

from . import fastfit
from .packing import RoundFill

WAVE_SLACK = 1.1     # a first order needing more than this x the fewest rounds: the other order is tried too



class _RankState(NamedTuple):
    """A rank's state while placing (:func:`_fit`): its :class:`~.rounds.RankFill` fields, then the
    bytes it sends per round and, per destination rank, the bit mask of rounds with a message to it."""
    used: list[int]
    index: list
    lims: list[int]
    masks: list[int]
    sent: list[int]
    pairs: dict[int, int]

def _place(templates: list, instances: list, budget: int,
           waves: bool | None = None) -> tuple[list[list[int]], int]:
    """Every instance's messages first-fit into global rounds: per instance, the global round of
    each template message, and the number of global rounds (:func:`_place_counted`)."""
    return _place_counted(templates, instances, budget, waves)[:2]


def _place_counted(templates: list, instances: list, budget: int,
                   waves: bool | None = None) -> tuple[list[list[int]], int, tuple]:
    """:func:`_place`, and the kept placement's staging counted while it was made: (bytes staged to
    send, to receive, per ``round * span + rank``; the number of (round, src, dst) messages),
    ``span`` the largest rank + 1.

    Two orders: largest first (ties by (src, dst, instance, message)), and in *waves*: a message of
    template round k of instance i goes in wave (k + i) mod (the template's rounds), largest first
    within a wave, so one wave mixes different rounds of different instances (each template round
    loads some ranks most: its first fit fills the lowest ranks first).  Disaggregated refits
    (every rank only sends or only receives) start with waves (measured, fewest possible in
    brackets: ``nccl_m2n`` 90 rounds against 105 largest first (80), ``nemo_rl_ep`` 58 / 75 (53),
    ``nemo_rl`` 34 / 41 (33)), colocated ones largest first (``colocated_sglang`` 1,574 against 1,688
    in waves (1,457), and waves cost more there: fewer runs of equal (bytes, src, dst) to place at
    once); the other order is tried only where the first needs more than ``WAVE_SLACK`` x the
    fewest possible rounds, and the placement with fewer rounds is kept (ties: the first); the
    first order's fill stops there (paused: it goes on only where the other needs more than the
    slack too).  ``waves`` True / False: that order only (tests)."""
    top = max((r for _, _, ranks in instances for r in ranks), default=0)
    most: dict[int, int] = defaultdict(int)       # rank -> bytes it stages in all
    for tid, _, ranks in instances:
        for j, v in templates[tid].staged.items():
            most[ranks[j]] += v
    fewest = -(-max(most.values(), default=0) // budget)
    senders = {ranks[j] for tid, _, ranks in instances for j in templates[tid].senders}
    receivers = {ranks[j] for tid, _, ranks in instances for j in templates[tid].receivers}
    apart = senders.isdisjoint(receivers)
    if waves is None:       # disaggregated (no rank sends and receives): waves first, else largest first
        order = (True, False) if apart else (False, True)
    else:
        order = (waves,)
    span, only_send = top + 1, senders if apart else None
    slack = int(WAVE_SLACK * fewest)    # rounds <= WAVE_SLACK * fewest: rounds <= slack
    ck = fastfit.cfit
    if ck is not None:                  # the same placement by the C kernel
        got = _place_c(ck, templates, instances, budget, _lims(templates, budget), span, order, slack)
        if got is not None:
            return got
    # an item is one int, (level of budget - bytes, src, dst, instance, message) packed most
    # significant first: sorting the ints sorts the tuples (a quarter of the memory, faster to sort)
    lims, levels = _levels(templates, instances, budget)
    bits = _Bits(max((len(t.pairs) for t in templates), default=1), len(instances), top, len(lims))
    lengths = [len(templates[tid].pairs) for tid, _, _ in instances]

    def fit(w: bool, stop: list) -> Generator:
        seq = _items(templates, instances, budget, bits, w, lims)
        seq.sort()
        # disaggregated: a sender's staging is all sends (counted from the fill, not per item)
        return _fit(seq, lengths, budget, bits, span, lims, levels, only_send, stop, not w)

    if len(order) == 1:
        return _step(fit(order[0], [INF]))
    # the first order's fill pauses as soon as it needs more than the slack, and the other is
    # kept only with fewer rounds than the first (ties: the first): where the other needs no more
    # than the slack, the rest of the first is never placed
    stop = [slack]
    first = fit(order[0], stop)
    got = _step(first)
    if got is not None:
        return got
    other = _step(fit(order[1], [INF]))
    if other[1] > slack:                # the first goes on, kept unless it needs more than the other
        stop[0] = other[1]
        got = _step(first)
        if got is not None:
            return got
    first.close()
    return other


INF = float("inf")


class Staged(Mapping):
    """Bytes staged per ``round * span + rank`` (the nonzero ones), as the C kernel counts them:
    one int64 per (rank, round), rank-major, ranks in increasing order -- a read-only mapping
    without a dict of every (round, rank) (``colocated_sglang``: 800 k of them)."""

    def __init__(self, data: bytes, ranks: list[int], rounds: int, span: int):
        self.data = array("q")
        self.data.frombytes(data)
        self.ranks, self.rounds, self.span = ranks, rounds, span
        self._index: dict[int, int] | None = None

    def __getitem__(self, key: int) -> int:
        k, r = divmod(key, self.span)
        if self._index is None:
            self._index = {x: j for j, x in enumerate(self.ranks)}
        j = self._index.get(r)
        v = self.data[j * self.rounds + k] if j is not None and 0 <= k < self.rounds else 0
        if not v:
            raise KeyError(key)
        return v

    def __iter__(self):
        data, rounds, span = self.data, self.rounds, self.span
        for j, r in enumerate(self.ranks):
            for k in range(rounds):
                if data[j * rounds + k]:
                    yield k * span + r

    def __len__(self) -> int:
        return len(self.data) - self.data.count(0)

    def values(self) -> list[int]:
        return list(filter(None, self.data))

    def max_plus(self, other) -> int | None:
        """The largest sum of this and ``other`` at one (round, rank) (None: not the same ranks and rounds)."""
        if not isinstance(other, Staged) or (other.ranks, other.rounds) != (self.ranks, self.rounds):
            return None
        return max(map(add, self.data, other.data), default=0)


def _place_c(ck, templates: list, instances: list, budget: int, lims: list[int], span: int, order: tuple,
             slack: int) -> tuple | None:
    """:func:`_place_counted` by the C kernel (:mod:`.fastfit`): the same orders, the same rule
    (the first order given up once it needs more than ``slack`` rounds, the other tried, the
    first finished only where the other needs more than the slack too, ties: the first), the
    same placement; None where the kernel refuses the input (the Python places it then)."""
    level = {lim: lv for lv, lim in enumerate(lims)}
    tpls = [([s for s, _, _ in t.pairs], [d for _, d, _ in t.pairs], [level[budget - n] for _, _, n in t.pairs],
             t.round_of, t.plan.rounds) for t in templates]
    insts = [(tid, ranks) for tid, _, ranks in instances]
    sizes = [budget - lim for lim in lims]

    def run(waves: bool, stop: int):
        got = ck.place(tpls, insts, sizes, budget, waves, stop, span)
        if got is None:
            return None
        rows, rounds, messages, ranks, sent, received = got
        return rows, rounds, (Staged(sent, ranks, rounds, span), Staged(received, ranks, rounds, span), messages)

    try:
        if len(order) == 1:
            return run(order[0], -1)
        first = run(order[0], slack)        # None: it needs more than the slack
        if first is not None:
            return first
        other = run(order[1], -1)
        if other[1] > slack:                # the first finished, kept unless it needs more than the other
            first = run(order[0], other[1])
            if first is not None:
                return first
        return other
    except fastfit.FALLBACK:
        return None


def _step(fill: Generator) -> tuple | None:
    """Runs a paused :func:`_fit` on: its result, or None where it paused again."""
    try:
        next(fill)
    except StopIteration as done:
        return done.value
    return None


class _Bits:
    """Bit offsets of the fields of a packed placement item (message, instance, dst, src, level of
    budget - bytes (:func:`_levels`), wave: least significant first)."""

    def __init__(self, messages: int, instances: int, top_rank: int, levels: int):
        self.i = max(1, messages.bit_length())
        rb = max(1, top_rank.bit_length())
        self.d = self.i + max(1, instances.bit_length())
        self.s = self.d + rb
        self.n = self.s + rb
        self.w = self.n + max(1, levels.bit_length())
        self.qmask, self.imask, self.rmask = (1 << self.i) - 1, (1 << (self.d - self.i)) - 1, (1 << rb) - 1
        self.lmask = (1 << (self.w - self.n)) - 1


def _lims(templates: list, budget: int) -> list[int]:
    """The lims (budget - bytes) of every template message, ascending (a message's level: its index)."""
    return sorted({budget - n for t in templates for _, _, n in t.pairs})


def _levels(templates: list, instances: list, budget: int) -> tuple[list[int], dict[int, set[int]]]:
    """The lims (budget - bytes) of every message, ascending (a message's level: its lim's index
    there, packed in its item in place of the lim: the same order), and per rank the levels of
    the messages it sends or receives (registered on it ahead: :meth:`.RoundFill.register`)."""
    lims = _lims(templates, budget)
    level = {lim: lv for lv, lim in enumerate(lims)}
    per_template = []
    for t in templates:
        got: dict[int, set[int]] = defaultdict(set)
        for s, d, n in t.pairs:
            got[s].add(level[budget - n])
            got[d].add(level[budget - n])
        per_template.append(got)
    out: dict[int, set[int]] = defaultdict(set)
    for tid, _, ranks in instances:
        for j, lvs in per_template[tid].items():
            out[ranks[j]] |= lvs
    return lims, out


def _items(templates: list, instances: list, budget: int, bits: _Bits, waves: bool, lims: list[int]) -> list[int]:
    """Every instance's messages as packed items (:class:`_Bits`), unsorted; with ``waves``, each
    with its wave, (template round + instance) mod the template's rounds, on top.  Per template
    the (level, message) bits once (with the wave: once per instance residue mod its
    rounds), per instance its ranks' src and dst bits once."""
    sn, ss, sd, si, sw = bits.n, bits.s, bits.d, bits.i, bits.w
    level = {lim: lv for lv, lim in enumerate(lims)}
    fixed = [([(level[budget - n] << sn) | q for q, (_, _, n) in enumerate(t.pairs)],
              [s for s, _, _ in t.pairs], [d for _, d, _ in t.pairs]) for t in templates]
    waved: dict[tuple[int, int], list[int]] = {}    # (template, instance mod its rounds) -> bits with the wave
    out: list[int] = []
    for i, (tid, _, ranks) in enumerate(instances):
        f, srcs, dsts = fixed[tid]
        if not f:
            continue
        if waves:
            t = templates[tid]
            key = (tid, i % t.plan.rounds)
            fw = waved.get(key)
            if fw is None:
                r0, nr = i % t.plan.rounds, t.plan.rounds
                fw = waved[key] = [(((k + r0) % nr) << sw) | x for k, x in zip(t.round_of, f)]
            f = fw
        base = i << si
        rs = [r << ss for r in ranks]
        rd = [r << sd | base for r in ranks]
        out.extend([x | rs[s] | rd[d] for x, s, d in zip(f, srcs, dsts)])
    return out


def _first_fit(items: list[int], lengths: list[int], budget: int, bits: _Bits, span: int, lims: list[int],
               levels: dict[int, set[int]], only_send: set[int] | None = None,
               largest_first: bool = False) -> tuple[list[list[int]], int, tuple]:
    """Packed ``items`` (:class:`_Bits`), in order, each to the lowest round where both its ranks
    have room; consecutive items of equal (bytes, src, dst) placed together.  ``lengths``: each
    instance's number of messages; ``span``: the largest rank + 1; ``lims`` and ``levels``: those of
    :func:`_levels`.  Returns the placement, the rounds and the staging totals of
    :func:`_place_counted` (counted per placed run, not per item; ``only_send``: the ranks that
    send, where none of them receives: their sends are their whole staging, read from the fill
    at the end; ``largest_first``: the items are in that order, no waves: a rank keeps the mask
    of the level its items are at only, the lower ones dropped)."""
    return _step(_fit(items, lengths, budget, bits, span, lims, levels, only_send, [INF], largest_first))


def _fit(items: list[int], lengths: list[int], budget: int, bits: _Bits, span: int, lims: list[int],
         levels: dict[int, set[int]], only_send: set[int] | None, stop: list,
         largest_first: bool) -> Generator:
    """:func:`_first_fit` as a generator: it pauses (yields) each time, before an item lands in
    round k >= ``stop[0]``, and goes on from there when resumed (``stop[0]`` read again); returns
    (StopIteration) what :func:`_first_fit` returns."""
    placement = [[0] * n for n in lengths]
    fill = RoundFill(budget)
    for lim in lims:                    # the fill's levels: the items'
        fill.level(lim)
    sizes = [budget - lim for lim in lims]
    # rank -> (used, level -> index in its lims, its lims, their masks, bytes staged to send per
    # round, dst -> bit mask of the rounds with a message from the rank to dst (far smaller than a
    # set of (round, src, dst): one int per pair, not per message; per src: the items come by
    # src)), each rank's levels registered ahead (a level not registered: its index None or none,
    # an error, never a wrong round)
    states: list = [None] * span
    sd, ss, sn, si = bits.d, bits.s, bits.n, bits.i
    if not largest_first:               # in waves, every level of a rank comes back: all kept
        for r, lvs in levels.items():
            states[r] = _RankState(*fill.register(r, sorted(lvs)), [], defaultdict(int))
        segments = [(len(items), None, ())]
    else:                               # level by level: a rank keeps only the level of its items to come
        if items and items[-1] >> bits.w:
            raise ValueError("largest-first placement: items with a wave")
        for r in levels:
            states[r] = _RankState(*fill.register(r, ()), [], defaultdict(int))
        ranks_of: dict[int, list[int]] = defaultdict(list)
        for r, lvs in levels.items():
            for lv in lvs:
                ranks_of[lv].append(r)
        segments = [(bisect_left(items, (lv + 1) << sn), lv, ranks_of[lv]) for lv in range(len(lims))]
    live: list = [None] * span          # rank -> the one level it keeps (largest first)
    count = only_send is None
    rm, im, qm, lm = bits.rmask, bits.imask, bits.qmask, bits.lmask
    j = 0
    for total, lv, ranks in segments:
        for r in ranks:                 # largest first: a level's items come together, lowest level first
            if live[r] is not None:
                fill.unregister(r, live[r])
            fill.register(r, (lv,))
            live[r] = lv
        while j < total:
            x = items[j]
            head = x >> sd                  # (wave,) level, src, dst: a run shares it
            end = j + 1
            s, d, lv = (x >> ss) & rm, head & rm, (x >> sn) & lm
            us, ix, ks, ms, sent, pairs = states[s]
            ud, ix2, kd, md, sent2, _ = states[d]
            n = sizes[lv]
            if end == total or items[end] >> sd != head:    # the common case, a run of one: place(s, d, n, 1)
                y = ms[ix[lv]] | md[ix2[lv]]
                bit = ~y & (y + 1)
                k = bit.bit_length() - 1
                try:
                    a = us[k]
                except IndexError:          # new rounds start empty
                    while k >= stop[0]:
                        yield
                    a = 0
                    sent.extend([0] * (k + 1 - len(us)))
                    us.extend([0] * (k + 1 - len(us)))
                try:
                    b = ud[k]
                except IndexError:
                    while k >= stop[0]:
                        yield
                    b = 0
                    sent2.extend([0] * (k + 1 - len(ud)))
                    ud.extend([0] * (k + 1 - len(ud)))
                placement[(x >> si) & im][x & qm] = k
                y = us[k] = a + n           # round k leaves the masks of the lims in [a, y)
                lo, hi = bisect_left(ks, a), bisect_left(ks, y)
                if hi - lo == 1:
                    ms[lo] |= bit
                elif lo < hi:
                    ms[lo:hi] = [m | bit for m in ms[lo:hi]]
                y = ud[k] = b + n
                lo, hi = bisect_left(kd, b), bisect_left(kd, y)
                if hi - lo == 1:
                    md[lo] |= bit
                elif lo < hi:
                    md[lo:hi] = [m | bit for m in md[lo:hi]]
                if count:
                    sent[k] += n
                pairs[d] |= bit
                j = end
                continue
            while end < total and items[end] >> sd == head:
                end += 1
            while j < end:                  # fill.place(s, d, n, end - j), inlined, until the run is placed
                y = ms[ix[lv]] | md[ix2[lv]]
                bit = ~y & (y + 1)
                k = bit.bit_length() - 1
                if len(us) <= k or len(ud) <= k:
                    while k >= stop[0]:
                        yield
                if len(us) <= k:
                    sent.extend([0] * (k + 1 - len(us)))
                    us.extend([0] * (k + 1 - len(us)))
                if len(ud) <= k:
                    sent2.extend([0] * (k + 1 - len(ud)))
                    ud.extend([0] * (k + 1 - len(ud)))
                a, b = us[k], ud[k]
                cnt = (budget - (a if a > b else b)) // n
                if cnt > end - j:
                    cnt = end - j
                for y in items[j:j + cnt]:
                    placement[(y >> si) & im][y & qm] = k
                add = cnt * n
                y = us[k] = a + add
                lo, hi = bisect_left(ks, a), bisect_left(ks, y)
                if hi - lo == 1:
                    ms[lo] |= bit
                elif lo < hi:
                    ms[lo:hi] = [m | bit for m in ms[lo:hi]]
                y = ud[k] = b + add
                lo, hi = bisect_left(kd, b), bisect_left(kd, y)
                if hi - lo == 1:
                    md[lo] |= bit
                elif lo < hi:
                    md[lo:hi] = [m | bit for m in md[lo:hi]]
                if count:
                    sent[k] += add
                pairs[d] |= bit
                j += cnt
    sends: dict[int, int] = {}          # round * span + src -> bytes staged to send
    for r in sorted(levels) if count else sorted(only_send):
        for k, x in enumerate(states[r].sent if count else fill.used.get(r, ())):
            if x:
                sends[k * span + r] = x
    # a rank's staging per round is what it sends plus what it receives: the receives are the rest
    recvs: dict[int, int] = {}
    for r, u in fill.used.items():
        for k, x in enumerate(u):
            ks = k * span + r
            v = x - sends.get(ks, 0)
            if v:
                recvs[ks] = v
    messages = sum(m.bit_count() for st in states if st is not None for m in st.pairs.values())
    return placement, fill.rounds, (sends, recvs, messages)
