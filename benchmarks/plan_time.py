"""Plan time and memory of full-size configurations, as JSON lines, with a reference loop timed in
the same process (this machine's speed varies several-fold with load: compare ratios)::

    python benchmarks/plan_time.py nemo_rl nccl_m2n ... [--classic] [--hash] [--check]

For each configuration: the wall and CPU seconds of the whole plan (``make_plan``, 256 MiB budget,
``ignore_unused=True``; ``fp8_tp8``: ``make_fp8_plan`` 671B Megatron TP8 -> vLLM TP8, block 128),
resident memory added while planning (VmHWM), one rank's part (``plan_part`` of the busiest rank:
from the templates alone for a templated plan), and each as a ratio to the loop
``s = 0; for i in range(10_000_000): s += i`` inside a function (the best of 3, before and after).
``--classic``: the copy-by-copy planner (``templates=False``); ``--always``: the templated plan
even where its rounds exceed ``ROUND_SLACK`` x the fewest possible (``templates="always"``).  ``--hash``: also the plan hash and
its time.  ``--check``: also ``validate_plan`` of the busiest rank's part (with the part: what a
``Resharder`` does at bind on that rank).  ``--json-parts``: the layouts as ``MegatronRefit`` gets them, one JSON part per rank merged by
``core.layout.merge_layouts`` (``merge_s``), before planning.  ``first_fit``: the C kernel's
(:mod:`mcore_reshard.core.planner.fastfit`) or the Python reference's (``MCORE_RESHARD_PURE_PYTHON=1``).
``--whole`` (templated plans): also, last, every rank's
views made and that rank checked against the whole plan (what binding cost before parts), its
time and resident memory added.
Configurations: those of ``mcore_reshard.tools.bench`` and ``fp8_tp8``.
"""
import gc
import json
import sys
import time

from mcore_reshard.core.planner import make_plan, plan_part, validate_plan
from mcore_reshard.tools import bench
from mcore_reshard.util.memstat import peak_bytes, reset_peak, rss_bytes

BUDGET = 256 << 20


def loop() -> int:
    s = 0
    for i in range(10_000_000):
        s += i
    return s


