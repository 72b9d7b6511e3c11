"""Templated plans (layers of one geometry planned once): the planner's guarantees re-proved on
random layered layout pairs -- exact values and coverage, bytes = an independent lower bound,
staging <= budget, determinism, JSON round trip -- and each rank's part, made from the templates
alone, equal to the whole plan's messages of that rank and valid on its own."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_planner_properties import cases, check_plan

from mcore_reshard.core.layout import Buffer, Layout, Piece
from mcore_reshard.core.planner import (
    ROUND_SLACK,
    Plan,
    TemplatedPlan,
    _fewest_rounds,
    make_plan,
    plan_part,
    plan_stats,
    validate_plan,
)


def _layered(cases_: list, layers: list[tuple[int, int, int]]) -> tuple[Layout, Layout]:
    """Layer ``i`` of ``layers`` = (case index, source rank shift, destination rank shift): that case's
    tensors and buffers renamed ``model.layers.<i>.<name>`` on shifted ranks; case index -1: case 0
    renamed ``rest.<name>`` (no layer number)."""
    src, dst = Layout(), Layout()
    for i, (ci, s_shift, d_shift) in enumerate(layers):
        prefix = f"model.layers.{i}." if ci >= 0 else "rest."
        csrc, cdst = cases_[max(ci, 0)][:2]
        for out, lay, shift in ((src, csrc, s_shift), (dst, cdst, d_shift)):
            for n, m in lay.tensors.items():
                out.add_tensor(prefix + n, m.shape, m.dtype)
            for r, bufs in lay.buffers.items():
                for b in bufs.values():
                    out.add_buffer(r + shift, Buffer(prefix + b.name, b.shape, b.dtype, tuple(
                        Piece(prefix + p.tensor, p.box, p.local) for p in b.pieces)))
    return src, dst


@st.composite
def layered_cases(draw):
    kinds = draw(st.lists(cases(), min_size=1, max_size=2))
    budget = kinds[0][2]
    n = draw(st.integers(2, 4))
    span = 1 + max(max(c[0].ranks + c[1].ranks) for c in kinds)
    layers = [(0, 0, 0), (0, 0, 0)]     # two layers of one geometry on the same ranks: one template at least
    for i in range(2, n + 1):
        ci = draw(st.integers(0, len(kinds) - 1))
        # "pp": each layer's source on ranks of its own, as pipeline stages; else all on the same ranks
        pp = draw(st.booleans())
        layers.append((ci, span * i if pp else 0, 0))
    if draw(st.booleans()):
        layers.append((-1, 0, 0))       # an unnumbered tensor group ("rest": embedding, head)
    src, dst = _layered(kinds, layers)
    return src, dst, budget


def _same_messages(a, b) -> bool:
    return [(m.round, m.src, m.dst, m.nbytes, m.entries) for m in a] == [(m.round, m.src, m.dst, m.nbytes, m.entries) for m in b]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layered_cases())
def test_templated_plans_are_exact_minimal_and_agree_rank_by_rank(case):
    src, dst, budget = case
    plan = make_plan(src, dst, budget_bytes=budget, templates="always")
    assert isinstance(plan, TemplatedPlan)
    # by default the templated plan only where its rounds are near the fewest possible
    default = make_plan(src, dst, budget_bytes=budget)
    assert isinstance(default, TemplatedPlan) == (plan.rounds <= ROUND_SLACK * _fewest_rounds(plan) + 1)
    assert plan.stats["instances"] > plan.stats["templates"]
    check_plan(src, dst, plan)          # values, every element once, bytes = brute lower bound, budget
    classic = make_plan(src, dst, budget_bytes=budget, templates=False)
    for k in ("network_bytes", "lower_bound_bytes", "local_bytes", "padding_bytes", "sent_bytes", "recv_bytes"):
        if k not in ("sent_bytes", "recv_bytes"):
            assert plan.stats[k] == classic.stats[k], k
    # the stats counted from the templates are those of the plan's own messages
    again = plan_stats(plan, plan.stats["lower_bound_bytes"])
    for k, v in again.items():
        assert plan.stats[k] == v, k
    assert validate_plan(plan) == []
    for r in plan.ranks:
        part = plan_part(plan, r)
        assert _same_messages(part.messages, [m for m in plan.messages if r in (m.src, m.dst)])
        assert part.local_copies == [c for c in plan.local_copies if c.dst == r]
        assert part.padding == [x for x in plan.padding if x[0] == r]
        assert validate_plan(part, r) == []
        assert part.hash == plan.hash   # what the handshake compares
    # deterministic: the same plan from JSON round-tripped layouts and from the plan's own JSON
    src2 = Layout.from_json(json.loads(json.dumps(src.to_json())))
    dst2 = Layout.from_json(json.loads(json.dumps(dst.to_json())))
    assert make_plan(src2, dst2, budget_bytes=budget, templates="always").hash == plan.hash
    loaded = Plan.from_json(json.loads(plan.dumps()))
    assert isinstance(loaded, TemplatedPlan) and loaded.hash == plan.hash
    assert _same_messages(loaded.messages, plan.messages)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layered_cases())
def test_both_placement_orders_keep_every_guarantee(case):
    """Largest first and in waves (``_place``'s two orders, each forced): exact, budget, bytes, parts;
    the default is one of them, the one with fewer rounds where its first is not near the fewest."""
    from mcore_reshard.core.planner.templates import _place
    src, dst, budget = case
    plan = make_plan(src, dst, budget_bytes=budget, templates="always")
    rounds = {}
    for waves in (False, True):
        placement, n = _place(plan.templates, plan.instances, budget, waves=waves)
        forced = TemplatedPlan(plan.tensors, budget, plan.templates, plan.instances, placement, n)
        rounds[waves] = forced.rounds
        check_plan(src, dst, forced)
        # stats counted from a given placement (one pass) = those of its own messages
        again = plan_stats(forced, forced.stats["lower_bound_bytes"])
        assert {k: forced.stats[k] for k in again} == again
        assert validate_plan(forced) == []
        for r in forced.ranks:
            part = plan_part(forced, r)
            assert _same_messages(part.messages, [m for m in forced.messages if r in (m.src, m.dst)])
            assert validate_plan(part, r) == []
    from mcore_reshard.core.planner.templates import WAVE_SLACK
    assert plan.rounds in rounds.values() and min(rounds.values()) >= _fewest_rounds(plan)
    if plan.rounds > WAVE_SLACK * _fewest_rounds(plan):
        assert plan.rounds == min(rounds.values())


def test_pipeline_stages_share_rounds_message_by_message():
    """Four pipeline stages of four layers (tp=2 on their own ranks) -> every layer replicated on 4
    ranks: every source rank sends, every destination rank receives about as much.  Whole template
    rounds placed as units needed 32 rounds here (fewest possible 22); messages placed one by one,
    largest first, 27; in waves 23, the one kept."""
    from mcore_reshard.core.mesh import Mesh
    from mcore_reshard.core.planner.templates import _place
    src, dst = Layout(), Layout()
    for n in range(16):
        for t, shape in (("a", (64, 32)), ("b", (32, 64))):
            src.add_sharded(f"model.layers.{n}.{t}", shape, "float32", Mesh.of({"tp": 2}, 2 * (n // 4)), [("tp", 0)])
            dst.add_sharded(f"model.layers.{n}.{t}", shape, "float32", Mesh.of({"dp": 4}, 8))
    budget = 12288
    plan = make_plan(src, dst, budget_bytes=budget)
    assert isinstance(plan, TemplatedPlan) and plan.stats["templates"] == 1 and plan.stats["instances"] == 16
    assert (plan.rounds, _fewest_rounds(plan)) == (23, 22)
    assert [_place(plan.templates, plan.instances, budget, waves=w)[1] for w in (False, True)] == [27, 23]
    assert plan.stats["max_stage_bytes"] <= budget
    check_plan(src, dst, plan)


def test_layers_of_one_geometry_share_one_template_and_rounds_interleave():
    """Four layers of tp=2 -> tp=1 (disaggregated), two pipeline stages: one template, four
    instances; the stages' rounds share global rounds (their source ranks differ)."""
    from mcore_reshard.core.mesh import Mesh
    src, dst = Layout(), Layout()
    for i in range(4):
        name = f"model.layers.{i}.w"
        src.add_sharded(name, (64, 16), "float32", Mesh.of({"tp": 2}, 2 * (i // 2)), [("tp", 0)])
        dst.add_sharded(name, (64, 16), "float32", Mesh.of({"tp": 1}, 4))
    plan = make_plan(src, dst, budget_bytes=4096)
    assert isinstance(plan, TemplatedPlan)
    assert (plan.stats["templates"], plan.stats["instances"]) == (1, 4)
    # a layer: 2 messages of 32x16 fp32 = 2048 B each into rank 4 (4096 B of staging per round):
    # 8 such messages, two per round on rank 4, so 4 rounds, the lower bound; messages are placed
    # one by one (largest first, ties by (src, dst)): a round takes one source rank's two layers,
    # merged into one message of 4096 B
    assert plan.rounds == 4 and plan.stats["max_stage_bytes"] == 4096
    assert plan.stats["network_bytes"] == 4 * 64 * 16 * 4
    assert sorted((m.round, m.src, m.dst, m.nbytes, len(m.entries)) for m in plan.messages) == [
        (0, 0, 4, 4096, 2), (1, 1, 4, 4096, 2), (2, 2, 4, 4096, 2), (3, 3, 4, 4096, 2)]
    assert plan.stats["messages"] == 4
    check_plan(src, dst, plan)


def test_a_buffer_mixing_layers_is_planned_copy_by_copy():
    src, dst = Layout(), Layout()
    for lay, r in ((src, 0), (dst, 1)):
        for i in range(2):
            lay.add_tensor(f"layers.{i}.w", (4, 4), "float32")
    from mcore_reshard.core.box import Box
    both = Buffer("fused", (8, 4), "float32", (Piece("layers.0.w", Box.full((4, 4)), Box((0, 0), (4, 4))),
                                               Piece("layers.1.w", Box.full((4, 4)), Box((4, 0), (4, 4)))))
    src.add_buffer(0, both)
    for i in range(2):
        dst.add_buffer(1, Buffer(f"layers.{i}.w", (4, 4), "float32", (Piece(f"layers.{i}.w", Box.full((4, 4)),
                                                                              Box.full((4, 4))),)))
    plan = make_plan(src, dst)
    assert not isinstance(plan, TemplatedPlan)
    check_plan(src, dst, plan)


def _colocated_stages(stages: int = 2, layers_per_stage: int = 2) -> tuple[Layout, Layout]:
    """Colocated: training tp=2 per pipeline stage (stage s on ranks 2s, 2s+1) -> ``stages``
    inference replicas of tp=2 on the same ranks (rank r holds shard r % 2 of every layer)."""
    from mcore_reshard.core.mesh import Mesh
    src, dst = Layout(), Layout()
    world = 2 * stages
    for n in range(stages * layers_per_stage):
        for t, shape, dim in (("a", (8, 12), 0), ("b", (12, 8), 1)):
            name = f"model.layers.{n}.{t}"
            src.add_sharded(name, shape, "float32", Mesh.of({"tp": 2}, 2 * (n // layers_per_stage)), [("tp", dim)])
            dst.add_sharded(name, shape, "float32", Mesh.of({"tp": 2, "dp": world // 2}), [("tp", 1 - dim)])
    return src, dst


def test_colocated_pipeline_stages_share_one_template_rotated():
    """Colocated, two pipeline stages: in index order of the sorted ranks stage 1's source ranks
    (2, 3) get other indices than stage 0's (0, 1), so each stage needed a template of its own;
    with the ranks rotated to start at the group's lowest source rank the destination (rank r holds
    shard r % 2) looks the same from both stages: one template, its stage-1 instances on ranks
    (2, 3, 0, 1).  Exact, every guarantee, each rank's part, JSON round trip; a received plan whose
    instance names a rank twice is refused."""
    src, dst = _colocated_stages()
    plan = make_plan(src, dst, budget_bytes=1 << 20, templates="always")
    assert isinstance(plan, TemplatedPlan)
    assert (plan.stats["templates"], plan.stats["instances"]) == (1, 4)
    assert [tuple(ranks) for _, _, ranks in plan.instances] == [(0, 1, 2, 3), (0, 1, 2, 3), (2, 3, 0, 1), (2, 3, 0, 1)]
    check_plan(src, dst, plan)
    assert validate_plan(plan) == []
    classic = make_plan(src, dst, budget_bytes=1 << 20, templates=False)
    for k in ("network_bytes", "lower_bound_bytes", "local_bytes"):
        assert plan.stats[k] == classic.stats[k], k
    for r in plan.ranks:
        part = plan_part(plan, r)
        assert _same_messages(part.messages, [m for m in plan.messages if r in (m.src, m.dst)])
        assert part.local_copies == [c for c in plan.local_copies if c.dst == r]
        assert validate_plan(part, r) == []
    pj = json.loads(plan.dumps())
    loaded = Plan.from_json(pj)
    assert loaded.hash == plan.hash and _same_messages(loaded.messages, plan.messages)
    pj["instances"][2][2] = [2, 3, 0, 2]
    import pytest

    from mcore_reshard.core.planner import PlanError
    with pytest.raises(PlanError, match="distinct ranks"):
        Plan.from_json(pj)


def test_disaggregated_stages_keep_the_sorted_order():
    """Disaggregated (no rank on both sides): the sorted order already gives every stage the same
    indices; the instances' ranks stay sorted (plans and hashes as before)."""
    from mcore_reshard.core.mesh import Mesh
    src, dst = Layout(), Layout()
    for n in range(4):
        name = f"model.layers.{n}.w"
        src.add_sharded(name, (8, 8), "float32", Mesh.of({"tp": 2}, 2 * (n // 2)), [("tp", 0)])
        dst.add_sharded(name, (8, 8), "float32", Mesh.of({"tp": 2}, 4), [("tp", 1)])
    plan = make_plan(src, dst, budget_bytes=1 << 20, templates="always")
    assert plan.stats["templates"] == 1
    assert all(list(ranks) == sorted(ranks) for _, _, ranks in plan.instances)
    check_plan(src, dst, plan)


@st.composite
def colocated_stage_cases(draw):
    """A random case's layouts as a colocated pipeline: ``stages`` stages of ``per`` layers, stage
    s's source on the case's ranks shifted by s * w, and the destination (an inference replica per
    stage width) on every stage's ranks: rotated to each group's lowest source rank, every layer
    looks the same."""
    src0, dst0, budget = draw(cases())
    w = 1 + max(src0.ranks + dst0.ranks)
    stages, per = draw(st.integers(2, 3)), draw(st.integers(1, 2))
    src, dst = Layout(), Layout()
    for i in range(stages * per):
        prefix = f"model.layers.{i}."
        for out, lay, shifts in ((src, src0, [w * (i // per)]), (dst, dst0, [w * q for q in range(stages)])):
            for n, m in lay.tensors.items():
                out.add_tensor(prefix + n, m.shape, m.dtype)
            for shift in shifts:
                for r, bufs in lay.buffers.items():
                    for b in bufs.values():
                        out.add_buffer(r + shift, Buffer(prefix + b.name, b.shape, b.dtype, tuple(
                            Piece(prefix + p.tensor, p.box, p.local) for p in b.pieces)))
    return src, dst, budget


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(colocated_stage_cases())
def test_colocated_stages_one_template_every_guarantee(case):
    """Every layer of every stage one template (rotated where the sorted order differs per stage;
    without it, each of 200 drawn cases needed more than one),
    exact, every element once, bytes = the brute lower bound, staging <= budget; each rank's part
    equal to the whole plan's and valid; JSON round trip; the same plan from round-tripped layouts."""
    src, dst, budget = case
    plan = make_plan(src, dst, budget_bytes=budget, templates="always")
    assert isinstance(plan, TemplatedPlan)
    # every numbered layer one template (buffers without pieces go to the unnumbered group)
    assert len({tid for tid, nums, _ in plan.instances if nums[0] is not None}) == 1
    check_plan(src, dst, plan)
    assert validate_plan(plan) == []
    for r in plan.ranks:
        part = plan_part(plan, r)
        assert _same_messages(part.messages, [m for m in plan.messages if r in (m.src, m.dst)])
        assert part.local_copies == [c for c in plan.local_copies if c.dst == r]
        assert validate_plan(part, r) == []
    loaded = Plan.from_json(json.loads(plan.dumps()))
    assert loaded.hash == plan.hash and _same_messages(loaded.messages, plan.messages)
    src2 = Layout.from_json(json.loads(json.dumps(src.to_json())))
    dst2 = Layout.from_json(json.loads(json.dumps(dst.to_json())))
    assert make_plan(src2, dst2, budget_bytes=budget, templates="always").hash == plan.hash


def test_every_plan_kind_offers_the_plan_interface():
    """A templated plan, its JSON round trip, one rank's part and the copy-by-copy plan all offer
    what validate_plan and the executor read (CopyPlan); the part carries the whole plan's hash."""
    from mcore_reshard.core.mesh import Mesh
    from mcore_reshard.core.planner import CopyPlan, StoredPlan
    src, dst = Layout(), Layout()
    for n in range(4):
        src.add_sharded(f"model.layers.{n}.a", (64, 32), "float32", Mesh.of({"tp": 2}, 0), [("tp", 0)])
        dst.add_sharded(f"model.layers.{n}.a", (64, 32), "float32", Mesh.of({"dp": 2}, 2))
    plan = make_plan(src, dst, budget_bytes=4096, templates="always")
    classic = make_plan(src, dst, budget_bytes=4096, templates=False)
    part = plan_part(plan, 2)
    loaded = Plan.from_json(json.loads(plan.dumps()))
    assert isinstance(plan, TemplatedPlan) and isinstance(loaded, TemplatedPlan)
    for p in (plan, loaded, part, classic):
        assert isinstance(p, CopyPlan) and isinstance(p, StoredPlan)
    assert part.whole is plan and part.hash == plan.hash == loaded.hash
    assert classic.whole is None
    assert part.messages and all(2 in (m.src, m.dst) for m in part.messages)
