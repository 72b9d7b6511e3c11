"""What cutting a refit into windows costs: a windowed refit against one plan over the same tensors.

Four gloo processes (ranks 0-1 send a synthetic model at ``tp=2``, ranks 2-3 receive it at
``tp=1,dp=2``), the same staging budget; each window size refit interleaved with the one-plan refit
in the same processes, median over ``--reps``.  A window adds one control all-gather (its refit
start; one final exchange per refit); the bytes and the rounds' payload are the same.

    .venv/bin/python benchmarks/windowed_overhead.py [--scale 8] [--budget-kib 1024] [--reps 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

WINDOWS_KIB = (1 << 20, 4096, 1024, 256)        # 1 GiB: a single window


def work(rank: int, world: int, scale: int, budget: int, reps: int) -> dict:
    from mcore_reshard.core.executor import Resharder, WindowedResharder
    from mcore_reshard.core.planner import make_plan, make_windowed_plan
    from mcore_reshard.tools.demo import build_layouts
    from mcore_reshard.tools.synthetic import materialize, reference_tensor
    src, dst = build_layouts("tp=2", "tp=1,dp=2", False, scale=scale)
    full = {n: reference_tensor(n, m.shape) for n, m in src.tensors.items()}
    S = materialize(src, rank, full)
    D = materialize(dst, rank, full, fill=0.0)
    one = Resharder(make_plan(src, dst, budget_bytes=budget), S, D, timeout=300)
    windowed = {w: WindowedResharder(make_windowed_plan(src, dst, window_bytes=w << 10, budget_bytes=budget), S, D,
                                     timeout=300) for w in WINDOWS_KIB}
    times: dict = {"one": []}
    for _ in range(reps):
        for w, r in windowed.items():
            t0 = time.perf_counter()
            r.refit()
            times.setdefault(w, []).append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        one.refit()
        times["one"].append(time.perf_counter() - t0)
    return {"bytes": sum(t.numel() * t.element_size() for t in D.values()),
            "windows": {w: len(r.windows) for w, r in windowed.items()}, "rounds_one": one.plan.rounds,
            "rounds": {w: r.plan.rounds for w, r in windowed.items()},
            "median": {str(k): statistics.median(v) for k, v in times.items()}}


def main() -> None:
    from mcore_reshard.tools.launch import spawn
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--budget-kib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    res = spawn(work, 4, a.scale, a.budget_kib << 10, a.reps, timeout=3600)
    slowest = {k: max(r["median"][k] for r in res) for k in res[0]["median"]}
    recv = max(r["bytes"] for r in res)
    print(f"receiver bytes {recv:,}, staging budget {a.budget_kib} KiB, one plan: {res[0]['rounds_one']} rounds")
    print("| window | windows | rounds | control all-gathers per refit | time / one plan |")
    print("|---|---|---|---|---|")
    for w in WINDOWS_KIB:
        n = res[0]["windows"][str(w)] if str(w) in res[0]["windows"] else res[0]["windows"][w]
        rounds = res[0]["rounds"][str(w)] if str(w) in res[0]["rounds"] else res[0]["rounds"][w]
        print(f"| {w} KiB | {n} | {rounds} | {n + 1} (one plan: 2) | {slowest[str(w)] / slowest['one']:.2f} |")


if __name__ == "__main__":
    main()
