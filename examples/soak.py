"""Soak test: many consecutive refits of changing weights on local gloo processes.

Every step writes new source weights in place (integer-valued, so every comparison is exact),
refits, and checks every destination element bit for bit, the recorded versions, and that the
refit left the source untouched; resident memory (VmRSS from /proc/self/status) is sampled after
every refit and must stay flat.

    python examples/soak.py                         # 100 refits, tp=2,pp=2 -> tp=4 colocated, 4 ranks
    python examples/soak.py --steps 500 --verify --src tp=2,ep=2,etp=1,pp=2 --dst tp=4 --disaggregated

Prints one JSON line per rank and a summary; exits 1 on any mismatch or RSS growth above
``--max-rss-growth-kb`` (after ``--warmup`` refits).  ``tests/core/executor/test_soak.py`` runs a short version.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mcore_reshard.core.executor import Resharder, digest_of  # noqa: E402
from mcore_reshard.core.planner import make_plan  # noqa: E402
from mcore_reshard.tools.demo import build_layouts, world_needed  # noqa: E402
from mcore_reshard.tools.launch import spawn  # noqa: E402
from mcore_reshard.tools.synthetic import materialize  # noqa: E402
from mcore_reshard.util.memstat import status_kb  # noqa: E402


def _median_growth(samples: list) -> int:
    k = max(1, len(samples) // 3)
    first, last = sorted(samples[:k]), sorted(samples[-k:])
    return last[k // 2] - first[k // 2]


def soak_worker(rank: int, world: int, src_spec: str, dst_spec: str, colocated: bool, steps: int, budget: int,
                verify: bool, warmup: int, timeout: float) -> dict:
    torch.set_num_threads(1)
    src, dst = build_layouts(src_spec, dst_spec, colocated)
    plan = make_plan(src, dst, budget_bytes=budget)
    g = torch.Generator().manual_seed(1234)
    base = {n: torch.randint(-1000, 1000, m.shape, generator=g).float() for n, m in sorted(src.tensors.items())}
    ones = {n: torch.ones(m.shape) for n, m in src.tensors.items()}
    S0 = materialize(src, rank, base)
    S = {n: t.clone() for n, t in S0.items()}
    D0 = materialize(dst, rank, base)              # step 0 values, padding 0
    mask = materialize(dst, rank, ones)            # 1 where a piece lands, 0 on padding
    del ones
    D = {n: torch.full_like(t, float("nan")) for n, t in D0.items()}
    scratch = {n: torch.empty_like(t) for n, t in D0.items()}
    ptrs = {n: t.data_ptr() for n, t in D.items()}
    r = Resharder(plan, S, D, timeout=timeout, verify=verify)
    rss, times, bad_steps, bad_versions, src_changed = [], [], [], [], 0
    for step in range(1, steps + 1):
        for n, t in S.items():
            t.copy_(S0[n]).add_(step)              # "a training step": new weights, same storage
        check_src = step % 10 == 1
        before = digest_of(S) if check_src else None
        t0 = time.perf_counter()
        r.refit(version=step)
        times.append(time.perf_counter() - t0)
        if check_src and digest_of(S) != before:
            src_changed += 1
        wrong = 0
        for n, d in D.items():
            torch.sub(d, D0[n], out=scratch[n])
            scratch[n].sub_(mask[n], alpha=step)   # exactly zero everywhere iff D == D0 + step on pieces, 0 on padding
            if scratch[n].count_nonzero().item() or torch.isnan(d).any().item():
                wrong += 1
        if wrong:
            bad_steps.append([step, wrong])
        st = r.state()
        if st["version"] != step or st["interrupted"] or any(v != step for v in st["buffers"].values()):
            bad_versions.append(step)
        rss.append(status_kb("VmRSS"))
    w = min(warmup, steps - 1)
    return {"rank": rank, "steps": steps, "dst_buffers": len(D), "mismatched_steps": bad_steps,
            "bad_versions": bad_versions, "src_changed": src_changed,
            "same_storage": all(D[n].data_ptr() == p for n, p in ptrs.items()),
            "rss_first_kb": rss[0], "rss_warm_kb": rss[w], "rss_end_kb": rss[-1], "rss_max_kb": max(rss[w:]),
            "rss_growth_kb": rss[-1] - rss[w],
            # median of the last third after warm-up minus that of the first third: single samples
            # jitter by ~0.5 MB (transient buffers), a leak shifts the medians
            "rss_growth_median_kb": _median_growth(rss[w:]),
            "refit_ms_median": 1000 * sorted(times)[len(times) // 2],
            "refit_ms_max": 1000 * max(times), "rounds": plan.rounds, "messages": len(plan.messages)}


def run(steps: int = 100, src: str = "tp=2,pp=2", dst: str = "tp=4", colocated: bool = True, budget: int = 16384,
        verify: bool = False, warmup: int = 10, timeout: float = 30.0) -> list[dict]:
    world = world_needed(src, dst, colocated)
    return spawn(soak_worker, world, src, dst, colocated, steps, budget, verify, warmup, timeout,
                 timeout=max(300.0, 3.0 * steps), pg_timeout=120.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--src", default="tp=2,pp=2")
    ap.add_argument("--dst", default="tp=4")
    ap.add_argument("--disaggregated", action="store_true")
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--max-rss-growth-kb", type=int, default=1024)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    results = run(a.steps, a.src, a.dst, not a.disaggregated, a.budget, a.verify, a.warmup, a.timeout)
    ok = True
    for res in results:
        print(json.dumps(res))
        ok &= not res["mismatched_steps"] and not res["bad_versions"] and not res["src_changed"] and res["same_storage"]
        ok &= res["rss_growth_kb"] <= a.max_rss_growth_kb
    growth = max(r["rss_growth_kb"] for r in results)
    print(f"{a.steps} refits x {len(results)} ranks ({a.src} -> {a.dst}, {'disaggregated' if a.disaggregated else 'colocated'}, "
          f"budget {a.budget} B, {results[0]['rounds']} rounds, verify={a.verify}): "
          f"{'all bit-exact' if ok else 'FAILED'}; RSS after warm-up {min(r['rss_warm_kb'] for r in results)}-"
          f"{max(r['rss_warm_kb'] for r in results)} kB, at the end {min(r['rss_end_kb'] for r in results)}-"
          f"{max(r['rss_end_kb'] for r in results)} kB, max growth {growth} kB; "
          f"median refit {max(r['refit_ms_median'] for r in results):.1f} ms; {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
