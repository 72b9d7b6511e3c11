"""Plan time, plan memory, rounds and staging of one full-size configuration, plan only (no layout
analytics, no cost model), as one JSON line -- for before/after comparisons of the planner::

    PYTHONPATH=<a checkout> python benchmarks/plan_time.py nccl_m2n [hash]

Runs whatever ``mcore_reshard`` is importable, so the same script times an older checkout (e.g.
``git archive <rev> mcore_reshard layouts | tar -x -C /tmp/before``) and the current one in turn on
the same machine.  Reported: wall and CPU seconds of ``make_plan`` (256 MiB budget,
``ignore_unused=True``), resident memory added while planning (VmHWM), rounds and the fewest
possible (the busiest rank's staged send + receive bytes / budget), the largest send + receive
staging of a rank in one round (what the executor allocates now), the same under the old rule (max
send + max receive, allocated separately), and one rank's own part (the busiest rank's messages,
filtered from the whole plan: see ``planner.plan_part``).  ``hash``: also the plan hash (seconds).
"""
import gc
import json
import sys
import time

from mcore_reshard.tools import bench
from mcore_reshard.tools.memstat import peak_bytes, reset_peak, rss_bytes
from mcore_reshard.core.planner import make_plan
from mcore_reshard.targets import dsv3_671b

name = sys.argv[1]
budget = 256 << 20
t0 = time.perf_counter()
src, dst = bench.CONFIGS[name].build(dsv3_671b())
layout_s = time.perf_counter() - t0
gc.collect()
rss0 = rss_bytes()
reset_peak()
c0, w0 = time.process_time(), time.perf_counter()
plan = make_plan(src, dst, budget_bytes=budget, ignore_unused=True)
plan_s, plan_cpu = time.perf_counter() - w0, time.process_time() - c0
mem = peak_bytes() - rss0
stage, ss, sr, staged = {}, {}, {}, {}
for m in plan.messages:
    for key, d in (((m.round, m.src), ss), ((m.round, m.dst), sr)):
        d[key] = d.get(key, 0) + m.nbytes
        stage[key] = stage.get(key, 0) + m.nbytes
    staged[m.src] = staged.get(m.src, 0) + m.nbytes
    staged[m.dst] = staged.get(m.dst, 0) + m.nbytes
busiest = max(sorted(staged), key=lambda r: staged[r])
t0 = time.perf_counter()
part_msgs = [m for m in plan.messages if m.src == busiest or m.dst == busiest]
part_local = [c for c in plan.local_copies if c.dst == busiest or c.src == busiest]
part_s = time.perf_counter() - t0
old_rule = {}      # per rank [max send staging, max receive staging] over rounds
for (k, r), v in ss.items():
    e = old_rule.setdefault(r, [0, 0])
    e[0] = max(e[0], v)
for (k, r), v in sr.items():
    e = old_rule.setdefault(r, [0, 0])
    e[1] = max(e[1], v)
out = {"name": name, "layout_s": round(layout_s, 2), "plan_s": round(plan_s, 2), "plan_cpu_s": round(plan_cpu, 2),
       "part_extract_s": round(part_s, 3), "part_rank": busiest, "part_messages": len(part_msgs),
       "part_copies": sum(len(m.entries) for m in part_msgs) + len(part_local),
       "rss_added_mib": round(mem / 2**20), "rounds": plan.rounds, "rounds_lower_bound": -(-max(staged.values()) // budget),
       "messages": len(plan.messages), "copies": sum(len(m.entries) for m in plan.messages),
       "local_copies": len(plan.local_copies),
       "network_eq_lb": plan.stats["network_bytes"] == plan.stats["lower_bound_bytes"],
       "max_stage_send_recv_sum_mib": round(max(stage.values()) / 2**20, 1),
       "executor_staging_old_rule_mib": round(max(a + b for a, b in old_rule.values()) / 2**20, 1)}
if len(sys.argv) > 2:
    t0 = time.perf_counter()
    out["hash"] = plan.hash[:16]
    out["hash_s"] = round(time.perf_counter() - t0, 2)
print(json.dumps(out), flush=True)
