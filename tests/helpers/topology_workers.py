"""Two-level plans live: functions run inside spawned gloo processes (4 ranks, two "NVLink domains"
of 2: ranks 0-1 and 2-3) by ``test_topology_live.py``.  Failures are injected from outside only
(a wrapped ``dist.batch_isend_irecv``, as in ``reliability_workers``)."""
from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from reliability_workers import _exact, _full, _load_step, _stamp, patched_p2p

from mcore_reshard.core.executor import Resharder, ReshardError, digest_of
from mcore_reshard.core.planner import Topology, make_plan
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize

DOMAINS = (0, 0, 1, 1)


def nic_bytes(plan, topo: Topology) -> int:
    return sum(c.nbytes for m in plan.messages if topo.domain(m.src) != topo.domain(m.dst) for c in m.entries)


def megatron_two_level(rank: int, world: int, cases: list) -> list:
    """Each case a ``megatron_refit_worker`` case, refit with ``topology=Topology(domains=DOMAINS)``;
    also reports what the plan gives this rank (messages, staged bytes) and the flat plan's NIC bytes."""
    import megatron_refit_worker as W

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    mcore_cpu.install_cpu_shims()
    topo = Topology(domains=DOMAINS)
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for case in cases:
        dtype = getattr(torch, case.get("dtype", "float32"))
        src = W._build(case["model"], case["src"], dtype, case.get("kw", {}))
        W.perturb_replicated(src)
        src_logits = mcore_cpu.forward_logits(src, tokens)
        src_ref = W.reference_digests(src)
        dst = W._build(case["model"], case["dst"], dtype, case.get("kw", {}))
        ptrs = {n: p.data_ptr() for c in dst for n, p in c.named_parameters()}
        refit = MegatronRefit(src, dst, topology=topo, budget_bytes=case.get("budget", 256 << 20), timeout=60)
        plan = refit.plan
        sent = refit.refit()
        again = refit.refit()      # a second refit lands the same bytes again (forwarders re-read their destination)
        dst_logits = mcore_cpu.forward_logits(dst, tokens)
        flat = make_plan(refit.src_layout, refit.dst_layout, budget_bytes=plan.budget_bytes, templates=False)
        mine = [m for m in plan.messages if m.src == rank]
        stats = plan.stats
        out.append({
            "src": src_ref, "dst": W.reference_digests(dst),
            "logits_max_diff": float((src_logits - dst_logits).abs().max()), "logits_scale": float(src_logits.abs().max()),
            "same_storage": all(p.data_ptr() == ptrs[n] for c in dst for n, p in c.named_parameters()),
            "network_bytes": stats["network_bytes"], "lower_bound_bytes": stats["lower_bound_bytes"],
            "messages_sent": sent["messages_sent"], "plan_messages_from_me": len(mine),
            "bytes_sent": sent["staged_bytes_sent"], "plan_bytes_from_me": sum(m.nbytes for m in mine if not m.unstaged),
            "unstaged_sent": sent["unstaged_bytes_sent"],
            "plan_unstaged_from_me": sum(c.nbytes for m in mine if m.unstaged for c in m.entries),
            "forwards_from_me": sum(1 for m in mine if m.forward), "second_messages": again["messages_sent"],
            "nic_bytes": stats["nic_bytes"], "bound": stats["hierarchical_bound_bytes"],
            "forwarded_bytes": stats["forwarded_bytes"], "plan_nic_bytes": nic_bytes(plan, topo),
            "flat_nic_bytes": nic_bytes(flat, topo), "flat_network_bytes": flat.stats["network_bytes"],
            "hash": plan.hash,
        })
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return out


def _setup(rank: int, budget: int):
    """Synthetic model tp=2 on ranks 0-1 (domain 0) -> tp=1, dp=2 on ranks 2-3 (domain 1): both
    receivers need every tensor from outside their domain."""
    src, dst = build_layouts("tp=2", "tp=1,dp=2", False)
    plan = make_plan(src, dst, budget_bytes=budget, topology=Topology(domains=DOMAINS))
    full = _full(src)
    return src, dst, plan, materialize(src, rank, full), materialize(dst, rank, full, fill=float("nan"))