def loop_s() -> tuple[float, float]:
    """(wall, CPU) seconds of :func:`loop`, the best of 3."""
    best, cpu = float("inf"), float("inf")
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        loop()
        best, cpu = min(best, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return best, cpu


def build(name: str):
    from mcore_reshard.targets import dsv3_671b
    if name == "fp8_tp8":
        from mcore_reshard.fp8.quant_layout import fp8_target
        from mcore_reshard.fp8.quant_plan import quantized_tensors
        from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
        from mcore_reshard.targets import vllm_layout
        cfg = dsv3_671b()
        src = megatron_layout(cfg, ParallelSizes(tp=8), "deepseek_v3", dtype="bfloat16")
        dst = vllm_layout(cfg, tp=8, rank_offset=8)
        return src, fp8_target(dst, quantized_tensors(dst, "deepseek_v3", (128, 128)), (128, 128))
    conf = bench.CONFIGS[name]
    return conf.build(conf.model() if hasattr(conf, "model") else dsv3_671b())


def via_json(layout):
    """``layout`` as ``MegatronRefit`` sees it: one JSON part per rank (what each rank sends), merged
    by ``core.layout.merge_layouts``; (the layout, seconds to merge)."""
    import json

    from mcore_reshard.core.layout import Layout, merge_layouts
    parts = [json.loads(json.dumps(Layout(layout.tensors, {r: bufs}).to_json())) for r, bufs in layout.buffers.items()]
    t0 = time.perf_counter()
    merged = merge_layouts(parts)
    return merged, time.perf_counter() - t0


def run(name: str, classic: bool, want_hash: bool, check: bool, always: bool = False, whole: bool = False,
        json_parts: bool = False) -> dict:
    t0 = time.perf_counter()
    src, dst = build(name)
    layout_s = time.perf_counter() - t0
    merge_s = None
    if json_parts:
        (src, a), (dst, b) = via_json(src), via_json(dst)
        merge_s = round(a + b, 2)
    gc.collect()
    before = loop_s()
    rss0 = rss_bytes()
    reset_peak()
    c0, w0 = time.process_time(), time.perf_counter()
    if name == "fp8_tp8":
        from mcore_reshard.fp8.quant_plan import make_fp8_plan
        plan = make_fp8_plan(src, dst, (128, 128), budget_bytes=BUDGET, allow_cast=True, ignore_unused=True)
    else:
        plan = make_plan(src, dst, budget_bytes=BUDGET, ignore_unused=True,
                         templates=False if classic else ("always" if always else True))
    plan_s, plan_cpu = time.perf_counter() - w0, time.process_time() - c0
    mem = peak_bytes() - rss0
    from mcore_reshard.core.planner import TemplatedPlan
    kind = "make_fp8_plan" if name == "fp8_tp8" else "templated" if isinstance(plan, TemplatedPlan) else "classic"
    from mcore_reshard.core.planner import fastfit
    out = {"name": name, "planner": kind, "first_fit": "c" if fastfit.cfit is not None else "python",
           "layout_s": round(layout_s, 2), **({"merge_s": merge_s} if json_parts else {}),
           "plan_s": round(plan_s, 3), "plan_cpu_s": round(plan_cpu, 3), "rss_added_mib": round(mem / 2**20)}
    if name != "fp8_tp8":
        s = plan.stats
        busiest = max(sorted(int(r) for r in s["sent_bytes"]),
                      key=lambda r: s["sent_bytes"][str(r)] + s["recv_bytes"][str(r)])
        t0 = time.perf_counter()
        part = plan_part(plan, busiest)
        part_s = time.perf_counter() - t0
        out.update({"part_s": round(part_s, 3), "part_rank": busiest, "part_messages": len(part.messages),
                    "part_copies": sum(len(m.entries) for m in part.messages) + len(part.local_copies),
                    "rounds": plan.rounds, "messages": s["messages"],
                    "rounds_lower_bound": -(-max(s["sent_bytes"][str(r)] + s["recv_bytes"][str(r)]
                                                for r in (int(x) for x in s["sent_bytes"])) // BUDGET),
                    "templates": s.get("templates"), "instances": s.get("instances"),
                    "network_eq_lb": s["network_bytes"] == s["lower_bound_bytes"],
                    "max_stage_mib": round(s["max_stage_bytes"] / 2**20, 1)})
        if check:
            t0 = time.perf_counter()
            out["part_problems"] = len(validate_plan(part, busiest))
            out["check_s"] = round(time.perf_counter() - t0, 3)
        if whole and isinstance(plan, TemplatedPlan):
            # what binding that rank cost before the Resharder bound parts: every rank's views made,
            # then the rank checked against the whole plan (after everything else: it grows the heap)
            import tracemalloc
            del part
            gc.collect()
            t0 = time.perf_counter()
            plan.messages, plan.local_copies, plan.padding, plan.buffers
            out["whole_views_s"] = round(time.perf_counter() - t0, 3)
            problems = validate_plan(plan, busiest)
            out["whole_check_s"] = round(time.perf_counter() - t0, 3)
            out["whole_problems"] = len(problems)
            # memory, traced (Python's own allocations: resident memory misses what reuses freed arenas),
            # the part's and the whole's, each made again from scratch
            for key, make in (("part_traced_mib", lambda: validate_plan(plan_part(plan, busiest), busiest)),
                              ("whole_traced_mib", lambda: (plan.messages, plan.local_copies, plan.padding,
                                                            plan.buffers, validate_plan(plan, busiest)))):
                for k in ("messages", "local", "padding", "buffers"):
                    plan._cache.pop(k, None)
                gc.collect()
                tracemalloc.start()
                got = make()
                out[key] = round(tracemalloc.get_traced_memory()[1] / 2**20)
                tracemalloc.stop()
                del got
    if want_hash:
        t0 = time.perf_counter()
        out["hash"] = plan.hash[:16]
        out["hash_s"] = round(time.perf_counter() - t0, 3)
    after = loop_s()
    ref, ref_cpu = min(before[0], after[0]), min(before[1], after[1])
    out["loop_s"] = [round(before[0], 3), round(after[0], 3)]
    out["loop_cpu_s"] = round(ref_cpu, 3)
    for k in ("plan_s", "part_s", "hash_s", "check_s", "whole_check_s"):
        if k in out:
            out[k.replace("_s", "_x_loop")] = round(out[k] / ref, 2)
    out["plan_cpu_x_loop_cpu"] = round(plan_cpu / ref_cpu, 2)
    return out


if __name__ == "__main__":
    flags = {a for a in sys.argv[1:] if a.startswith("--")}
    for name in [a for a in sys.argv[1:] if not a.startswith("--")]:
        print(json.dumps(run(name, "--classic" in flags, "--hash" in flags, "--check" in flags, "--always" in flags,
                             "--whole" in flags, "--json-parts" in flags)),
              flush=True)
