"""A plan's traffic without its copies: :func:`plan_traffic`.

What a cost model or a report reads of a plan -- per message its round, ends and bytes on the wire;
per (sender, receiver) the bytes sent and copied locally; per destination rank the tensors it
receives a part of -- counted from a templated plan's templates, instances and placement without
making a copy (a full-size plan's views hold ~10^6..10^7 copies: seconds and gigabytes), or read
off a plan whose copies exist.  Pure Python (no third-party package), integers only: totals are
exact whatever the order they are summed in.

Example (one tensor ``w`` [4, 2] fp32, rank 0 sends rows 0..1 to rank 2 and rank 1 rows 2..3,
round 0; rank 2 copies nothing locally)::

    t = plan_traffic(plan)
    list(zip(t.rounds, t.src, t.dst, t.payload))  == [(0, 0, 2, 16), (0, 1, 2, 16)]
    t.pair_bytes == {(0, 2): 16, (1, 2): 16};  t.local_bytes == {};  t.dst_tensors == {2: {"w"}}
"""
from __future__ import annotations

from array import array
from collections import defaultdict
from dataclasses import dataclass, field

from .templates import TemplatedPlan


@dataclass
class PlanTraffic:
    """Totals of a plan (:func:`plan_traffic`).  ``rounds`` / ``src`` / ``dst`` / ``payload`` /
    ``unstaged``: one entry per message of ``plan.messages`` (the same messages, in no particular
    order): its round, sender, receiver, bytes on the wire (its entries' bytes, alignment not
    counted) and whether it is unstaged (:attr:`~.plan.Message.unstaged`: neither packed nor
    unpacked).  ``pair_bytes``: (sender, receiver) -> bytes on the wire, all rounds;
    ``local_bytes``: (source rank, destination rank) -> bytes copied locally; ``dst_tensors``:
    destination rank -> the tensors it receives some part of (by a message or a local copy)."""
    rounds: array = field(default_factory=lambda: array("q"))
    src: array = field(default_factory=lambda: array("q"))
    dst: array = field(default_factory=lambda: array("q"))
    payload: array = field(default_factory=lambda: array("q"))
    unstaged: array = field(default_factory=lambda: array("b"))
    pair_bytes: dict = field(default_factory=dict)
    local_bytes: dict = field(default_factory=dict)
    dst_tensors: dict = field(default_factory=dict)

    @property
    def messages(self) -> int:
        return len(self.rounds)


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
    pairs: dict = defaultdict(int)
    local: dict = defaultdict(int)
    recv: dict = defaultdict(set)
    for m in plan.messages:
        n = 0
        names = recv[m.dst]
        for c in m.entries:
            n += c.nbytes
            names.add(c.tensor)
        t.rounds.append(m.round)
        t.src.append(m.src)
        t.dst.append(m.dst)
        t.payload.append(n)
        t.unstaged.append(1 if m.unstaged else 0)
        pairs[(m.src, m.dst)] += n
    for c in plan.local_copies:
        local[(c.src, c.dst)] += c.nbytes
        recv[c.dst].add(c.tensor)
    t.pair_bytes, t.local_bytes, t.dst_tensors = dict(pairs), dict(local), dict(recv)
    return t


def _templated(plan) -> PlanTraffic:
    """From the templates: per template message its payload, per instance its ranks and global rounds.
    The messages of a templated plan are its items (one template message of one instance) merged
    per (global round, sender, receiver); none is unstaged."""
    span = 1 + max(plan.ranks, default=0)
    span2 = span * span
    per_template = []
    for tp in plan.templates:
        p = tp.plan
        pay = [sum(c.nbytes for c in m.entries) for m in tp.msgs]
        ends = [(m.src, m.dst) for m in tp.msgs]
        pair: dict = defaultdict(int)
        recv: dict = defaultdict(set)
        for (s, d), n, m in zip(ends, pay, tp.msgs):
            pair[(s, d)] += n
            recv[d].update(c.tensor for c in m.entries)
        loc: dict = defaultdict(int)
        for c in p.local_copies:
            loc[(c.src, c.dst)] += c.nbytes
            recv[c.dst].add(c.tensor)
        per_template.append((ends, pay, dict(pair), dict(loc), dict(recv)))
    merged: dict[int, int] = {}         # round * span^2 + src * span + dst -> payload
    get = merged.get
    pairs: dict = defaultdict(int)
    local: dict = defaultdict(int)
    recv: dict = defaultdict(set)
    for (tid, nums, ranks), rounds in zip(plan.instances, plan.placement):
        ends, pay, tpair, tloc, trecv = per_template[tid]
        for g, sd, n in zip(rounds, [ranks[s] * span + ranks[d] for s, d in ends], pay):
            k = g * span2 + sd
            merged[k] = get(k, 0) + n
        for (s, d), n in tpair.items():
            pairs[(ranks[s], ranks[d])] += n
        for (s, d), n in tloc.items():
            local[(ranks[s], ranks[d])] += n
        for j, names in trecv.items():
            recv[ranks[j]].update(plan.name(x, nums.tensors) for x in names)
    t = PlanTraffic()
    t.rounds = array("q", [k // span2 for k in merged])
    t.src = array("q", [k // span % span for k in merged])
    t.dst = array("q", [k % span for k in merged])
    t.payload = array("q", merged.values())
    t.unstaged = array("b", bytes(len(merged)))
    t.pair_bytes, t.local_bytes, t.dst_tensors = dict(pairs), dict(local), dict(recv)
    return t


__all__ = ["PlanTraffic", "plan_traffic"]
