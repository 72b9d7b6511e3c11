"""Round packing: copies into rounds under the per-rank staging budget, then one message per (round, src, dst)."""
from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from operator import itemgetter
from typing import NamedTuple

from . import fastfit
from .plan import ALIGN, Copy, Message
from .records import ForwardCopy, PendingCopy, new


class RankFill(NamedTuple):
    """One rank's state in a :class:`RoundFill`: its staged bytes per round (``used``), level ->
    index in ``lims`` (None: not registered on the rank), the lims registered on it sorted, and
    their masks (bit k set: round k has more staged than the lim)."""
    used: list[int]
    index: list
    lims: list[int]
    masks: list[int]


class RoundFill:
    """First fit under a per-rank budget: each rank's staged bytes per round, and items placed in the
    lowest round where both their ranks have room (:meth:`place`).

    An item's ``lim`` is the budget less its aligned bytes; each lim met gets a level (an id,
    :meth:`level`).  Per rank: staged bytes per round (rounds past the end: 0), and for every level
    registered on the rank (:meth:`register`: ahead, or the first time the rank meets it), a bit
    mask of the rounds k with used[k] > lim (rounds past the end: no bit); the lowest round with
    room for both ranks is the lowest bit clear in the two masks' OR.  Usage only grows, so a
    round's bit, once set, stays set: when a round of the rank goes from ``a`` to ``y`` staged
    bytes, exactly the masks of the lims in [a, y) gain its bit, consecutive ones in the rank's
    lims kept sorted (two bisections; in all, each round's bit set at most once per level).  A
    mask is computed from the usage only when a level is registered on a rank that has staged
    something; the lim changing back and forth (largest first within each wave of the templated
    placement, sizes jumping back up at every wave) costs nothing.  A level no item to come needs
    on a rank can be dropped there (:meth:`unregister`: largest first, a lim once passed)."""

    def __init__(self, budget: int):
        self.budget = budget
        self.used: dict[int, list[int]] = {}     # rank -> staged bytes per round
        self.lims: list[int] = []                # level -> lim
        self.levels: dict[int, int] = {}         # lim -> level
        self.state: dict[int, RankFill] = {}     # rank -> its state: one lookup per rank

    @property
    def rounds(self) -> int:
        """Rounds used so far (a rank's list grows to k + 1 exactly when something lands in round k)."""
        return max(map(len, self.used.values()), default=0)

    def level(self, lim: int) -> int:
        """The level of ``lim`` (new lims get the next level: levels given in order of lims
        ascending keep that order)."""
        lv = self.levels.get(lim)
        if lv is None:
            lv = self.levels[lim] = len(self.lims)
            self.lims.append(lim)
        return lv

    def register(self, r: int, levels) -> RankFill:
        """Rank ``r``'s state, each of ``levels`` registered on it (its mask computed from what
        the rank staged so far, kept up to date from then on)."""
        st = self.state.get(r)
        if st is None:
            st = self.state[r] = RankFill(self.used.setdefault(r, []), [], [], [])
        u, index, keys, masks = st
        for lv in levels:
            if lv >= len(index):
                index.extend([None] * (lv + 1 - len(index)))
            if index[lv] is None:
                lim = self.lims[lv]
                i = bisect_left(keys, lim)
                keys.insert(i, lim)
                masks.insert(i, int("".join(["1" if x > lim else "0" for x in reversed(u)]) or "0", 2))
                for j in range(i, len(keys)):
                    index[self.levels[keys[j]]] = j
        return st

    def unregister(self, r: int, lv: int) -> None:
        """Level ``lv`` no longer kept on rank ``r`` (none of its items to come has that lim)."""
        u, index, keys, masks = self.state[r]
        i = index[lv]
        index[lv] = None
        del keys[i], masks[i]
        for j in range(i, len(keys)):
            index[self.levels[keys[j]]] = j

    def place(self, s: int, d: int, n: int, count: int) -> tuple[int, int]:
        """Up to ``count`` items of ``n`` (aligned) bytes from rank ``s`` to rank ``d``, each to the
        lowest round where both ranks have room: all in that round, as many as fit there (lower
        rounds never regain room, so one at a time would land the same).  Returns (round, placed)."""
        budget = self.budget
        lv = self.level(budget - n)
        ss, sd = self.register(s, (lv,)), self.register(d, (lv,))
        full = ss.masks[ss.index[lv]] | sd.masks[sd.index[lv]]
        bit = ~full & (full + 1)
        k = bit.bit_length() - 1
        for u in (ss.used, sd.used):
            if len(u) <= k:             # new rounds start empty
                u.extend([0] * (k + 1 - len(u)))
        a, b = ss.used[k], sd.used[k]
        cnt = min(count, (budget - max(a, b)) // n)
        for (u, _, keys, masks), a in ((ss, a), (sd, b)):
            y = u[k] = a + cnt * n
            lo, hi = bisect_left(keys, a), bisect_left(keys, y)
            masks[lo:hi] = [m | bit for m in masks[lo:hi]]      # the lims in [a, y): round k leaves them
        return k, cnt


#: a message's entries' order: tensor, box, dst buffer, dst local box, then the sequence number
#: (an itemgetter of those fields' positions: as fast as a plain index, named here)
_ENTRY_KEY = itemgetter(*map(PendingCopy._fields.index, ("tensor", "offsets", "sizes", "dst_buffer", "dst_local_offsets",
                                                         "dst_local_sizes", "seq")))


def _pack_rounds(copies: list[PendingCopy], budget: int, forwards: list[ForwardCopy] | None = None,
                 unstaged: list[PendingCopy] | None = None, domain=None) -> tuple[list[Message], int, tuple]:
    """First-fit decreasing (each copy, largest first, to the lowest round where both its ranks
    still have room) into rounds so that, in every round, what a rank stages to send plus
    what it stages to receive stays within ``budget`` bytes (one staging buffer per rank, split
    between the send and the receive part of each round); then one message per (round, src, dst)
    with 16-byte aligned entries.  Every copy is at most ``budget`` bytes once aligned (split
    before), and a remote copy's two ranks differ, so a fresh round always has room for it.

    ``copies`` are the :class:`~.records.PendingCopy` records ``make_plan`` builds (their unique
    sequence number keeps ties in the order given, as a stable sort would).  Also returns
    the per-rank totals of :func:`plan_stats` (bytes sent, received, staged per round).

    ``forwards`` (two-level plans, :mod:`.topology`): forwarded copies, placed after every other
    copy, each first-fit from the round after the one its carrier's own copy landed in; they
    make messages of their own (``Message.forward``); the other copies of a two-level plan
    (``forwards`` not None) are packed by :func:`~.topology.pack_busiest_first` instead.
    ``unstaged`` (two-level plans): copies that take no staging (:func:`~.topology.place_unstaged`),
    messages of their own (``Message.unstaged``); ``domain``: rank -> NVLink domain id, for the former."""
    if forwards is not None:            # two-level plans: busiest ranks first, round by round
        from .topology import pack_busiest_first
        placed, used, rounds = pack_busiest_first(copies, budget, domain)
    else:
        placed, used, rounds = _first_fit_runs(copies, budget)
    if forwards:
        rounds = max(rounds, _place_forwards(forwards, budget, used, placed))
    if unstaged:
        from .topology import place_unstaged
        rounds = max(rounds, place_unstaged(unstaged, rounds, placed))
    messages = []
    entry_key = _ENTRY_KEY
    # the plan's per-rank totals (``plan_stats``), summed here rather than in another pass
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    stage_send: dict[tuple[int, int], int] = defaultdict(int)
    stage_recv: dict[tuple[int, int], int] = defaultdict(int)
    ck = fastfit.cfit
    for key in sorted(placed):         # (round, src, dst), then (round, src, dst, flag): _FLAGS
        k, s, d, *flag = key
        group = placed[key]
        if len(group) > 1:
            group.sort(key=entry_key)
        if ck is not None:              # the same entries, made in C
            entries, off, payload = ck.entries(group, s, d, Copy, ALIGN)
        else:
            entries, off, payload = [], 0, 0
            add = entries.append
            for c in group:
                nb = -c.neg_nbytes
                add(new(Copy, (c.tensor, c.box, s, c.src_buffer, c.src_local, d, c.dst_buffer, c.dst_local, nb, off)))
                off += (nb + ALIGN - 1) // ALIGN * ALIGN
                payload += nb
            entries = tuple(entries)
        forward, unstaged = _FLAGS[tuple(flag)]
        messages.append(new(Message, (k, s, d, off, entries, forward, unstaged)))
        sent[s] += payload
        recv[d] += payload
        if not unstaged:                    # unstaged messages take no staging
            stage_send[(k, s)] += off
            stage_recv[(k, d)] += off
    return messages, rounds, (sent, recv, stage_send, stage_recv)


def _first_fit_runs(copies: list[PendingCopy], budget: int) -> tuple[dict, dict[int, list[int]] | None, int]:
    """:func:`_pack_rounds`' first fit of flat plans: (placed: (round, src, dst) -> copies, per-rank
    staged bytes per round (None where the C kernel placed them: flat plans do not read it), rounds)."""
    split = getattr(copies, "split", True)
    if split:
        copies.sort()                   # in place: the caller hands the list over
    ck = fastfit.cfit
    if ck is not None:                  # the same rounds by the C kernel (no per-rank usage kept)
        try:
            rounds, keys, groups = ck.fit_copies(copies, budget, ALIGN)
        except fastfit.FALLBACK:
            pass
        else:
            return dict(zip(keys, groups)), None, rounds
    placed: dict[tuple[int, int, int], list[PendingCopy]] = defaultdict(list)
    fill = RoundFill(budget)
    # copies come in runs of equal (size, src, dst): first-fit puts a run's copies, in order, into
    # the lowest round where both ranks have room until one of them is full, then the next such
    # round (lower rounds never regain room), so a run is placed round by round, as many at once
    # as fit -- the same rounds as one copy at a time
    if split:
        runs = _runs(copies)
    else:                               # unsplit, in sequence order (senders.Copies): grouped, not sorted
        groups: dict[tuple, list] = {}
        for c in copies:
            k3 = (c.neg_nbytes, c.src, c.dst)
            g = groups.get(k3)
            if g is None:
                groups[k3] = [c]
            else:
                g.append(c)
        runs = [groups[k3] for k3 in sorted(groups)]
        del groups
    for run in runs:
        head = run[0]
        s, d = head.src, head.dst
        n = (-head.neg_nbytes + ALIGN - 1) // ALIGN * ALIGN
        j, end = 0, len(run)
        while j < end:
            k, cnt = fill.place(s, d, n, end - j)
            placed[(k, s, d)].extend(run[j:j + cnt] if j or cnt < end else run)
            j += cnt
    return placed, fill.used, fill.rounds


#: (forward, unstaged) of a message by its ``placed`` key's items after (round, src, dst): none,
#: 1 forwarded, 2 forwarded and unstaged, 3 unstaged
_FLAGS = {(): (False, False), (1,): (True, False), (2,): (True, True), (3,): (False, True)}


def _runs(srt: list[PendingCopy]) -> list[list[PendingCopy]]:
    """Sorted copies cut into runs of equal (-bytes, src, dst)."""
    out = []
    j, total = 0, len(srt)
    while j < total:
        c = srt[j]
        key0, s, d = c.neg_nbytes, c.src, c.dst
        end = j + 1
        while end < total and (c := srt[end]).neg_nbytes == key0 and c.src == s and c.dst == d:
            end += 1
        out.append(srt[j:end])
        j = end
    return out


def _place_forwards(forwards: list[ForwardCopy], budget: int, used: dict[int, list[int]], placed: dict) -> int:
    """First-fit (largest first) of forwarded copies into rounds after their carrier's copy; returns
    the rounds used.  ``used``: per rank, staged bytes per round so far (updated).  An unstaged
    forwarded copy (``unstaged``, :attr:`Message.unstaged`) takes no staging: it goes in the
    round right after its carrier's copy landed, whatever the budget."""
    want = {f.carrier for f in forwards}
    landed: dict[tuple, int] = {}       # carrier copy key -> round it lands in
    for (k, s, d), group in placed.items():
        for c in group:
            key = (d, c.dst_buffer, c.tensor, c.offsets, c.sizes)     # equal to its CarrierKey
            if key in want:
                landed[key] = k
    forwards.sort()                     # the sequence number (unique) decides before any Box is compared
    rounds = 0
    for f in forwards:
        lim = budget - (-f.neg_nbytes + ALIGN - 1) // ALIGN * ALIGN
        s, d = f.src, f.dst
        k = landed[f.carrier] + 1
        if f.unstaged:
            placed.setdefault((k, s, d, 2), []).append(f)
            if k >= rounds:
                rounds = k + 1
            continue
        us, ud = used.setdefault(s, []), used.setdefault(d, [])
        end = max(len(us), len(ud), k) + 1      # both padded with empty rounds: the scan stops inside
        if len(us) < end:
            us.extend([0] * (end - len(us)))
        if len(ud) < end:
            ud.extend([0] * (end - len(ud)))
        while us[k] > lim or ud[k] > lim:
            k += 1
        n = budget - lim
        us[k] += n
        ud[k] += n
        placed.setdefault((k, s, d, 1), []).append(f)
        if k >= rounds:
            rounds = k + 1
    return rounds
