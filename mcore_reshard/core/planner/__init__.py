"""Transfer planner (layer 3): pure computation on layouts (no torch, no torch.distributed).

``make_plan(src, dst)`` answers, for every destination piece, which source rank sends which box,
and packs those boxes into messages (one per ordered rank pair per staging round) under a hard
per-rank staging budget.  Every rank can compute the same plan from the same layouts; the plan is
plain data with a stable hash (:attr:`Plan.hash`).

Guarantees (each raises :class:`PlanError` naming the tensor and region when violated):

* every element of every destination piece is written exactly once;
* a destination rank that already holds a source copy of an element copies it locally (no message);
* network bytes equal the lower bound: the elements each destination rank needs and does not hold;
* among replicas, senders are chosen to balance the bytes each source rank sends.

Example, one ``[4, 2]`` float32 tensor, source tp=2 on ranks 0-1, destination unsharded on ranks
0 and 2 (rank 0 is colocated)::

    kind  | from -> to | box          | bytes
    local | 0 -> 0     | [0:2, 0:2]   | 16
    send  | 1 -> 0     | [2:4, 0:2]   | 16
    send  | 0 -> 2     | [0:2, 0:2]   | 16
    send  | 1 -> 2     | [2:4, 0:2]   | 16

Modules: :mod:`.plan` (plan data, JSON, hash), :mod:`.index` (source index, checks),
:mod:`.matching` (destination pieces against source boxes), :mod:`.senders` (replica choice),
:mod:`.packing` (round packing and messages), :mod:`.stats` (per-rank parts, totals),
:mod:`.plan_check` (self-consistency of a received plan), :mod:`.templates` (layers planned once per
geometry) and :mod:`.placement` (their messages into rounds), :mod:`.topology` (two-level plans),
:mod:`.windows` (a destination cut into windows of whole modules, one plan each: streamed refits),
:mod:`.traffic` (a plan's traffic totals without its copies, for cost models and reports).
Import from this package.
"""
from __future__ import annotations

from math import prod

from ..box import Box
from ..gcpause import paused_gc
from ..layout import Layout
from .index import _check_tensors, source_index
from .matching import local_mapper, match
from .packing import _pack_rounds
from .plan import (
    ALIGN,
    DEFAULT_BUDGET,
    PLAN_VERSION,
    Copy,
    CopyPlan,
    Message,
    Plan,
    PlanError,
    StoredPlan,
    check_budget,
)
from .plan_check import validate_plan
from .senders import choose_senders
from .stats import _stats, plan_part, plan_stats
from .templates import TemplatedPlan, make_templated
from .topology import COPY_SHARE, Topology, link_stats, plan_forwarding, split_unstaged
from .traffic import PlanTraffic, plan_traffic
from .windows import DEFAULT_WINDOW, Window, WindowedPlan, make_windowed_plan, partition


def make_plan(src: Layout, dst: Layout, *, budget_bytes: int = DEFAULT_BUDGET, allow_cast: bool = False,
              ignore_unused: bool = False, templates: bool | str = True, topology=None) -> Plan:
    """Plan the transfer of every destination piece from the source layout.

    ``budget_bytes`` is the hard per-rank staging limit per round: the bytes a rank stages to send
    plus the bytes it stages to receive in one round never exceed it (the executor allocates one
    staging buffer per rank of at most this size); larger copies are split.  Raises :class:`PlanError` before anything is planned to move
    when the layouts disagree (names, shapes, dtypes) or a destination region has no source.

    ``templates``: where layers repeat one geometry (``layers.<n>.`` names), plan each distinct
    geometry once and return a :class:`~.templates.TemplatedPlan` (same interface, copies made on
    first use, one rank's part without the others') -- unless its rounds exceed
    ``ROUND_SLACK`` x the fewest possible (the busiest rank's bytes / budget): then the
    copy-by-copy plan.  (The templated plan places every instance's messages one by one, so its
    rounds are near that bound on every full-size configuration measured: BENCHMARKS.md A.2.)
    ``"always"``: the templated plan whatever its rounds; False: always the copy-by-copy plan.

    ``topology`` (:class:`~.topology.Topology`, a domain size or a rank -> domain list; a cost-model
    preset's is ``Hardware.topology``): plan in two levels (NVLink domain / NIC, see
    :mod:`.topology`); always the copy-by-copy plan (a forwarded copy's round depends on its
    carrier's, across layers: templates do not apply).  ``None``: one level, today's plans.
    """
    for what, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise TypeError(f"make_plan: {what}={type(lay).__name__} {str(lay)[:60]!r}: must be a Layout")
    budget_bytes = check_budget(budget_bytes)
    topo = Topology.of(topology)
    # planning allocates millions of small acyclic objects: the cyclic garbage collector would
    # rescan the (large) layouts many times over for nothing, so it is paused while planning
    with paused_gc():
        if templates and topo is None:
            tensors = _check_tensors(src, dst, allow_cast, ignore_unused)
            plan = make_templated(src, dst, tensors, budget_bytes, allow_cast, _make_plan)
            if plan is not None and (templates == "always"
                                     or plan.rounds <= ROUND_SLACK * _fewest_rounds(plan) + 1):
                plan.stats["unused_tensors"] = sorted(set(src.tensors) - set(dst.tensors))
                return plan
        return _make_plan(src, dst, budget_bytes, allow_cast, ignore_unused, topo)


