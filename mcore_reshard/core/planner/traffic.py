"""A plan's traffic without its copies: :func:`plan_traffic`.

What a cost model or a report reads of a plan -- its messages' parts (round, ends, bytes on the wire),
how many messages each rank posts per round, per (sender, receiver) the bytes sent and copied
locally, per destination rank the tensors it receives a part of -- counted from a templated plan's
templates, instances and placement without making a copy (a full-size plan's views hold
~10^6..10^7 copies: seconds and gigabytes), or read off a plan whose copies exist.  Pure Python (no
third-party package), integers only: totals are exact whatever the order they are summed in.

Example (one tensor ``w`` [4, 2] fp32, rank 0 sends rows 0..1 to rank 2 and rank 1 rows 2..3,
round 0; rank 2 copies nothing locally)::

    t = plan_traffic(plan)
    list(zip(t.rounds, t.src, t.dst, t.payload))  == [(0, 0, 2, 16), (0, 1, 2, 16)]
    t.posted == {(0, 0): 1, (0, 1): 1};  t.messages == 2
    t.pair_bytes == {(0, 2): 16, (1, 2): 16};  t.local_bytes == {};  t.dst_tensors == {2: {"w"}}
"""
from __future__ import annotations

from array import array
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, attrgetter, floordiv, mul

from ..gcpause import paused_gc
from .templates import TemplatedPlan


@dataclass
class PlanTraffic:
    """Totals of a plan (:func:`plan_traffic`).  ``rounds`` / ``src`` / ``dst`` / ``payload`` /
    ``unstaged``, one entry per *part* of a message, in no particular order: its round, sender,
    receiver, bytes on the wire (entries' bytes, alignment not counted) and whether it is unstaged
    (:attr:`~.plan.Message.unstaged`: neither packed nor unpacked).  A part is a whole message of a
    :class:`~.plan.Plan`, one template message of one instance of a templated plan (whose messages
    are those merged per (round, sender, receiver)).  ``posted``: (round, sender) -> messages it
    posts; ``pair_bytes``: (sender, receiver) -> bytes on the wire, all rounds; ``local_bytes``:
    (source rank, destination rank) -> bytes copied locally; ``dst_tensors``: destination rank ->
    the tensors it receives some part of (by a message or a local copy)."""
    rounds: array = field(default_factory=lambda: array("q"))
    src: array = field(default_factory=lambda: array("q"))
    dst: array = field(default_factory=lambda: array("q"))
    payload: array = field(default_factory=lambda: array("q"))
    unstaged: array = field(default_factory=lambda: array("b"))
    posted: dict = field(default_factory=dict)
    pair_bytes: dict = field(default_factory=dict)
    local_bytes: dict = field(default_factory=dict)
    dst_tensors: dict = field(default_factory=dict)

    @property
    def messages(self) -> int:
        """The plan's messages (``len(plan.messages)``)."""
        return sum(self.posted.values())


@paused_gc()
def plan_traffic(plan) -> PlanTraffic:
    """The traffic totals of ``plan`` (a :class:`~.plan.Plan`, a part of one, or a
    :class:`~.templates.TemplatedPlan`: from its templates, instances and placement, whether or not
    its views were made, and without making them)."""
    if isinstance(plan, TemplatedPlan):
        return _templated(plan)
    return _copies(plan)


def _copies(plan) -> PlanTraffic:
    """From the plan's messages and local copies (they exist, or are made here)."""
    t = PlanTraffic()
    posted: dict = defaultdict(int)
    pairs: dict = defaultdict(int)
    local: dict = defaultdict(int)
    recv: dict = defaultdict(set)
    for m in plan.messages:
        n = sum(map(_NBYTES, m.entries))
        recv[m.dst].update(map(_TENSOR, m.entries))
        t.rounds.append(m.round)
        t.src.append(m.src)
        t.dst.append(m.dst)
        t.payload.append(n)
        t.unstaged.append(1 if m.unstaged else 0)
        posted[(m.round, m.src)] += 1
        pairs[(m.src, m.dst)] += n
    for c in plan.local_copies:
        local[(c.src, c.dst)] += c.nbytes
        recv[c.dst].add(c.tensor)
    t.posted, t.pair_bytes, t.local_bytes, t.dst_tensors = dict(posted), dict(pairs), dict(local), dict(recv)
    return t


def _templated(plan: TemplatedPlan) -> PlanTraffic:
    """From the templates: per template message its ends and payload, per instance its ranks and
    global rounds (no loop over the instances' messages in Python: C iterators); a message is the
    parts of one (global round, sender, receiver); none is unstaged."""
    span = 1 + max(plan.ranks, default=0)
    span2 = span * span
    per_template = []
    for tp in plan.templates:
        srcs, dsts = [m.src for m in tp.msgs], [m.dst for m in tp.msgs]
        pay = array("q", [sum(map(_NBYTES, m.entries)) for m in tp.msgs])
        pair: dict = defaultdict(int)
        recv: dict = defaultdict(set)
        for s, d, n, m in zip(srcs, dsts, pay, tp.msgs):
            pair[(s, d)] += n
            recv[d].update(map(_TENSOR, m.entries))
        loc: dict = defaultdict(int)
        for c in tp.plan.local_copies:
            loc[(c.src, c.dst)] += c.nbytes
            recv[c.dst].add(c.tensor)
        names = sorted(set().union(*recv.values()))
        ends = list(pair)                               # the distinct (src, dst) index pairs
        which = array("q", map({e: i for i, e in enumerate(ends)}.__getitem__, zip(srcs, dsts)))
        per_template.append((srcs, dsts, pay, ends, which, dict(pair), dict(loc), dict(recv), names))
    t = PlanTraffic()
    keys: set[int] = set()              # round * span^2 + src * span + dst of every message
    pairs: dict = defaultdict(int)
    local: dict = defaultdict(int)
    recv: dict = defaultdict(set)
    for (tid, nums, ranks), rounds in zip(plan.instances, plan.placement):
        srcs, dsts, pay, ends, which, tpair, tloc, trecv, names = per_template[tid]
        at = ranks.__getitem__
        t.rounds.extend(rounds)
        t.src.extend(map(at, srcs))
        t.dst.extend(map(at, dsts))
        t.payload.extend(pay)
        pair_key = [ranks[s] * span + ranks[d] for s, d in ends]
        keys.update(map(add, map(mul, rounds, repeat(span2)), map(pair_key.__getitem__, which)))
        for (s, d), n in tpair.items():
            pairs[(ranks[s], ranks[d])] += n
        for (s, d), n in tloc.items():
            local[(ranks[s], ranks[d])] += n
        real = {x: plan.name(x, nums.tensors) for x in names}.__getitem__
        for j, canon in trecv.items():
            recv[ranks[j]].update(map(real, canon))
    t.unstaged = array("b", bytes(len(t.rounds)))
    t.posted = {divmod(k, span): c for k, c in Counter(map(floordiv, keys, repeat(span))).items()}
    t.pair_bytes, t.local_bytes, t.dst_tensors = dict(pairs), dict(local), dict(recv)
    return t


_NBYTES = attrgetter("nbytes")
_TENSOR = attrgetter("tensor")

__all__ = ["PlanTraffic", "plan_traffic"]
