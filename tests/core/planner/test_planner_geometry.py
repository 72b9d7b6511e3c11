"""The planner's geometry shortcuts checked against plain references: matching's tail-grouped
source windows and shared local Boxes (against every destination piece intersected with every
source box), sender choice's source local Boxes shared by relative offsets (against
``Piece.local_of``), and packing's grouping of unsplit copies (against the plain sort) -- on
random layout pairs and on stacked experts (each expert its own source piece in a 2-d buffer,
the destination a 3-d stack cut per rank, every expert at its own local offset)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from test_planner_properties import cases, check_plan
from test_planner_templates import layered_cases

from mcore_reshard.core.box import Box
from mcore_reshard.core.layout import Buffer, Layout, Piece
from mcore_reshard.core.planner import make_plan
from mcore_reshard.core.planner.index import _check_tensors, source_index
from mcore_reshard.core.planner.matching import local_mapper, match
from mcore_reshard.core.planner.packing import _pack_rounds
from mcore_reshard.core.planner.senders import choose_senders


def stacked_experts(experts=6, rows=4, cols=3, ep=3, tp=4, offset=3, gate_up=True, pad=0):
    """Source: ``ep`` ranks, expert e on rank e % ep (its own 2-d buffer ``fc1.<e>`` [gate; up] or
    ``fc2.<e>``); destination: ``tp`` ranks from ``offset``, each the rows ``[t*rows/tp, ...)``
    of gate and of up of every expert stacked in one 3-d buffer ``w13`` [experts, 2*rows/tp, cols]
    (up at local row rows/tp), and ``w2`` [experts, cols, rows/tp] (down's columns); ``pad``
    leading zero rows in each stack (expert e at local row pad + e)."""
    src, dst = Layout(), Layout()
    k = 2 if gate_up else 1
    src.add_tensor("gate_up", (experts, k * rows, cols), "float32")
    src.add_tensor("down", (experts, cols, rows), "float32")
    dst.add_tensor("gate_up", (experts, k * rows, cols), "float32")
    dst.add_tensor("down", (experts, cols, rows), "float32")
    for e in range(experts):
        r = e % ep
        src.add_buffer(r, Buffer(f"fc1.{e}", (k * rows, cols), "float32", tuple(
            Piece("gate_up", Box((e, h * rows, 0), (1, rows, cols)), Box((h * rows, 0), (rows, cols)))
            for h in range(k))))
        src.add_buffer(r, Buffer(f"fc2.{e}", (cols, rows), "float32",
                                 (Piece("down", Box((e, 0, 0), (1, cols, rows)), Box((0, 0), (cols, rows))),)))
    per = rows // tp
    for t in range(tp):
        dst.add_buffer(offset + t, Buffer("w13", (pad + experts, k * per, cols), "float32", tuple(
            Piece("gate_up", Box((0, h * rows + t * per, 0), (experts, per, cols)), Box((pad, h * per, 0), (experts, per, cols)))
            for h in range(k))))
        dst.add_buffer(offset + t, Buffer("w2", (pad + experts, cols, per), "float32",
                                          (Piece("down", Box((0, 0, t * per), (experts, cols, per)),
                                                 Box((pad, 0, 0), (experts, cols, per))),)))
    return src, dst


def reference_regions(src: Layout, dst: Layout) -> list[tuple]:
    """(dst rank, dst buffer, tensor, source box index, offsets, sizes, dst local offsets, dst local
    sizes) of every destination piece against every source box (no windows), in match's order."""
    index = source_index(src)
    out = []
    for r, bufs in sorted(dst.buffers.items()):
        for bname in sorted(bufs):
            for dp in bufs[bname].pieces:
                for k, (sbox, _) in enumerate(index.get(dp.tensor, ())):
                    got = dp.box.intersect(sbox)
                    if got is not None:
                        lb = dp.local_of(got)
                        out.append((r, bname, dp.tensor, k, got.offsets, got.sizes, lb.offsets, lb.sizes))
    return out


def check_shortcuts(src: Layout, dst: Layout, budget: int) -> None:
    tensors = _check_tensors(src, dst, False, False)
    index = source_index(src)
    to_local = local_mapper()
    local, remote, _ = match(src, dst, tensors, index, to_local)
    # matching: every region, in order, with its Boxes equal to its tuples
    got = []
    for c in local:
        got.append((c.dst, c.dst_buffer, c.tensor, c.box.offsets, c.box.sizes, c.dst_local.offsets, c.dst_local.sizes))
    for x in remote:
        assert (x[10].offsets, x[10].sizes, x[13].offsets, x[13].sizes) == (x[2], x[3], x[11], x[12])
        got.append((x[4], x[5], x[1], x[2], x[3], x[11], x[12]))
    want = [w[:3] + w[4:] for w in reference_regions(src, dst)]
    assert sorted(got) == sorted(want)
    assert [g for g in got[len(local):]] == [w for w in want if w not in set(got[:len(local)])]
    # senders: every copy's source local Box is its holder piece's local_of(box)
    pieces = {(r, b.name, p.tensor, p.box): p for r, bufs in src.buffers.items() for b in bufs.values() for p in b.pieces}
    copies = choose_senders(remote, budget, to_local)
    for c in copies:
        sbox = Box(c[4], c[5])
        holder = [p for (r, bn, t, pb), p in pieces.items() if r == c[1] and bn == c[7] and t == c[3] and pb.contains(sbox)]
        assert len(holder) == 1 and holder[0].local_of(sbox) == c[8], c
    # packing: grouped unsplit copies (senders.Copies) give the plain sort's messages, exactly
    plain = list(copies)
    a, b = _pack_rounds(copies, budget), _pack_rounds(plain, budget)
    assert [(m.round, m.src, m.dst, m.nbytes, m.entries) for m in a[0]] == \
        [(m.round, m.src, m.dst, m.nbytes, m.entries) for m in b[0]]
    assert a[1:] == b[1:]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_shortcuts_match_references_on_random_layouts(case):
    src, dst, budget = case
    check_shortcuts(src, dst, budget)


def test_stacked_experts_at_their_own_local_offsets():
    for kw in ({}, {"gate_up": False}, {"offset": 0, "pad": 1}, {"tp": 2, "experts": 5, "ep": 2, "pad": 2}):
        src, dst = stacked_experts(**kw)
        check_shortcuts(src, dst, 1 << 20)
        check_shortcuts(src, dst, 1024)         # copies split to fit: packing sorts
        plan = make_plan(src, dst, budget_bytes=1 << 20, templates=False)
        check_plan(src, dst, plan)              # every element moved bit-exact, exactly once
        experts = 5 if "experts" in kw else 6
        tp = kw.get("tp", 4)
        k = 1 if kw.get("gate_up") is False else 2
        n_local = sum(len(m.entries) for m in plan.messages) + len(plan.local_copies)
        assert n_local == experts * tp * (k + 1)    # one copy per expert, matrix (half) and rank
        # every expert lands at its own local offset (dim 0 of the stack) of every rank's w13 / w2
        for m in plan.messages:
            for c in m.entries:
                assert c.dst_local.offsets[0] == kw.get("pad", 0) + c.box.offsets[0]
                assert c.src_buffer == (f"fc1.{c.box.offsets[0]}" if c.tensor == "gate_up" else f"fc2.{c.box.offsets[0]}")


def test_a_buffer_holding_two_layers_is_not_templated():
    from mcore_reshard.core.planner import Plan, TemplatedPlan
    from mcore_reshard.core.planner.forms import _groups, _layer_of
    src, dst = Layout(), Layout()
    for lay in (src, dst):
        for i in range(3):
            lay.add_tensor(f"model.layers.{i}.w", (2, 3), "float32")
    for i in range(3):                      # source: one buffer per layer on rank 0
        src.add_buffer(0, Buffer(f"w{i}", (2, 3), "float32", (Piece(f"model.layers.{i}.w", Box((0, 0), (2, 3)),
                                                                    Box((0, 0), (2, 3))),)))
    # destination rank 1: layers 0 and 1 fused in one buffer (after a buffer of layer 2 alone)
    dst.add_buffer(1, Buffer("a", (2, 3), "float32", (Piece("model.layers.2.w", Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),)))
    dst.add_buffer(1, Buffer("b", (4, 3), "float32", tuple(
        Piece(f"model.layers.{i}.w", Box((0, 0), (2, 3)), Box((2 * i, 0), (2, 3))) for i in range(2))))
    assert _groups(src, dst, _layer_of(src, dst)) is None
    plan = make_plan(src, dst)
    assert isinstance(plan, Plan) and not isinstance(plan, TemplatedPlan)
    check_plan(src, dst, plan)
    del dst.buffers[1]["b"]                 # without the fused buffer: grouped by layer
    groups = _groups(src, dst, _layer_of(src, dst))
    assert sorted(groups) == [0, 1, 2] and [r for r, _ in groups[2]["dst"]] == [1] and groups[0]["dst"] == []


def reference_placement(templates, instances, budget, waves):
    """Every instance's messages one by one through ``RoundFill.place`` in the order of
    ``placement._place_counted`` (tuples, not packed ints): placement, rounds, staging totals."""
    from collections import defaultdict

    from mcore_reshard.core.planner.packing import RoundFill
    items = []
    for i, (tid, _, ranks) in enumerate(instances):
        t = templates[tid]
        for q, (s, d, n) in enumerate(t.pairs):
            wave = (t.round_of[q] + i) % t.plan.rounds if waves else 0
            items.append((wave, budget - n, ranks[s], ranks[d], i, q))
    items.sort()
    fill = RoundFill(budget)
    placement = [[None] * len(templates[tid].pairs) for tid, _, _ in instances]
    sends, recvs, msgs = defaultdict(int), defaultdict(int), set()
    span = 1 + max(r for _, _, ranks in instances for r in ranks)
    for _, lim, s, d, i, q in items:
        n = budget - lim
        k, cnt = fill.place(s, d, n, 1)
        assert cnt == 1
        placement[i][q] = k
        sends[k * span + s] += n
        recvs[k * span + d] += n
        msgs.add((k, s, d))
    return placement, fill.rounds, (dict(sends), dict(recvs), len(msgs))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layered_cases())
def test_templated_placement_is_roundfill_item_by_item(case):
    """Placement (packed items, a run of one placed inline, sends of a disaggregated fill read
    from the fill) against the plain RoundFill item by item, in both orders."""
    from mcore_reshard.core.planner import TemplatedPlan
    from mcore_reshard.core.planner.placement import _place_counted
    src, dst, budget = case
    plan = make_plan(src, dst, budget_bytes=budget, templates="always")
    assert isinstance(plan, TemplatedPlan)
    for waves in (False, True):
        got = _place_counted(plan.templates, plan.instances, budget, waves=waves)
        want = reference_placement(plan.templates, plan.instances, budget, waves)
        assert got[0] == want[0] and got[1] == want[1]
        assert {k: v for k, v in got[2][0].items() if v} == want[2][0]
        assert {k: v for k, v in got[2][1].items() if v} == want[2][1]
        assert got[2][2] == want[2][2]
