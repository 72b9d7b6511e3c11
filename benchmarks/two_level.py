"""Two-level (NVLink domain / NIC) plans of the full-size configurations.

    python benchmarks/two_level.py nccl_m2n [--budget-mib 256] [--out benchmarks/results/two_level_nccl_m2n.json]

Plans the configuration twice, copy by copy (``templates=False``: two-level plans always are),
flat (``topology=None``) and two-level (``topology=`` the configuration's cost-model preset: its
``gpus_per_domain``), and reports for each: NIC / NVLink bytes, the hierarchical NIC bound (each
domain receives each needed element once), forwarded bytes, rounds, messages, the cost model's
predicted time and link bound (``costmodel.predict``) and plan time; for the flat plan also what
``costmodel.hierarchical`` predicted forwarding would give.  One configuration per process (a
full-size plan takes GBs): run them one at a time.  ``--quick [--nic-pace X] [--copy-share N]``: the
two-level plan alone, one JSON line.  ``python benchmarks/two_level.py --table
benchmarks/results/two_level_*.json`` prints the BENCHMARKS.md A.3 table.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path


def _numbers(plan, topo, plan_s: float) -> dict:
    from mcore_reshard.core.planner.topology import link_stats
    from mcore_reshard.tools import costmodel
    p = costmodel.predict(plan, topo)
    serial = costmodel.paced(plan, topo, pipelined=False)      # every copy after the wire
    links = link_stats(plan.messages, topo.topology)
    return {"plan_s": plan_s, "rounds": plan.rounds, "messages": len(plan.messages),
            "copies": sum(len(m.entries) for m in plan.messages) + len(plan.local_copies),
            "network_bytes": plan.stats["network_bytes"], **links,
            "max_nic_in": p["max_nic_in"], "max_nic_out": p["max_nic_out"],
            "max_nvlink_in": p["max_nvlink_in"], "max_nvlink_out": p["max_nvlink_out"],
            "max_stage_bytes": plan.stats["max_stage_bytes"],
            "predicted_s": p["seconds"], "paced_s": p["paced_s"], "link_bound_s": p["link_bound_s"],
            "paced_over_link_bound": p["paced_s"] / p["link_bound_s"] if p["link_bound_s"] else None,
            "paced_serial_s": serial,
            "paced_serial_over_link_bound": serial / p["link_bound_s"] if p["link_bound_s"] else None,
            "predicted_over_link_bound": p["seconds"] / p["link_bound_s"] if p["link_bound_s"] else None}


def quick(name: str, budget: int, nic_pace: float | None = None, copy_share: int | None = None) -> dict:
    """The two-level plan alone (no flat plan), optionally with other pacing constants
    (``topology.NIC_PACE``, ``COPY_SHARE``: experiments): paced / link bound, rounds, messages, hash."""
    import mcore_reshard.core.planner as planner
    import mcore_reshard.core.planner.topology as topology
    from mcore_reshard.tools import costmodel
    from mcore_reshard.tools.bench.configs import CONFIGS
    if nic_pace is not None:
        topology.NIC_PACE = nic_pace
    if copy_share is not None:
        planner.COPY_SHARE = topology.COPY_SHARE = copy_share
    conf = CONFIGS[name]
    topo = costmodel.preset(conf.topology)
    src, dst = conf.build()
    t0 = time.perf_counter()
    plan = planner.make_plan(src, dst, budget_bytes=budget, ignore_unused=True, topology=topo.topology)
    plan_s = time.perf_counter() - t0
    p = costmodel.predict(plan, topo)
    return {"name": name, "nic_pace": topology.NIC_PACE, "copy_share": planner.COPY_SHARE, "plan_s": round(plan_s, 1),
            "rounds": plan.rounds, "messages": len(plan.messages),
            "paced_over_link": round(p["paced_s"] / p["link_bound_s"], 4),
            "nic_eq_bound": plan.stats["network_bytes"] == plan.stats["lower_bound_bytes"],
            "hash": plan.hash[:16]}


def run(name: str, budget: int) -> dict:
    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.tools import costmodel
    from mcore_reshard.tools.bench.configs import CONFIGS
    conf = CONFIGS[name]
    topo = costmodel.preset(conf.topology)
    src, dst = conf.build()
    out = {"name": name, "title": conf.title, "topology": topo.name, "gpus_per_domain": topo.gpus_per_domain,
           "budget_bytes": budget, "ranks": len(set(src.ranks) | set(dst.ranks))}
    t0 = time.perf_counter()
    flat = make_plan(src, dst, budget_bytes=budget, ignore_unused=True, templates=False)
    out["flat"] = _numbers(flat, topo, time.perf_counter() - t0)
    h = costmodel.hierarchical(flat, topo)
    out["flat"]["costmodel_hierarchical"] = {"predicted_s": h["seconds"], "link_bound_s": h["link_bound_s"],
                                             "nic_bytes": h["nic_bytes"], "nic_bytes_saved": h["nic_bytes_saved"]}
    out["flat"]["hash"] = flat.hash
    del flat, h
    gc.collect()
    t0 = time.perf_counter()
    plan = make_plan(src, dst, budget_bytes=budget, ignore_unused=True, topology=topo.topology)
    out["two_level"] = _numbers(plan, topo, time.perf_counter() - t0)
    out["two_level"]["hierarchical_bound_bytes"] = plan.stats["hierarchical_bound_bytes"]
    out["two_level"]["hash"] = plan.hash
    t = out["two_level"]
    out["targets"] = {"nic_equals_bound": t["nic_bytes"] == t["hierarchical_bound_bytes"],
                      "nic_over_bound": t["nic_bytes"] / t["hierarchical_bound_bytes"] if t["hierarchical_bound_bytes"] else None,
                      "predicted_within_1.15x_link_bound": (t["predicted_over_link_bound"] or 0) <= 1.15}
    return out


def table(paths: list[str]) -> str:
    """The BENCHMARKS.md A.3 table of saved results."""
    gb = 1e9
    rows = ["| config (topology) | NIC GB flat | NIC GB two-level | hierarchical bound GB | NVLink GB (forwarded) | "
            "rounds flat → two-level | predicted s flat → two-level | paced s flat → two-level | link bound s (two-level) | "
            "predicted / link bound | paced / link bound | plan s flat / two-level |", "|---" * 12 + "|"]
    for p in paths:
        r = json.loads(Path(p).read_text())
        f, t = r["flat"], r["two_level"]
        rows.append(f"| {r['name']} ({r['topology']}, {r['gpus_per_domain']}/domain) | {f['nic_bytes'] / gb:,.1f} | "
                    f"**{t['nic_bytes'] / gb:,.1f}** | {t['hierarchical_bound_bytes'] / gb:,.1f} | "
                    f"{t['nvlink_bytes'] / gb:,.1f} ({t['forwarded_bytes'] / gb:,.1f}) | {f['rounds']} → {t['rounds']} | "
                    f"{f['predicted_s']:.3f} → **{t['predicted_s']:.3f}** | "
                    + (f"{f['paced_s']:.3f} → **{t['paced_s']:.3f}** | " if "paced_s" in t else "— | ")
                    + f"{t['link_bound_s']:.3f} | {t['predicted_over_link_bound']:.2f}x | "
                    + (f"{t['paced_over_link_bound']:.2f}x | " if "paced_s" in t else "— | ")
                    + f"{f['plan_s']:.1f} / {t['plan_s']:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--table"]:
        print(table(sys.argv[2:]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config")
    ap.add_argument("--budget-mib", type=float, default=256.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="the two-level plan only, one JSON line (paced / link bound, rounds, messages, hash)")
    ap.add_argument("--nic-pace", type=float, default=None, help="with --quick: topology.NIC_PACE for this run")
    ap.add_argument("--copy-share", type=int, default=None, help="with --quick: COPY_SHARE for this run")
    a = ap.parse_args(argv)
    if a.quick:
        print(json.dumps(quick(a.config, int(a.budget_mib * (1 << 20)), a.nic_pace, a.copy_share)), flush=True)
        return 0
    res = run(a.config, int(a.budget_mib * (1 << 20)))
    path = Path(a.out or f"benchmarks/results/two_level_{a.config}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    json.dump(res, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