def forwarder_failure(rank: int, world: int, mode: str, victim: int, timeout: float, stamp: str) -> dict:
    """One refit succeeds; in the next, ``victim`` (a forwarder) dies (``os._exit``) or stalls for
    3 x timeout just before the first round in which it forwards.  Reports what every rank raised."""
    src, dst, plan, S, D = _setup(rank, 4096)
    r = Resharder(plan, S, D, timeout=timeout)
    first = r.refit()
    ok_first = not _exact(dst, rank, _full(src), D)
    full = _load_step(src, rank, S, 1)
    src_before = digest_of(S)
    fwd_rounds = sorted({m.round for m in plan.messages if m.forward and m.src == victim})
    at_call = r.round_numbers.index(fwd_rounds[0]) + 1     # this rank's rounds, 1-based: one post per round

    def hook(call, ops, post):
        if rank == victim and call == at_call:
            if mode == "die":
                _stamp(stamp, "died")
                os._exit(17)
            _stamp(stamp, "stalled")
            time.sleep(3 * timeout)
        return post(ops)

    info = {"rank": rank, "first_ok": ok_first, "first_version": first["version"], "forward_round": fwd_rounds[0],
            "forwards_to_me": sorted({m.round for m in plan.messages if m.forward and m.dst == rank and m.src == victim}),
            "received_before": any(m.dst == victim and m.round < fwd_rounds[0] for m in plan.messages)}
    dist.barrier()
    with patched_p2p(hook):
        try:
            r.refit()
            info.update(error=None, type=None)
        except ReshardError as e:
            info.update(error=str(e), type=type(e).__name__, round=getattr(e, "round", None),
                        peers=getattr(e, "peers", None))
    info["raised_at"] = time.time()
    info["state"] = r.state()
    info["src_untouched"] = digest_of(S) == src_before
    info["exact_buffers"] = [n for n in D if n not in _exact(dst, rank, full, D)]
    return info


def synthetic_two_level(rank: int, world: int, budget: int) -> dict:
    """The synthetic case refit twice (overlapped gloo path, then batched): bit-exact, counts vs plan."""
    src, dst, plan, S, D = _setup(rank, budget)
    out = {"hash": plan.hash}
    for name, kw in (("overlapped", {}), ("batched", {"overlap": False}), ("verify", {"verify": True})):
        r = Resharder(plan, S, D, timeout=60, **kw)
        full = _load_step(src, rank, S, len(out))
        for t in D.values():
            t.fill_(float("nan"))
        res = r.refit()
        mine = [m for m in plan.messages if m.src == rank]
        # the staging buffer, from the plan: per round, what this rank's staged messages send plus
        # receive (+ a 16-byte checksum per entry of every message with verify, unstaged ones too)
        per_round: dict = {}
        for m in plan.messages:
            if rank in (m.src, m.dst):
                per_round[m.round] = per_round.get(m.round, 0) + (0 if m.unstaged else m.nbytes) + (
                    16 * len(m.entries) if kw.get("verify") else 0)
        out[name] = {"mismatched": _exact(dst, rank, full, D), "messages": res["messages_sent"],
                     "plan_messages": len(mine), "bytes": res["staged_bytes_sent"],
                     "plan_bytes": sum(m.nbytes + (16 * len(m.entries) if kw.get("verify") else 0) for m in mine
                                       if not m.unstaged) + (sum(16 * len(m.entries) for m in mine if m.unstaged)
                                                             if kw.get("verify") else 0),
                     "unstaged": res["unstaged_bytes_sent"],
                     "plan_unstaged": sum(c.nbytes for m in mine if m.unstaged for c in m.entries),
                     "staging": r.staging_bytes, "plan_staging": max(per_round.values(), default=0)}
        dist.barrier()
    out["unstaged_messages"] = sum(1 for m in plan.messages if m.unstaged)
    out["unstaged_forwards"] = sum(1 for m in plan.messages if m.unstaged and m.forward)
    out["staged_forwards"] = sum(1 for m in plan.messages if m.forward and not m.unstaged)
    out["stats"] = {k: plan.stats[k] for k in ("nic_bytes", "hierarchical_bound_bytes", "forwarded_bytes",
                                               "network_bytes", "rounds")}
    out["flat_nic_bytes"] = nic_bytes(make_plan(src, dst, budget_bytes=budget, templates=False), Topology(domains=DOMAINS))
    return out
