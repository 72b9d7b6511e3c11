"""A plan's traffic without its copies: :func:`plan_traffic`.

What a cost model or a report reads of a plan -- its messages' parts (round, ends, bytes on the wire),
per (sender, receiver) the bytes sent and copied locally, per destination rank the tensors it
receives a part of -- from a templated plan's templates, instances and placement without making a
copy (a full-size plan's views hold ~10^6..10^7 copies: seconds and gigabytes), or read off a plan
whose copies exist.  The parts stay grouped as the plan holds them (:class:`PartGroup`: a template's
messages and, per instance, its ranks and rounds): a consumer walks them (:meth:`PlanTraffic.parts`)
or lays them out as arrays, one group at a time (``tools.costmodel``).  Pure Python, integers only:
totals are exact whatever the order they are summed in.

Example (one tensor ``w`` [4, 2] fp32, rank 0 sends rows 0..1 to rank 2 and rank 1 rows 2..3,
round 0; rank 2 copies nothing locally)::

    t = plan_traffic(plan)
    sorted(t.parts())  == [Part(round=0, src=0, dst=2, payload=16, unstaged=False),
                           Part(round=0, src=1, dst=2, payload=16, unstaged=False)]
    t.pair_bytes() == {(0, 2): 16, (1, 2): 16};  t.local_bytes == {}
    t.received_bytes == 32          # rank 2 receives parts of w: all of w is 32 bytes
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from operator import attrgetter
from typing import Iterator, NamedTuple

from ..gcpause import paused_gc
from ..layout import itemsize
from .templates import TemplatedPlan


class Part(NamedTuple):
    """One part of a message: its round, sender, receiver, bytes on the wire (entries' bytes,
    alignment not counted) and whether it is unstaged (:attr:`~.plan.Message.unstaged`)."""
    round: int
    src: int
    dst: int
    payload: int
    unstaged: bool


@dataclass
class PartGroup:
    """Messages as a templated plan holds them: per template message its sender and receiver *index*,
    bytes on the wire and unstaged flag; ``copies``: per instance, its ranks (index -> rank) and the
    global round of each of its messages.  A plain plan is one group, its ranks the identity."""
    src: list
    dst: list
    payload: list
    unstaged: list
    copies: list = field(default_factory=list)        # [(ranks, rounds)]


@dataclass
class PlanTraffic:
    """Totals of a plan (:func:`plan_traffic`).  ``groups``: its message parts
    (:class:`PartGroup`, :meth:`parts`, :meth:`pair_bytes`); ``merged``: the parts of one (round,
    sender, receiver) are one message (a templated plan's items), else every part is a message of its
    own; ``span``: 1 + the largest rank; ``local_bytes``: (source rank, destination rank) -> bytes
    copied locally; ``received_bytes``: over every destination rank and every tensor it receives
    some part of (by a message or a local copy), the whole tensor's bytes (source dtype): what
    sending whole tensors would move."""
    span: int = 1
    groups: list = field(default_factory=list)
    merged: bool = False
    local_bytes: dict = field(default_factory=dict)
    received_bytes: int = 0

    def pair_bytes(self) -> dict:
        """(sender, receiver) -> bytes on the wire, all rounds (summed per group, then per instance)."""
        out: dict = defaultdict(int)
        for g in self.groups:
            pair: dict = defaultdict(int)
            for s, d, n in zip(g.src, g.dst, g.payload):
                pair[(s, d)] += n
            for ranks, _ in g.copies:
                for (s, d), n in pair.items():
                    out[(ranks[s], ranks[d])] += n
        return dict(out)

    def parts(self) -> Iterator[Part]:
        """Every part, group by group, instance by instance."""
        for g in self.groups:
            for ranks, rounds in g.copies:
                for k, s, d, n, u in zip(rounds, g.src, g.dst, g.payload, g.unstaged):
                    yield Part(k, ranks[s], ranks[d], n, u)


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
    group = PartGroup([], [], [], [])
    rounds: list[int] = []
    local: dict = defaultdict(int)
    recv: dict = defaultdict(set)
    for m in plan.messages:
        n = sum(map(_NBYTES, m.entries))
        recv[m.dst].update(map(_TENSOR, m.entries))
        group.src.append(m.src)
        group.dst.append(m.dst)
        group.payload.append(n)
        group.unstaged.append(bool(m.unstaged))
        rounds.append(m.round)
    for c in plan.local_copies:
        local[(c.src, c.dst)] += c.nbytes
        recv[c.dst].add(c.tensor)
    span = 1 + max(max(group.src, default=0), max(group.dst, default=0), max((d for _, d in local), default=0))
    group.copies.append((range(span), rounds))
    size = _sizes(plan.tensors)
    return PlanTraffic(span, [group], False, dict(local), sum(sum(map(size, names)) for names in recv.values()))


def _templated(plan: TemplatedPlan) -> PlanTraffic:
    """From the templates: per template message its ends and payload, per instance its ranks and
    global rounds (nothing per instance message); a message is the parts of one (global round,
    sender, receiver); none is unstaged."""
    groups, per_template = [], []
    for tp in plan.templates:
        msgs = tp.msgs
        pay = [sum(map(_NBYTES, m.entries)) for m in msgs]
        groups.append(PartGroup([m.src for m in msgs], [m.dst for m in msgs], pay, [False] * len(msgs)))
        recv: dict = defaultdict(set)
        for m in msgs:
            recv[m.dst].update(map(_TENSOR, m.entries))
        loc: dict = defaultdict(int)
        for c in tp.plan.local_copies:
            loc[(c.src, c.dst)] += c.nbytes
            recv[c.dst].add(c.tensor)
        size = _sizes(tp.plan.tensors)      # canonical names, the real tensors' shapes and dtypes
        # a tensor is in one instance only (instances are layers): per instance, its template's ranks
        # receive its tensors' whole bytes once each
        per_template.append((dict(loc), sum(sum(map(size, names)) for names in recv.values())))
    local: dict = defaultdict(int)
    received = 0
    for (tid, _, ranks), rounds in zip(plan.instances, plan.placement):
        groups[tid].copies.append((ranks, rounds))
        tloc, whole = per_template[tid]
        for (s, d), n in tloc.items():
            local[(ranks[s], ranks[d])] += n
        received += whole
    return PlanTraffic(1 + max(plan.ranks, default=0), groups, True, dict(local), received)


def _sizes(tensors: dict):
    """name -> the tensor's bytes in its source dtype (a plan's ``tensors``)."""
    return {n: prod(meta["shape"]) * itemsize(meta["src_dtype"]) for n, meta in tensors.items()}.__getitem__


_NBYTES = attrgetter("nbytes")
_TENSOR = attrgetter("tensor")

__all__ = ["Part", "PartGroup", "PlanTraffic", "plan_traffic"]
