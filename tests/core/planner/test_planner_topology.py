"""Two-level (NVLink domain / NIC) plans: hypothesis properties over random layouts and domain maps,
the flat plan unchanged without a topology, and mutated forwarding refused."""
from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim import apply_plan, random_full, write_counts
from test_planner_properties import side, tensor_specs

from mcore_reshard.core.layout import Layout, itemsize
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.core.planner import ALIGN, Message, Plan, PlanError, Topology, make_plan, plan_part, validate_plan
from mcore_reshard.tools.synthetic import materialize


def hierarchical_bound(src: Layout, dst: Layout, domain) -> int:
    """Per domain, the elements its receivers need that no rank of the domain holds, counted once
    (numpy masks, element by element; shares no code with the planner)."""
    held = {}
    for r, _, p in src.iter_pieces():
        key = (domain(r), p.tensor)
        if key not in held:
            held[key] = np.zeros(src.tensors[p.tensor].shape, dtype=bool)
        held[key][p.box.slices()] = True
    need = {}
    for r, _, p in dst.iter_pieces():
        key = (domain(r), p.tensor)
        if key not in need:
            need[key] = np.zeros(src.tensors[p.tensor].shape, dtype=bool)
        need[key][p.box.slices()] = True
    total = 0
    for key, mask in need.items():
        h = held.get(key)
        n = int((mask & ~h).sum()) if h is not None else int(mask.sum())
        total += n * itemsize(src.tensors[key[1]].dtype)
    return total


