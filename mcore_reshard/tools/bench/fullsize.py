"""Plan each full-size configuration (in its own process, memory-capped) and measure bytes, balance,
messages, rounds, plan time and plan memory, with the cost model's predictions."""
from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from ...util.memstat import peak_bytes, reset_peak, rss_bytes
from .. import costmodel
from .baselines import gather_broadcast, lower_bound
from .configs import CONFIGS, NODE, PUBLISHED


def _max_mean(d: dict) -> dict:
    vals = [v for v in d.values() if v]
    return {"max": max(vals, default=0), "mean": statistics.fmean(vals) if vals else 0, "ranks": len(vals)}


def traffic_matrix(plan, group: int) -> list[list[int]]:
    """Network bytes from sender group to receiver group (rank // group), local copies excluded."""
    n = max(plan.ranks) // group + 1
    mat = [[0] * n for _ in range(n)]
    for m in plan.messages:
        mat[m.src // group][m.dst // group] += sum(c.nbytes for c in m.entries)
    return mat


def run_full_size_config(name: str, budget: int = 256 << 20, memory: str = "rss", partial: str | None = None) -> dict:
    """Build, analyse, plan and cost one configuration in this process (JSON-able result).
    ``partial``: a file to write the pre-planning numbers to (layouts, lower bound, baseline)."""
    from ...core.planner import make_plan, plan_part
    conf = CONFIGS[name]
    out: dict = {"name": name, "title": conf.title, "src": conf.src, "dst": conf.dst, "colocated": conf.colocated,
                 "topology": conf.topology, "note": conf.note, "budget_bytes": budget}
    t0 = time.perf_counter()
    src, dst = conf.build()
    out["layout_s"] = time.perf_counter() - t0
    out["src_ranks"], out["dst_ranks"] = len(src.ranks), len(dst.ranks)
    out["ranks"] = len(set(src.ranks) | set(dst.ranks))
    out["tensors"] = len(dst.tensors)
    out["model_bytes"] = sum(src.tensors[n].nbytes for n in dst.tensors)
    out["unused_tensors"] = len(set(src.tensors) - set(dst.tensors))
    out["dst_pieces"] = sum(len(b.pieces) for bufs in dst.buffers.values() for b in bufs.values())
    out["src_pieces"] = sum(len(b.pieces) for bufs in src.buffers.values() for b in bufs.values())
    t0 = time.perf_counter()
    lb = lower_bound(src, dst)
    gb = gather_broadcast(src, dst)
    out["analytics_s"] = time.perf_counter() - t0
    out["layout_lower_bound"] = lb["bytes"]
    out["baseline"] = {"bytes": gb["bytes"], "gather_bytes": gb["gather_bytes"], "broadcast_bytes": gb["broadcast_bytes"],
                       "units": gb["units"],
                       "send": _max_mean(gb["sent"]), "recv": _max_mean(gb["recv"])}
    topo = costmodel.preset(conf.topology)
    out["baseline"]["model"] = costmodel.gather_broadcast_time(gb["items"], topo)
    out["lower_bound_per_rank"] = _max_mean(lb["recv"])
    del gb
    if partial:     # what is known before planning, in case planning does not finish
        with open(partial, "w") as f:
            json.dump(out, f)
    rss0, hwm_ok = rss_bytes(), reset_peak()
    if memory == "tracemalloc":
        tracemalloc.start()
    t0 = time.perf_counter()
    plan = make_plan(src, dst, budget_bytes=budget, ignore_unused=True)
    out["plan_s"] = time.perf_counter() - t0
    if memory == "tracemalloc":
        out["plan_tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out["plan_rss_peak_added"] = peak_bytes() - rss0 if hwm_ok else None
    out["plan_memory_mode"] = memory
    # one rank's own part (the busiest rank's): only obtainable from the whole plan, see plan_part
    staged: dict[int, int] = {}
    for m in plan.messages:
        staged[m.src] = staged.get(m.src, 0) + m.nbytes
        staged[m.dst] = staged.get(m.dst, 0) + m.nbytes
    busiest = max(sorted(staged), key=lambda r: staged[r]) if staged else 0
    t0 = time.perf_counter()
    part = plan_part(plan, busiest)
    out["plan_part_s"] = time.perf_counter() - t0
    out["plan_part"] = {"rank": busiest, "messages": len(part.messages),
                        "copies": sum(len(m.entries) for m in part.messages) + len(part.local_copies)}
    del part
    st = plan.stats
    out["plan"] = {"network_bytes": st["network_bytes"], "lower_bound_bytes": st["lower_bound_bytes"],
                   "local_bytes": st["local_bytes"], "messages": st["messages"], "rounds": plan.rounds,
                   "copies": sum(len(m.entries) for m in plan.messages), "local_copies": len(plan.local_copies),
                   "send": _max_mean({int(r): v for r, v in st["sent_bytes"].items()}),
                   "recv": _max_mean({int(r): v for r, v in st["recv_bytes"].items()}),
                   "max_stage_send_bytes": st["max_stage_send_bytes"], "max_stage_recv_bytes": st["max_stage_recv_bytes"],
                   "max_stage_bytes": st["max_stage_bytes"],
                   # fewest rounds possible: the busiest rank's staged send + receive bytes / budget
                   "rounds_lower_bound": -(-max(staged.values(), default=0) // budget),
                   "padding_bytes": st["padding_bytes"]}
    out["cost"] = {}
    # every preset, except on plans with millions of copies (the fan-out model walks every copy)
    presets = sorted(costmodel.PRESETS) if out["plan"]["copies"] <= 2_000_000 else [conf.topology]
    for tname in presets:
        t = costmodel.preset(tname)
        p = costmodel.predict(plan, t)
        h = costmodel.hierarchical(plan, t)
        out["cost"][tname] = {"topology": t.name, "predicted_s": p["seconds"], "link_bound_s": p["link_bound_s"],
                              "local_s": p["local_s"], "nic_bytes": p["nic_bytes"], "nvlink_bytes": p["nvlink_bytes"],
                              "hier_predicted_s": h["seconds"], "hier_link_bound_s": h["link_bound_s"],
                              "hier_nic_bytes": h["nic_bytes"], "hier_nic_bytes_saved": h["nic_bytes_saved"]}
    group = 1 if out["ranks"] <= 64 else NODE
    out["matrix_group"] = group
    out["matrix"] = traffic_matrix(plan, group)
    out["per_rank"] = {"sent": [st["sent_bytes"].get(str(r), 0) for r in plan.ranks],
                       "recv": [st["recv_bytes"].get(str(r), 0) for r in plan.ranks],
                       "lower_bound_recv": None, "ranks": plan.ranks}
    out["per_rank"]["lower_bound_recv"] = [lb["recv"].get(r, 0) for r in plan.ranks]   # lower bound per rank
    out["published"] = PUBLISHED.get(name.replace("_ep", ""), [])
    return out


# the peak RSS of this process image: VmHWM (reset by exec), not ru_maxrss, which keeps the high-water
# mark of the forked parent's memory from before the exec (a test runner of 1 GB reads as a 1 GB CLI)
_RSS_AT_EXIT = ("import atexit, resource, sys\n"
                "def _hwm():\n"
                "    try:\n"
                "        return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:'))\n"
                "    except (OSError, StopIteration):\n"
                "        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
                "atexit.register(lambda: print('max RSS KiB', _hwm(), "
                "'CPU s', sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), file=sys.stderr))\n"
                "from mcore_reshard.tools.cli import main; sys.exit(main(sys.argv[1:]))")


def hf_config_json(cfg) -> dict:
    """A Hugging Face config.json of ``cfg`` (what ``mcore-reshard plan --config`` reads back)."""
    return cfg.to_hf_dict()


def run_cli(name: str, timeout: float = 600) -> dict:
    """``mcore-reshard plan`` on configuration ``name`` as a user runs it (a fresh process, the whole
    report), side by side with the plan build time that same process prints: ``wall_s`` (start to
    exit, from here), ``plan_s`` ("built in"), their ratio, ``layouts_s`` (the layouts the plan is
    built from); the same in CPU seconds (the process's user + system against the plan's
    ``time.process_time``: what a busy machine does not distort) and the process's peak RSS."""
    conf = CONFIGS[name]
    with tempfile.TemporaryDirectory(prefix="mcore-bench-cli-") as tmp:
        config = None
        if conf.model_name == "small":          # no --model preset: as a config.json
            config = os.path.join(tmp, "config.json")
            with open(config, "w") as f:
                json.dump(hf_config_json(conf.model()), f)
        args = ["--progress", "never", *conf.cli_args(config)]
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", _RSS_AT_EXIT, *args], capture_output=True, text=True,
                              timeout=timeout)
        wall = time.perf_counter() - t0
    line = re.findall(r"built in ([0-9.]+) s \(([0-9.]+) s CPU\) from layouts built in ([0-9.]+) s \(([0-9.]+) s CPU\)",
                      proc.stdout)
    rss = [int(x) for x in re.findall(r"max RSS KiB ([0-9]+)", proc.stderr)]
    cpu = [float(x) for x in re.findall(r"CPU s ([0-9.]+)", proc.stderr)]
    if proc.returncode != 0 or not line or not rss or not cpu:
        return {"command": "mcore-reshard " + " ".join(args), "error": (proc.stderr or proc.stdout)[-300:]}
    plan_s, plan_cpu, layouts_s, layouts_cpu = map(float, line[0])
    return {"command": "mcore-reshard " + " ".join(args), "wall_s": wall, "plan_s": plan_s, "layouts_s": layouts_s,
            "wall_over_plan": wall / plan_s, "cpu_s": cpu[0], "plan_cpu_s": plan_cpu, "layouts_cpu_s": layouts_cpu,
            "cpu_over_plan_cpu": cpu[0] / plan_cpu, "max_rss_bytes": rss[0] << 10, "loadavg_before": load}


def _limit_memory(gib: float):
    def apply():
        import resource
        cap = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return apply if gib else None


def run_full_size(names: list[str], budget: int, memory: str, timeout: float, log=print,
                  max_mem_gib: float = 0, progress: str | Path | None = None, cli: bool = True) -> list[dict]:
    """Each configuration in its own process (``python -m mcore_reshard.tools.bench --in-process``), so
    that its memory is measured alone, a slow one is given up after ``timeout`` seconds and one
    that needs more than ``max_mem_gib`` of address space fails (MemoryError) instead of pushing the
    machine into swap (0: no cap).  ``progress``: a JSON file rewritten after every configuration;
    ``cli``: also ``mcore-reshard plan`` on it, its wall against its plan build time (:func:`run_cli`)."""
    from ...util.progress import bar
    results = []
    for name in bar(names, desc="full-size plans", unit="config"):
        with tempfile.TemporaryDirectory(prefix="mcore-bench-") as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, "-m", "mcore_reshard.tools.bench", "--full-size", "--configs", name, "--in-process",
                   "--budget-mib", str(budget / (1 << 20)), "--memory", memory, "--json", path]
            log(f"[bench] {name}: planning ({' '.join(cmd[3:])}) ...")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True,
                                      preexec_fn=_limit_memory(max_mem_gib))
            except subprocess.TimeoutExpired:
                log(f"[bench] {name}: gave up planning after {timeout:.0f} s")
                results.append(_partial(path, name, f"plan not finished in {timeout:.0f} s"))
                _progress(results, progress)
                continue
            if proc.returncode != 0 or not os.path.exists(path):
                tail = (proc.stderr or proc.stdout)[-1500:]
                log(f"[bench] {name}: failed\n{tail}")
                last = tail.strip().splitlines()[-1] if tail.strip() else f"exit status {proc.returncode}"
                results.append(_partial(path, name, last[:300]))
                _progress(results, progress)
                continue
            with open(path) as f:
                res = json.load(f)[0]
            log(f"[bench] {name}: done in {time.perf_counter() - t0:.0f} s (plan {res['plan_s']:.1f} s)")
            if cli:
                res["cli"] = run_cli(name, timeout)
                log(f"[bench] {name}: {_cli_line(res['cli'])}")
            results.append(res)
            _progress(results, progress)
    return results


