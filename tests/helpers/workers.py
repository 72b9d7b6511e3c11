"""Functions run inside spawned gloo processes by the multi-process tests (must be importable)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_reshard.core.executor import Resharder, ReshardError
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools.demo import build_layouts, demo_worker
from mcore_reshard.tools.synthetic import materialize, reference_tensor


def scenarios(rank: int, world: int, cases: list) -> list:
    """Run several demo scenarios in one launch; each case is (src, dst, colocated, kwargs)."""
    out = []
    for src, dst, colocated, kw in cases:
        res = demo_worker(rank, world, src, dst, colocated, **kw)
        src_l, dst_l = build_layouts(src, dst, colocated, kw.get("scale", 1), kw.get("src_dtype", "float32"), kw.get("dst_dtype"))
        plan = make_plan(src_l, dst_l, budget_bytes=kw.get("budget", 256 << 20),
                         allow_cast=kw.get("dst_dtype") not in (None, kw.get("src_dtype", "float32")))
        res["expected_messages"] = sum(1 for m in plan.messages if m.src == rank)
        res["expected_bytes"] = sum(m.nbytes for m in plan.messages if m.src == rank)
        res["budget"] = plan.budget_bytes
        per_round: dict[int, int] = {}
        for m in plan.messages:
            if rank in (m.src, m.dst):
                per_round[m.round] = per_round.get(m.round, 0) + m.nbytes
        res["expected_staging"] = max(per_round.values(), default=0)
        out.append(res)
        dist.barrier()
    return out


def refusals(rank: int, world: int) -> list:
    """Each case must make every rank raise ReshardError (no hang, nothing moved)."""
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    results = []

    def attempt(plan, S, D):
        before = {n: t.clone() for n, t in D.items()}
        try:
            Resharder(plan, S, D).refit()
            results.append("no error")
        except ReshardError as e:
            untouched = all(torch.equal(before[n], D[n]) for n in D)
            results.append(("ReshardError", str(e), untouched))

    good = make_plan(src, dst)
    # 1. ranks computed different plans (rank 1 used another staging budget)
    plan = make_plan(src, dst, budget_bytes=4096) if rank == 1 else good
    attempt(plan, materialize(src, rank, full), materialize(dst, rank, full, fill=7.0))
    # 2. one rank's destination tensor has the wrong shape
    D = materialize(dst, rank, full, fill=7.0)
    if rank == 0:
        D["model.norm.weight"] = torch.zeros(3)
    attempt(good, materialize(src, rank, full), D)
    # 3. destination dtype differs from the plan's (no cast was planned)
    attempt(good, materialize(src, rank, full), materialize(dst, rank, full, fill=7.0, dtype=torch.bfloat16))
    return results


def overlap_paths(rank: int, world: int, cases: list) -> list:
    """Each case (src, dst, colocated, budget) refit twice per path: the overlapped gloo path
    (default) with ``_DIRECT_MIN`` lowered so that small synthetic entries take every kind of part
    (direct from / into a contiguous view, staged alone, grouped), the batched path
    (``overlap=False``) and the overlapped path with ``verify``; bit-exact, storage unchanged,
    staging unchanged.  Returns facts per case and path."""
    import mcore_reshard.core.executor.common as ex_common
    ex_common._DIRECT_MIN = 64
    out = []
    for src_spec, dst_spec, colocated, budget in cases:
        src, dst = build_layouts(src_spec, dst_spec, colocated)
        plan = make_plan(src, dst, budget_bytes=budget)
        res = {}
        for name, kw in (("overlapped", {}), ("batched", {"overlap": False}), ("overlapped_verify", {"verify": True})):
            S = materialize(src, rank, {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()})
            D = materialize(dst, rank, {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}, fill=float("nan"))
            ptrs = {n: t.data_ptr() for n, t in D.items()}
            r = Resharder(plan, S, D, timeout=60, **kw)
            bad = 0
            for step in (1, 2):
                full = {n: reference_tensor(n, m.shape, step=step) for n, m in src.tensors.items()}
                fresh = materialize(src, rank, full)
                for n, t in S.items():
                    t.copy_(fresh[n])
                r.refit()
                want = materialize(dst, rank, full)
                bad += sum(0 if torch.equal(want[n], D[n]) else 1 for n in D)
            parts = [pp for rnd in r.rounds for side in (rnd.sends, rnd.recvs) for *_, pl in side for _, pp in pl]
            res[name] = {"overlapped": r.overlapped(), "mismatched": bad,
                         "same_storage": all(D[n].data_ptr() == p for n, p in ptrs.items()),
                         "staging": r.staging_bytes, "state_version": r.state()["version"],
                         "direct": sum(1 for pp in parts if not pp), "alone": sum(1 for pp in parts if len(pp) == 1),
                         "grouped": sum(1 for pp in parts if len(pp) > 1)}
            dist.barrier()
        out.append(res)
    return out


def templated_parts(rank: int, world: int) -> dict:
    """A colocated pipeline (tests/core/planner/test_planner_templates._colocated_stages: 2 stages on 4 ranks,
    one template rotated across them) refit twice through a Resharder: bit-exact, and the whole
    plan's messages, copies and buffers are never made on this rank (it binds its own part)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "planner"))   # a test module, not a helper
    from test_planner_templates import _colocated_stages

    from mcore_reshard.core.planner import TemplatedPlan, plan_part
    src, dst = _colocated_stages(stages=world // 2)
    plan = make_plan(src, dst, budget_bytes=1024, templates="always")
    assert isinstance(plan, TemplatedPlan)
    out = {"templates": plan.stats["templates"], "rotated": any(list(r) != sorted(r) for _, _, r in plan.instances)}
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    S, D = materialize(src, rank, full), materialize(dst, rank, full, fill=7.0)
    r = Resharder(plan, S, D)
    sent = [r.refit()["messages_sent"] for _ in range(2)]
    expect = materialize(dst, rank, full)
    out["exact"] = all(torch.equal(D[n], expect[n]) for n in expect)
    out["whole_made"] = sorted(k for k in ("messages", "local", "padding", "buffers") if k in plan._cache)
    part = plan_part(plan, rank)
    out["sent"] = sent
    out["expected_sent"] = sum(1 for m in part.messages if m.src == rank)
    out["rounds_bound"] = len(r.rounds)
    out["expected_rounds"] = len({m.round for m in part.messages})
    return out


def refusal_in_refit_start(rank: int, world: int) -> dict:
    """Rank 1 brings a refusal to its second refit (an integration's own check failed): every rank
    raises ReshardError in the refit start, nothing moves, and the next refit works."""
    src, dst = build_layouts("tp=2", "tp=1,dp=2", True)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    S, D = materialize(src, rank, full), materialize(dst, rank, full, fill=7.0)
    r = Resharder(make_plan(src, dst), S, D)
    r.refit(1)
    for t in S.values():
        t.add_(1.0)
    before = {n: t.clone() for n, t in D.items()}
    out = {"rank": rank}
    try:
        r.refit(2, refusal=["model.norm.weight: replaced after binding"] if rank == 1 else None)
        out["error"] = None
    except ReshardError as e:
        out["error"] = str(e)
    out["untouched"] = all(torch.equal(before[n], D[n]) for n in D)
    out["state_version"] = r.state()["version"]
    r.refit(3)
    out["after"] = all(torch.equal(D[n], materialize(dst, rank, {k: v + 1.0 for k, v in full.items()})[n]) for n in D)
    return out
