"""Tampering with a *templated* plan's JSON, and with a *two-level* plan's (forwarded messages), (the compact form ``make_plan`` returns where layers repeat):
every field of its templates (each one a copy-by-copy plan, tampered as in test_adversarial_plans), of
its instances (template id, layer numbers, rank map), of its round placement and of its header.

The documented outcome, as for copy-by-copy plans: refused before any byte moves (``Plan.from_json``
raises, or the executor's own checks on some rank -- the same error on every rank after the
handshake), or a refit whose destination is bit-exact.  Never success with wrong bytes.  Checked in
process: ``preflight.check_binding`` on every rank decides, an accepted plan is applied by
``plan_mutations.simulate`` (a mirror of the executor) and compared with the reference.
"""
from __future__ import annotations

import copy
import json

import adversarial_workers as aw
import plan_mutations
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_adversarial_plans import _verdict as verdict_of
from test_adversarial_plans import seeded_verdicts

from mcore_reshard.core.layout import Layout
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.core.planner import TemplatedPlan, make_plan

WORLD = 3


def _layered_layouts() -> tuple[Layout, Layout]:
    """4 layers of two tensors, tp=2 on ranks 0-1 -> layers 0-1 whole on rank 2, layers 2-3 re-split
    along dim 1 over ranks 1-2 (two geometries, two instances each), plus one tensor outside the layers."""
    src, dst = Layout(), Layout()
    tp = Mesh.of({"tp": 2})
    shifted = Mesh.of({"tp": 2}, rank_offset=1)
    last = Mesh.of({"tp": 1}, rank_offset=2)
    for n in range(4):
        for name, shape, dt in (("w", (4, 6), "float32"), ("b", (4, 2, 2), "bfloat16")):
            t = f"model.layers.{n}.{name}"
            src.add_sharded(t, shape, dt, tp, [("tp", 0)])
            if n < 2:
                dst.add_sharded(t, shape, dt, last)
            else:
                dst.add_sharded(t, shape, dt, shifted, [("tp", 1)])
    src.add_sharded("lm_head.weight", (8, 4), "float32", tp, [("tp", 0)])
    dst.add_sharded("lm_head.weight", (8, 4), "float32", last)
    return src, dst


SRC, DST = _layered_layouts()
FULL = aw.full_tensors(SRC)
PLANS = {b: make_plan(SRC, DST, budget_bytes=b, templates="always") for b in (1024, 1 << 20)}


def _int(rnd, x):
    return plan_mutations._int(rnd, x)


def mutate_templated(pj: dict, rnd) -> tuple[str, dict]:
    """One field of a templated plan's JSON changed (see the module doc)."""
    q = copy.deepcopy(pj)
    target = rnd.choice(["template", "template", "template", "instance", "instance", "placement", "header", "tensor"])
    if target == "template":
        i = rnd.randrange(len(q["templates"]))
        t = dict(q["templates"][i], stats={})
        label, t2 = plan_mutations.mutate(t, rnd)
        t2.pop("stats", None)
        q["templates"][i] = t2
        return f"templates[{i}]: {label}", q
    if target == "instance":
        i = rnd.randrange(len(q["instances"]))
        inst = q["instances"][i]
        kind = rnd.choice(["tid", "num", "rank", "rank_swap", "swap_nums", "drop", "duplicate"])
        if kind == "tid":
            inst[0] = _int(rnd, inst[0])
        elif kind == "num":
            k = rnd.randrange(len(inst[1]))
            inst[1][k] = _int(rnd, inst[1][k]) if inst[1][k] is not None else 0
        elif kind == "rank" and inst[2]:
            k = rnd.randrange(len(inst[2]))
            inst[2][k] = _int(rnd, inst[2][k])
        elif kind == "rank_swap" and len(inst[2]) > 1:
            a, b = rnd.sample(range(len(inst[2])), 2)
            inst[2][a], inst[2][b] = inst[2][b], inst[2][a]
        elif kind == "swap_nums" and len(q["instances"]) > 1:
            j = (i + 1) % len(q["instances"])
            k = rnd.randrange(3)
            inst[1][k], q["instances"][j][1][k] = q["instances"][j][1][k], inst[1][k]
        elif kind == "drop":
            del q["instances"][i]
        else:
            q["instances"].append(copy.deepcopy(inst))
        return f"instances[{i}].{kind}", q
    if target == "placement" and q["placement"]:
        i = rnd.randrange(len(q["placement"]))
        k = rnd.randrange(len(q["placement"][i]))
        q["placement"][i][k] = _int(rnd, q["placement"][i][k])
        return f"placement[{i}][{k}]", q
    if target == "tensor":
        n = rnd.choice(sorted(q["tensors"]))
        f = rnd.choice(["shape", "src_dtype", "dst_dtype"])
        if f == "shape":
            d = rnd.randrange(len(q["tensors"][n]["shape"]))
            q["tensors"][n]["shape"][d] = _int(rnd, q["tensors"][n]["shape"][d])
        else:
            q["tensors"][n][f] = rnd.choice(plan_mutations.DTYPES)
        return f"tensors[{n}].{f}", q
    f = rnd.choice(["rounds", "budget_bytes"])
    q[f] = _int(rnd, q[f])
    return f"header.{f}", q