def _cli_line(c: dict) -> str:
    if "error" in c:
        return f"CLI failed: {c['error']}"
    return (f"CLI {c['wall_s']:.1f} s wall / plan {c['plan_s']:.1f} s = {c['wall_over_plan']:.2f}x; CPU "
            f"{c['cpu_s']:.1f} / {c['plan_cpu_s']:.1f} s = {c['cpu_over_plan_cpu']:.2f}x (layouts {c['layouts_cpu_s']:.1f} "
            f"s CPU); {c['max_rss_bytes'] / 2**20:,.0f} MiB RSS")


def run_cli_only(names: list[str], timeout: float, log=print) -> list[dict]:
    """:func:`run_cli` on each configuration (``mcore-reshard bench --cli``)."""
    rows = []
    for name in names:
        row = {"name": name, "cli": run_cli(name, timeout)}
        log(f"[bench] {name}: {_cli_line(row['cli'])}")
        rows.append(row)
    return rows


def _partial(path: str, name: str, error: str) -> dict:
    try:
        with open(path + ".partial") as f:
            res = json.load(f)
    except OSError:
        res = {"name": name, "title": CONFIGS[name].title}
    res["error"] = error
    return res


def _progress(results: list, path) -> None:
    if path:
        save_json(Path(path), results)

def save_json(path: Path, obj) -> None:
    """``obj`` as indented JSON at ``path`` (parent folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