ROUND_SLACK = 1.3


def _fewest_rounds(plan: Plan) -> int:
    """The fewest rounds any plan of these copies could have: the busiest rank's payload / budget."""
    s = plan.stats
    most = max((s["sent_bytes"][r] + s["recv_bytes"][r] for r in s["sent_bytes"]), default=0)
    return -(-most // plan.budget_bytes)


def _make_plan(src: Layout, dst: Layout, budget_bytes: int, allow_cast: bool, ignore_unused: bool,
               topo: Topology | None = None) -> Plan:
    """The plan: matching, (two-level: forwarding,) sender choice, round packing, buffer metadata
    and padding, stats."""
    tensors = _check_tensors(src, dst, allow_cast, ignore_unused)
    index = source_index(src)
    to_local = local_mapper()
    local, remote, lower_bound = match(src, dst, tensors, index, to_local)
    forwards = nic_bound = None
    if topo is not None:
        for r in sorted(set(src.buffers) | set(dst.buffers)):
            topo.domain(r)              # every rank must have a domain (raises naming the rank)
        bufs = dst.buffers
        # copies cut to budget / COPY_SHARE (>= 256 B: the budget is >= 1 KiB), forwarded ones
        # exactly as their carrier's copy
        cut = budget_bytes // COPY_SHARE
        remote, forwards, nic_bound = plan_forwarding(remote, topo, tensors, cut, to_local,
                                                      lambda r, name: bufs[r][name].shape)
    copies = choose_senders(remote, budget_bytes if topo is None else cut, to_local)
    del remote                          # freed before packing allocates the messages
    unstaged = None
    if topo is not None:
        sb = src.buffers
        copies, unstaged = split_unstaged(copies, topo, tensors, lambda r, n: sb[r][n].shape, lambda r, n: bufs[r][n].shape)
    messages, rounds, totals = _pack_rounds(copies, budget_bytes, forwards, unstaged, topo and topo.domain)
    padding: list[tuple[int, str, Box]] = []
    buffers = _buffer_meta(src, dst, padding)
    local.sort(key=lambda c: (c.dst, c.dst_buffer, c.dst_local.offsets, c.dst_local.sizes))
    plan = Plan(tensors, buffers, messages, local, padding, budget_bytes, rounds)
    plan.stats = _stats(plan, lower_bound, totals)
    plan.stats["unused_tensors"] = sorted(set(src.tensors) - set(dst.tensors))
    if topo is not None:
        plan.stats["topology"] = topo.to_json()
        plan.stats["hierarchical_bound_bytes"] = nic_bound
        plan.stats.update(link_stats(messages, topo))
    return plan


def _buffer_meta(src: Layout, dst: Layout, padding: list) -> dict:
    """``{"src"|"dst": rank -> buffer name -> [shape, dtype]}``, sorted; appends the destination's zero padding."""
    metas: dict[tuple, list] = {}       # [shape, dtype] lists shared between equal buffers (read-only)

    def side(layout: Layout, pad: bool) -> dict:
        """rank -> buffer name -> [shape, dtype], sorted; with ``pad``, the zero padding of each buffer."""
        out = {}
        for r, bufs in sorted(layout.buffers.items()):
            metas_r = out[r] = {}
            for n in sorted(bufs):
                b = bufs[n]
                shape = b.shape
                mkey = (shape, b.dtype)
                m = metas.get(mkey)
                if m is None:
                    m = metas[mkey] = [list(shape), b.dtype]
                metas_r[n] = m
                if pad:
                    ps = b.pieces
                    if ((len(ps) != 1 or ps[0].local.sizes != shape)
                            and sum(prod(p.local.sizes) for p in ps) != prod(shape)):
                        padding.extend((r, b.name, box) for box in b.padding())
        return out

    return {"src": side(src, False), "dst": side(dst, True)}


__all__ = ["ALIGN", "DEFAULT_BUDGET", "DEFAULT_WINDOW", "PLAN_VERSION", "Copy", "CopyPlan", "Message", "Plan", "StoredPlan",
           "PlanError", "PlanTraffic", "TemplatedPlan", "Topology", "Window", "WindowedPlan", "make_plan", "make_windowed_plan",
           "partition", "plan_traffic",
           "plan_part", "plan_stats", "validate_plan"]