def _verdict(pj: dict, src=SRC, dst=DST, full=FULL, world: int = WORLD) -> tuple[str, str]:
    return verdict_of(pj, src, dst, full, world)


@pytest.mark.parametrize("budget", sorted(PLANS))
def test_the_plan_is_templated_and_exact(budget):
    plan = PLANS[budget]
    assert isinstance(plan, TemplatedPlan) and plan.stats["templates"] >= 2 and plan.stats["instances"] >= 5
    assert _verdict(json.loads(plan.dumps())) == ("exact", "")


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(rnd=st.randoms(use_true_random=False), budget=st.sampled_from(sorted(PLANS)))
def test_tampered_templated_plans(rnd, budget):
    pj = json.loads(PLANS[budget].dumps())
    label, q = mutate_templated(pj, rnd)
    verdict, why = _verdict(q)
    event(verdict)      # the verdict counts: pytest --hypothesis-show-statistics
    assert verdict != "WRONG", (label, why)


def test_seeded_templated_tampering_is_mostly_refused():
    """On a fixed batch, more than a third of the mutations are refused (observed: 74 of 100): the
    property above is not vacuous."""
    counts = seeded_verdicts(PLANS, mutate_templated, _verdict, 100, seed=7)
    assert counts["refused"] > 100 // 3 and counts["exact"] >= 1, counts


# ------------------------------------------------------------------ two-level plans (forwarding)

def _two_level_layouts() -> tuple[Layout, Layout]:
    """tp=2 on ranks 0-1 (domain 0) -> every tensor whole on ranks 2 and 3 (domain 1) and re-split on
    ranks 1-2: each box crosses the NIC once and is forwarded inside domain 1."""
    src, dst = Layout(), Layout()
    tp = Mesh.of({"tp": 2})
    both = Mesh.of({"dp": 2}, rank_offset=2)
    for i, (shape, dt) in enumerate((((4, 6), "float32"), ((4, 2, 2), "bfloat16"), ((8,), "int32"))):
        src.add_sharded(f"t{i}", shape, dt, tp, [("tp", 0)])
        dst.add_sharded(f"t{i}", shape, dt, both)
    return src, dst


SRC2, DST2 = _two_level_layouts()
FULL2 = aw.full_tensors(SRC2)
PLANS2 = {b: make_plan(SRC2, DST2, budget_bytes=b, topology=2) for b in (1024, 1 << 20)}


def _verdict2(pj: dict) -> tuple[str, str]:
    return verdict_of(pj, SRC2, DST2, FULL2, 4)


@pytest.mark.parametrize("budget", sorted(PLANS2))
def test_the_two_level_plan_forwards_and_is_exact(budget):
    plan = PLANS2[budget]
    assert any(m.forward for m in plan.messages) and plan.stats["forwarded_bytes"] > 0
    assert plan.stats["nic_bytes"] == plan.stats["hierarchical_bound_bytes"]
    assert _verdict2(json.loads(plan.dumps())) == ("exact", "")


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(rnd=st.randoms(use_true_random=False), budget=st.sampled_from(sorted(PLANS2)))
def test_tampered_two_level_plans(rnd, budget):
    pj = json.loads(PLANS2[budget].dumps())
    label, q = plan_mutations.mutate(pj, rnd)
    verdict, why = _verdict2(q)
    event(verdict)
    assert verdict != "WRONG", (label, why)


def test_seeded_two_level_tampering_is_mostly_refused():
    """As above, for the two-level plans (observed: 90 of 100 refused)."""
    counts = seeded_verdicts(PLANS2, plan_mutations.mutate, _verdict2, 100, seed=7)
    assert counts["refused"] > 100 // 3 and counts["exact"] >= 1, counts