@st.composite
def topo_cases(draw):
    specs = draw(tensor_specs())
    fused = draw(st.none() | st.tuples(st.integers(1, 7), st.integers(1, 7), st.integers(1, 4)))
    src = draw(side(specs, fused, 0, "s"))
    placement = draw(st.sampled_from(["colocated", "disaggregated", "overlap"]))
    offset = {"colocated": 0, "disaggregated": max(src.ranks) + 1, "overlap": (max(src.ranks) + 1) // 2}[placement]
    dst = draw(side(specs, fused, offset, "d"))
    if draw(st.booleans()):      # a second, replicated destination copy: several receivers per box
        extra = draw(side(specs, None, max(dst.ranks) + 1, "d2"))
        for r, bufs in extra.buffers.items():
            for b in bufs.values():
                dst.add_buffer(r, b)
    world = max(src.ranks + dst.ranks) + 1
    if draw(st.booleans()):
        topo = Topology(domain_size=draw(st.integers(1, 4)))
    else:
        topo = Topology(domains=tuple(draw(st.lists(st.integers(0, 2), min_size=world, max_size=world))))
    budget = draw(st.sampled_from([1024, 4096, 1 << 20]))
    return src, dst, topo, budget


def nic_bytes(plan, topo) -> int:
    return sum(c.nbytes for m in plan.messages if topo.domain(m.src) != topo.domain(m.dst) for c in m.entries)


def _contiguous(plan, side: str, rank: int, buffer: str, local) -> bool:
    shape = plan.buffers[side][rank][buffer][0]
    return torch.empty(shape, dtype=torch.uint8)[local.slices()].is_contiguous()


def check_two_level(src: Layout, dst: Layout, topo: Topology, plan: Plan) -> None:
    full = random_full(src)
    S = {r: materialize(src, r, full) for r in src.ranks}
    D = {r: materialize(dst, r, full, fill=float("nan")) for r in dst.ranks}
    expect = {r: materialize(dst, r, full) for r in dst.ranks}
    apply_plan(plan, S, D)
    for r in dst.ranks:
        for n in expect[r]:
            assert torch.equal(D[r][n], expect[r][n]), (r, n)
    for r, bufs in write_counts(plan, dst).items():
        for n, cnt in bufs.items():
            assert (cnt == 1).all(), f"rank {r} buffer {n}: elements written {sorted(set(cnt.flatten().tolist()))} times"
    bound = hierarchical_bound(src, dst, topo.domain)
    assert nic_bytes(plan, topo) == bound == plan.stats["nic_bytes"] == plan.stats["hierarchical_bound_bytes"]
    # each receiver still receives exactly what it needs once: total network bytes unchanged
    assert plan.stats["network_bytes"] == plan.stats["lower_bound_bytes"]
    stage = defaultdict(int)
    for m in plan.messages:
        assert m.src != m.dst
        assert m.nbytes == sum((c.nbytes + ALIGN - 1) // ALIGN * ALIGN for c in m.entries)
        if not m.unstaged:          # an unstaged message takes no staging
            stage[(m.round, m.src)] += m.nbytes
            stage[(m.round, m.dst)] += m.nbytes
        if m.forward:       # forwarded only inside a domain
            assert topo.domain(m.src) == topo.domain(m.dst)
        # unstaged exactly where every entry is contiguous on both ends (torch decides, not the
        # planner's rule), inside one domain, not cast; NIC copies always staged
        meta = [plan.tensors[c.tensor] for c in m.entries]
        same = topo.domain(m.src) == topo.domain(m.dst) and all(t["src_dtype"] == t["dst_dtype"] for t in meta)
        flat = [_contiguous(plan, "dst" if m.forward else "src", c.src, c.src_buffer, c.src_local)
                and _contiguous(plan, "dst", c.dst, c.dst_buffer, c.dst_local) for c in m.entries]
        if m.unstaged:
            assert same and all(flat), m
        elif same:
            assert not any(flat), m
    assert max(list(stage.values()) + [0]) <= plan.budget_bytes
    assert max(list(stage.values()) + [0]) == plan.stats["max_stage_bytes"]
    assert validate_plan(plan) == []
    for r in plan.ranks:
        assert validate_plan(plan_part(plan, r), r) == []


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topo_cases())
def test_two_level_plans_are_exact_and_meet_the_hierarchical_bound(case):
    src, dst, topo, budget = case
    plan = make_plan(src, dst, budget_bytes=budget, topology=topo)
    check_two_level(src, dst, topo, plan)
    flat = make_plan(src, dst, budget_bytes=budget, templates=False)
    assert plan.stats["nic_bytes"] <= nic_bytes(flat, topo)
    # deterministic: the same plan from JSON round-tripped layouts, from its own JSON, and each rank's part
    again = make_plan(Layout.from_json(json.loads(json.dumps(src.to_json()))),
                      Layout.from_json(json.loads(json.dumps(dst.to_json()))), budget_bytes=budget,
                      topology=Topology.of(list(topo.domains) if topo.domains else topo.domain_size))
    assert again.hash == plan.hash
    back = Plan.from_json(json.loads(plan.dumps()))
    assert back.hash == plan.hash and [m.forward for m in back.messages] == [m.forward for m in plan.messages]
    for r in plan.ranks:
        assert plan_part(again, r).dumps() == plan_part(plan, r).dumps()


def _replicated_case():
    """Source tp=2 on ranks 0-1, destination replicated on ranks 2-5 (two domains of 2: 2-3, 4-5)."""
    src, dst = Layout(), Layout()
    src.add_sharded("w", (8, 6), "float32", Mesh.of({"tp": 2}), [("tp", 0)])
    src.add_sharded("b", (6,), "float32", Mesh.of({"tp": 2}), [])
    dst.add_sharded("w", (8, 6), "float32", Mesh.of({"dp": 4}, 2), [])
    dst.add_sharded("b", (6,), "float32", Mesh.of({"dp": 4}, 2), [])
    return src, dst


def test_forwarding_by_hand():
    src, dst = _replicated_case()
    topo = Topology(domains=(0, 0, 1, 1, 2, 2))
    plan = make_plan(src, dst, topology=topo)
    check_two_level(src, dst, topo, plan)
    # w (192 B) + b (24 B) cross into each of the two receiving domains once: 432 B, not 864 B
    assert plan.stats["nic_bytes"] == 2 * (8 * 6 + 6) * 4
    assert nic_bytes(make_plan(src, dst), topo) == 4 * (8 * 6 + 6) * 4
    assert plan.stats["forwarded_bytes"] == plan.stats["nvlink_bytes"] == 2 * (8 * 6 + 6) * 4
    fwd = [m for m in plan.messages if m.forward]
    assert fwd and all(m.round >= 1 for m in fwd)
    assert plan.stats["topology"] == {"domains": [0, 0, 1, 1, 2, 2]}
    # a holder inside the receiver's domain sends over NVLink (colocated: nothing crosses)
    colo = make_plan(src, dst, topology=Topology(domain_size=8))
    assert colo.stats["nic_bytes"] == 0 == colo.stats["forwarded_bytes"]


def test_forward_before_receive_is_refused():
    src, dst = _replicated_case()
    plan = make_plan(src, dst, topology=2, budget_bytes=4096)
    fwd = next(m for m in plan.messages if m.forward)
    bad = Plan.from_json(json.loads(plan.dumps()))
    i = next(i for i, m in enumerate(bad.messages) if m.forward and (m.src, m.dst) == (fwd.src, fwd.dst))
    m = bad.messages[i]
    bad.messages[i] = Message(0, m.src, m.dst, m.nbytes, m.entries, True)
    problems = validate_plan(bad)
    assert any("forwarded copy of" in p and "writes only in round 0" in p and "must come after" in p for p in problems), problems
    assert any("forwarded copy" in p for p in validate_plan(plan_part(bad, m.src), m.src))
    # a forwarded copy reading elements its sender never received
    c = m.entries[0]
    wrong = c._replace(src_local=c.src_local.__class__((0,) * c.src_local.ndim, c.src_local.sizes)
                       if c.src_local.offsets != (0,) * c.src_local.ndim else c.src_local.__class__(
                           (1,) + (0,) * (c.src_local.ndim - 1), c.src_local.sizes))
    bad.messages[i] = Message(fwd.round, m.src, m.dst, m.nbytes, (wrong,) + m.entries[1:], True)
    problems = validate_plan(bad)
    assert any("forwarded copy of" in p for p in problems), problems
    # a forward flag that is not a bool is refused at load
    o = json.loads(plan.dumps())
    next(x for x in o["messages"] if x.get("forward"))["forward"] = 1
    with pytest.raises(PlanError, match="forward=1"):
        Plan.from_json(o)


def test_cast_tensors_are_not_forwarded():
    src, dst = Layout(), Layout()
    src.add_sharded("w", (8, 4), "float32", Mesh.of({"tp": 2}), [("tp", 0)])
    dst.add_sharded("w", (8, 4), "bfloat16", Mesh.of({"dp": 2}, 2), [])
    plan = make_plan(src, dst, topology=2, allow_cast=True)
    assert not any(m.forward for m in plan.messages)
    assert plan.stats["nic_bytes"] == 2 * 8 * 4 * 4 and plan.stats["hierarchical_bound_bytes"] == 8 * 4 * 4


def test_topology_forms_and_errors():
    assert Topology.of(None) is None
    assert Topology.of(4) == Topology(domain_size=4)
    assert Topology.of([0, 0, 1]) == Topology(domains=(0, 0, 1))
    from mcore_reshard.tools.costmodel import dgx_h100
    assert Topology.of(dgx_h100().topology) == Topology(domain_size=8)
    with pytest.raises(PlanError, match="exactly one"):
        Topology()
    with pytest.raises(PlanError, match="positive"):
        Topology(domain_size=0)
    src, dst = _replicated_case()
    with pytest.raises(PlanError, match="rank 4 is not in the rank -> domain list"):
        make_plan(src, dst, topology=[0, 0, 1, 1])


# digests of flat plans computed with the planner before topology existed (commit efd00c0); "layers"
# (a templated plan) re-taken when templated plans began to place messages, not template rounds
# (templated plan format 3)
FLAT_DIGESTS = {
    "replicated": "89d699c9a1cb615f6378817c7304acbcd22e12f2aca1685205572a8d431ae278",
    "layers": "c0052b2e76498726bbfd02171203e4706a61bbe61819a2150dfe4ab895ef77ec",
    "layers_split": "b1e50b6ad36d40bebf4a6bbc317920dddd44e009276c1490c1577ac01a40acd1",
}


def _flat_configs():
    out = {}
    src, dst = _replicated_case()
    out["replicated"] = (src, dst, {})
    s2, d2 = Layout(), Layout()
    for n in range(3):      # layers: the templated plan
        s2.add_sharded(f"decoder.layers.{n}.w", (12, 8), "float32", Mesh.of({"tp": 4}), [("tp", 0)])
        d2.add_sharded(f"decoder.layers.{n}.w", (12, 8), "float32", Mesh.of({"dp": 2, "tp": 2}, 2), [("tp", 1)])
    out["layers"] = (s2, d2, {})
    out["layers_split"] = (s2, d2, {"budget_bytes": 1024, "templates": False})
    return out


@pytest.mark.parametrize("name", ["replicated", "layers", "layers_split"])
def test_flat_plans_unchanged_without_topology(name):
    src, dst, kw = _flat_configs()[name]
    plan = make_plan(src, dst, **kw)
    assert make_plan(src, dst, topology=None, **kw).hash == plan.hash
    assert not any(m.forward for m in plan.messages) and "forward" not in plan.dumps()
    assert plan.hash == FLAT_DIGESTS[name]
    # with a topology: always the copy-by-copy plan (no templates), and a one-domain topology
    # changes nothing but the sender preference (no forwarding: every holder is in the domain)
    two = make_plan(src, dst, topology=64, **kw)
    assert type(two) is Plan and not any(m.forward for m in two.messages) and two.stats["nic_bytes"] == 0
    check_two_level(src, dst, Topology(domain_size=64), two)


def _unstaged_case():
    """w [8, 32] on rank 0 and v [4, 8] column-sharded on ranks 0-1 (domain 0), both replicated on
    ranks 2 and 3 (domain 1); 1 KiB budget."""
    src, dst = Layout(), Layout()
    src.add_sharded("w", (8, 32), "float32", Mesh.of({"tp": 1}), [])
    src.add_sharded("v", (4, 8), "float32", Mesh.of({"tp": 2}), [("tp", 1)])
    dst.add_sharded("w", (8, 32), "float32", Mesh.of({"dp": 2}, 2), [])
    dst.add_sharded("v", (4, 8), "float32", Mesh.of({"dp": 2}, 2), [])
    return src, dst


def test_unstaged_forwards_by_hand():
    """w (1 KiB) crosses to its carrier, rank 2, cut into its 8 rows (a two-level plan cuts copies
    to a quarter of the budget, 256 B minus alignment), half in round 0 and half in round 1: rank 0
    has 1,088 B to send over the NIC and the staged bytes need 2 rounds, so no rank moves more than
    571 B (1.05 x 1,088 / 2) over the NIC per round and direction.  Rank 2 forwards each half in the
    next round straight from its w (rows of a full-width buffer: contiguous) -- unstaged, so that
    512 B takes no staging.  v[:, 4:8] lands on carrier 3 in round 0; v[:, 0:4] (64 B more from rank
    0) fits rank 0's NIC cap only in round 2 (512 + 64 > 571 in rounds 0 and 1): the cap's cost in a
    case this small, a fourth round.  v's forwards (columns: not contiguous) are staged, in rounds
    1 and 3."""
    src, dst = _unstaged_case()
    topo = Topology(domains=(0, 0, 1, 1))
    plan = make_plan(src, dst, budget_bytes=1024, topology=topo)
    check_two_level(src, dst, topo, plan)
    got = [(m.round, m.src, m.dst, m.forward, m.unstaged, m.nbytes, [(c.tensor, str(c.box)) for c in m.entries])
           for m in plan.messages]
    top = [("w", f"[{i}:{i + 1}, 0:32]") for i in range(4)]
    bottom = [("w", f"[{i}:{i + 1}, 0:32]") for i in range(4, 8)]
    assert got == [
        (0, 0, 2, False, False, 512, top),
        (0, 1, 3, False, False, 64, [("v", "[0:4, 4:8]")]),
        (1, 0, 2, False, False, 512, bottom),
        (1, 2, 3, True, True, 512, top),
        (1, 3, 2, True, False, 64, [("v", "[0:4, 4:8]")]),
        (2, 0, 3, False, False, 64, [("v", "[0:4, 0:4]")]),
        (2, 2, 3, True, True, 512, bottom),
        (3, 3, 2, True, False, 64, [("v", "[0:4, 0:4]")]),
    ]
    assert plan.rounds == 4
    s = plan.stats
    assert (s["max_stage_bytes"], s["unstaged_bytes"], s["forwarded_bytes"], s["nic_bytes"]) == (576, 1024, 1152, 1152)
    # staged per (round, rank): the unstaged forwards of rounds 1 and 2 not counted
    from mcore_reshard.core.executor import staging_size
    assert [staging_size(plan, r) for r in range(4)] == [512, 64, 576, 64]
    # verify: 16 B of checksum per entry, staged (an unstaged message's too), in the busiest round
    assert [staging_size(plan, r, verify=True) for r in range(4)] == [512 + 64, 64 + 16, 576 + 80 + 64, 64 + 16 + 64]
    # JSON round trip keeps the flag (and the hash covers it)
    back = Plan.from_json(json.loads(plan.dumps()))
    assert back.hash == plan.hash and [m.unstaged for m in back.messages] == [m.unstaged for m in plan.messages]
    o = json.loads(plan.dumps())
    next(x for x in o["messages"] if x.get("unstaged")).pop("unstaged")
    assert Plan.from_json(o).hash != plan.hash


def test_unstaged_copies_inside_a_domain():
    """One domain: every copy (row shards into full buffers) is contiguous on both ends, so every
    message is unstaged: nothing staged, one round; validation still sound."""
    src, dst = _replicated_case()
    topo = Topology(domain_size=64)
    plan = make_plan(src, dst, budget_bytes=1024, topology=topo)
    check_two_level(src, dst, topo, plan)
    assert plan.messages and all(m.unstaged and not m.forward for m in plan.messages)
    assert plan.stats["max_stage_bytes"] == 0 and plan.rounds == 1
    assert plan.stats["unstaged_bytes"] == plan.stats["network_bytes"] == 4 * (8 * 6 + 6) * 4
    # a column split is not contiguous in the source shard: staged
    s2, d2 = Layout(), Layout()
    s2.add_sharded("w", (8, 6), "float32", Mesh.of({"tp": 2}), [("tp", 1)])
    d2.add_sharded("w", (8, 6), "float32", Mesh.of({"tp": 2}, 2), [("tp", 0)])
    p2 = make_plan(s2, d2, topology=topo)
    check_two_level(s2, d2, topo, p2)
    assert not any(m.unstaged for m in p2.messages) and p2.stats["max_stage_bytes"] > 0


def _tampered_unstaged():
    """The hand case's plan with its staged (non-contiguous) forward of v[:, 4:8] marked unstaged."""
    src, dst = _unstaged_case()
    plan = make_plan(src, dst, budget_bytes=1024, topology=Topology(domains=(0, 0, 1, 1)))
    bad = Plan.from_json(json.loads(plan.dumps()))
    i = next(i for i, m in enumerate(bad.messages) if m.forward and not m.unstaged)
    m = bad.messages[i]
    bad.messages[i] = Message(m.round, m.src, m.dst, m.nbytes, m.entries, True, True)
    return src, dst, bad, m


def test_unstaged_non_contiguous_is_refused():
    src, dst, bad, m = _tampered_unstaged()
    problems = validate_plan(bad)
    assert any("unstaged copy of v[0:4, 4:8]" in p and "not contiguous" in p and f"rank {m.src} buffer v" in p
               and "[4, 8]" in p for p in problems), problems
    for r in (m.src, m.dst):
        assert any("not contiguous" in p for p in validate_plan(plan_part(bad, r), r))
    o = json.loads(bad.dumps())
    next(x for x in o["messages"] if x.get("unstaged"))["unstaged"] = 1
    with pytest.raises(PlanError, match="unstaged=1"):
        Plan.from_json(o)
    # an unstaged message over the budget is fine; a staged one is not: with the budget lowered to
    # 1,000 B, rank 2 stages 512 B in round 1 (w's bottom half) beside its 512 B unstaged forward of
    # w's top half; that forward staged makes 1,024 B
    o = json.loads(bad.dumps())
    o["budget_bytes"] = 1000
    big = Plan.from_json(o)
    assert not any("over the plan's budget" in p for p in validate_plan(big)), validate_plan(big)
    j = next(j for j, x in enumerate(big.messages) if x.unstaged and x.nbytes == 512 and x.round == 1)
    x = big.messages[j]
    big.messages[j] = Message(x.round, x.src, x.dst, x.nbytes, x.entries, True, False)
    assert any("over the plan's budget of 1000 B" in p and "round 1" in p for p in validate_plan(big)), validate_plan(big)
    # no budget bounds an unstaged message, so its byte count must be exactly its entries' layout
    big.messages[j] = Message(x.round, x.src, x.dst, 1 << 40, x.entries, x.forward, True)
    assert any(f"claims {1 << 40} B, its entries end at byte 512" in p for p in validate_plan(big)), validate_plan(big)
    big.messages[j] = x
    assert not any("claims" in p for p in validate_plan(big))


def test_unstaged_views_checked_at_bind():
    """The executor's own checks (per rank, before a byte moves): a tampered unstaged flag is refused
    as an inconsistent plan; a sound unstaged message whose source tensor is not contiguous here
    (a transposed view of the right shape) is refused naming tensor, buffer, rank and shape."""
    from unittest import mock

    from mcore_reshard.core.executor import preflight
    from mcore_reshard.tools.synthetic import materialize
    src, dst, bad, m = _tampered_unstaged()
    full = random_full(src)
    S = {r: materialize(src, r, full) for r in range(4)}
    D = {r: materialize(dst, r, full) for r in range(4)}
    with mock.patch.object(preflight.dist, "get_backend", lambda g=None: "gloo"):
        errs = preflight.check_binding(bad, m.src, 4, None, S[m.src], D[m.src], None)
        assert any("plan is inconsistent" in e and "not contiguous" in e for e in errs), errs
        # one domain: every copy unstaged, the source w on rank 0 read straight from the tensor
        s1, d1 = _replicated_case()
        plan = make_plan(s1, d1, topology=64)
        full = random_full(s1)
        S1 = {r: materialize(s1, r, full) for r in range(6)}
        D1 = {r: materialize(d1, r, full) for r in range(6)}
        assert preflight.check_binding(plan, 0, 6, None, S1[0], D1[0], None) == []
        w = S1[0]["w"]
        S1[0]["w"] = w.t().contiguous().t()        # same shape and values, column-major
        assert not S1[0]["w"].is_contiguous()
        errs = preflight.check_binding(plan, 0, 6, None, S1[0], D1[0], None)
        assert errs and all("unstaged message 0->" in e and "src tensor w [4, 6] float32" in e
                            and "not contiguous" in e and e.startswith("rank 0:") for e in errs), errs


def test_unstaged_verify_catches_a_corrupt_landing():
    """verify: an unstaged entry lands straight in the destination; check_unstaged compares it with
    the sender's checksum after the round: a changed byte is reported and its buffer marked bad."""
    from types import SimpleNamespace

    from mcore_reshard.core.executor import binding, rounds
    from mcore_reshard.core.executor.checksum import checksum
    src, dst = _unstaged_case()
    plan = make_plan(src, dst, budget_bytes=1024, topology=Topology(domains=(0, 0, 1, 1)))
    m = next(x for x in plan.messages if x.unstaged)
    w = torch.arange(8 * 32, dtype=torch.float32).reshape(8, 32)
    views = [w[c.dst_local.slices()] for c in m.entries]
    buf = torch.zeros(16 * len(m.entries), dtype=torch.uint8)
    pairs, parts = binding.unstaged_parts(m, buf, views, verify=True)
    assert [p[0].numel() for p in parts[:-1]] == [c.nbytes for c in m.entries] and parts[-1][0] is buf
    rounds.pack(SimpleNamespace(verify=True), buf, parts[-1][1], m)      # the sender's checksums
    r = SimpleNamespace(verify=True, rounds=[None])
    rnd = binding.Round([], [binding.BoundMessage(m.src, buf, pairs, m, parts)])
    problems, bad_buffers = [], set()
    rounds.check_unstaged(r, 0, rnd, problems, bad_buffers)
    assert problems == [] and bad_buffers == set()
    w[3, 3] += 1                   # a byte of the last entry (row 3) changed after it left
    rounds.check_unstaged(r, 0, rnd, problems, bad_buffers)
    assert len(problems) == 1 and "w[3:4, 0:32] from rank 2 (unstaged" in problems[0] and bad_buffers == {"w"}
    assert torch.equal(parts[-1][1][0][0], checksum(views[0]))


def _pending(neg, src, dst, tensor, offsets, sizes, seq):
    """A PendingCopy with the fields round packing reads (the rest None)."""
    from mcore_reshard.core.planner.records import PendingCopy
    return PendingCopy(neg, src, dst, tensor, offsets, sizes, seq, *[None] * 7)


def test_pack_busiest_first_by_hand():
    """Round 0: pair 0->2 (rank 0 has 1536 B to move, the most) takes its 1 KiB; 0->3 and 1->2 find
    no room; 1->3 does.  Round 1: the rest.  Every rank within the budget in every round."""
    from mcore_reshard.core.planner.topology import pack_busiest_first
    copies = [(-1024, 0, 2, "a", (), (), 0), (-512, 0, 3, "b", (), (), 1), (-512, 1, 3, "c", (), (), 2),
              (-256, 1, 2, "d", (), (), 3)]
    placed, used, rounds = pack_busiest_first([_pending(*c) for c in copies], 1024)
    assert rounds == 2
    assert {k: [c[3] for c in v] for k, v in placed.items()} == {(0, 0, 2): ["a"], (0, 1, 3): ["c"],
                                                               (1, 0, 3): ["b"], (1, 1, 2): ["d"]}
    assert dict(used) == {0: [1024, 512], 2: [1024, 256], 1: [512, 256], 3: [512, 512]}


def test_pack_busiest_first_shares_the_budget_between_directions():
    """Ranks 0 and 1 each send 768 B to the other and receive as much (256 B copies), budget 1 KiB:
    every round gives each rank half its budget to send and half to receive, in proportion to what
    it has left of each, so round 0 carries 512 B each way (a first come, first served round would
    give 0 -> 1 all three copies and 1 -> 0 one).  Then: rank 0 has a 1 KiB copy to send and 256 B to
    receive -- the send does not fit its send share (819 B), nor the receive its receive share (204 B):
    the round takes the first pair's largest copy alone, the next round the rest."""
    from mcore_reshard.core.planner.topology import pack_busiest_first
    copies = [(-256, s, 1 - s, f"{s}{i}", (), (), 3 * s + i) for s in (0, 1) for i in range(3)]
    placed, used, rounds = pack_busiest_first([_pending(*c) for c in copies], 1024)
    assert rounds == 2
    assert {k: [c[3] for c in v] for k, v in placed.items()} == {(0, 0, 1): ["00", "01"], (0, 1, 0): ["10", "11"],
                                                               (1, 0, 1): ["02"], (1, 1, 0): ["12"]}
    assert dict(used) == {0: [1024, 512], 1: [1024, 512]}
    copies = [(-1024, 0, 1, "big", (), (), 0), (-256, 1, 0, "small", (), (), 1)]
    placed, used, rounds = pack_busiest_first([_pending(*c) for c in copies], 1024)
    assert rounds == 2
    assert {k: [c[3] for c in v] for k, v in placed.items()} == {(0, 0, 1): ["big"], (1, 1, 0): ["small"]}
    assert dict(used) == {0: [1024, 256], 1: [1024, 256]}
