"""Per-rank views and totals of a plan: :func:`plan_part`, :func:`plan_stats`."""
from __future__ import annotations

from collections import defaultdict

from ..gcpause import paused_gc
from ..layout import itemsize
from .plan import Plan


@paused_gc()
def plan_part(plan: Plan, rank: int) -> Plan:
    """One rank's own part of ``plan``: the messages it sends or receives, its local copies and its
    padding, with the plan's tensors, buffers (all ranks: peers' buffer metadata is what
    :func:`validate_plan` checks a message against), budget and round numbers unchanged, so every
    entry is exactly the whole plan's (same rounds, offsets, senders).  Ranks still agree on the
    whole plan's :attr:`Plan.hash` before a transfer (a part's own hash differs from rank to rank).

    There is no cheaper way to get the part than from the whole plan: the sender of a replicated
    region is chosen by a greedy over *all* regions (a rank's load depends on every other
    choice), and a message's round by a first-fit over *all* copies (a round's room on a rank
    depends on its other peers), so a rank-local computation would give a different plan.
    ``validate_plan(plan_part(p, r), r)`` checks the same things as ``validate_plan(p, r)``.

    A templated plan (:mod:`.templates`) makes the part from its templates alone, without any
    other rank's copies; that part's buffers are those of ``rank`` and its peers, and its hash is
    the whole plan's (what the handshake compares)."""
    own = getattr(plan, "part", None)      # a templated plan makes its part from the templates
    if own is not None:
        return own(rank)
    messages = [m for m in plan.messages if m.src == rank or m.dst == rank]
    local = [c for c in plan.local_copies if c.dst == rank or c.src == rank]
    padding = [(r, b, box) for r, b, box in plan.padding if r == rank]
    part = Plan(plan.tensors, plan.buffers, messages, local, padding, plan.budget_bytes, plan.rounds)
    part.stats = {"rank": rank}
    return part


def plan_stats(plan: Plan, lower_bound: int | None = None) -> dict:
    sent: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    stage_send: dict[tuple[int, int], int] = defaultdict(int)
    stage_recv: dict[tuple[int, int], int] = defaultdict(int)
    for m in plan.messages:
        payload = sum(c.nbytes for c in m.entries)
        sent[m.src] += payload
        recv[m.dst] += payload
        if not m.unstaged:          # an unstaged message takes no staging
            stage_send[(m.round, m.src)] += m.nbytes
            stage_recv[(m.round, m.dst)] += m.nbytes
    return _stats(plan, lower_bound, (sent, recv, stage_send, stage_recv))


def _stats(plan: Plan, lower_bound: int | None, totals: tuple) -> dict:
    pad = 0
    for r, b, box in plan.padding:
        pad += box.numel * itemsize(plan.buffers["dst"][r][b][1])
    return _totals_dict(plan.ranks, totals, lower_bound, sum(c.nbytes for c in plan.local_copies), pad,
                        len(plan.messages), plan.rounds)


def _totals_dict(ranks: list[int], totals: tuple, lower_bound: int | None, local: int, pad: int, messages: int,
                 rounds: int) -> dict:
    """The stats dict of a plan from its per-rank totals (sent, received, staged per round and rank)."""
    sent, recv, stage_send, stage_recv = totals
    plus = getattr(stage_send, "max_plus", None)       # the C kernel's staging (placement.Staged)
    max_stage = None if plus is None else plus(stage_recv)
    if max_stage is None:
        stage: dict[tuple[int, int], int] = defaultdict(int)
        for key, v in stage_send.items():
            stage[key] += v
        for key, v in stage_recv.items():
            stage[key] += v
        max_stage = max(stage.values(), default=0)
    network = sum(sent.values())
    return {
        "network_bytes": network,
        "lower_bound_bytes": network if lower_bound is None else lower_bound,
        "local_bytes": local,
        "padding_bytes": pad,
        "messages": messages,
        "rounds": rounds,
        "sent_bytes": {str(r): sent.get(r, 0) for r in ranks},
        "recv_bytes": {str(r): recv.get(r, 0) for r in ranks},
        "max_send_bytes": max(sent.values(), default=0),
        "max_recv_bytes": max(recv.values(), default=0),
        "max_stage_send_bytes": max(stage_send.values(), default=0),
        "max_stage_recv_bytes": max(stage_recv.values(), default=0),
        # one staging buffer per rank holds a round's sends and receives together: its size
        "max_stage_bytes": max_stage,
    }

