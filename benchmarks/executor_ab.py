"""The overlapped (gloo) executor of this tree against an earlier revision's, and the transport
floor, timed interleaved call by call in the same 4 gloo workers::

    python benchmarks/executor_ab.py --rev f068b16 [--size 100M] [--reps 11]

The earlier revision's ``mcore_reshard/core/executor/rounds.py`` is read with ``git show`` and
loaded as a module; its ``round_overlapped`` runs in place of this tree's (same plan, same
binding).  ``floor``: the bare transport (``bench.live.TransportFloor``); ``floor_local``:
the floor, then this rank's local copies (``Resharder.copy_local``): the least any executor does
for this plan, as the floor copies nothing into the model.  Per method and rank: median wall ms, process CPU ms (every thread, gloo's
included) and main-thread CPU ms; ``paired_new_old``: the median of the per-call ratios.
Prints one JSON line per (rank, layout pair).
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_reshard.tools.bench import live  # noqa: E402


def _old_rounds(path: str):
    spec = importlib.util.spec_from_file_location("mcore_reshard.core.executor._old_rounds", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def worker(rank: int, world: int, size: str, reps: int, old_path: str) -> list:
    mcore_cpu, _ = live.import_test_helpers()
    mcore_cpu.install_cpu_shims()
    from mcore_reshard.core.executor import rounds
    from mcore_reshard.refit import MegatronRefit
    old_rounds = _old_rounds(old_path)
    out = []
    for case, (s, t) in live.CASES.items():
        src = live._build(mcore_cpu, live.SIZES[size], s, torch.bfloat16)
        dst = live._build(mcore_cpu, live.SIZES[size], t, torch.bfloat16)
        new = MegatronRefit(src, dst, budget_bytes=256 << 20)
        old = MegatronRefit(src, dst, budget_bytes=256 << 20)

        def run_old():
            keep = rounds.round_overlapped      # what the overlapped transport calls
            rounds.round_overlapped = old_rounds.round_overlapped
            try:
                old.refit()
            finally:
                rounds.round_overlapped = keep

        floor = live.TransportFloor(new.plan)

        def floor_local():      # the least any executor does here: the wire, then this rank's local copies
            floor.run()
            new.resharder.copy_local()

        fns = {"new": new.refit, "old": run_old, "floor": floor.run, "floor_local": floor_local}
        res = {k: [] for k in fns}
        for fn in fns.values():
            fn()
        for rep in range(reps):
            for k in (list(fns) if rep % 2 == 0 else list(fns)[::-1]):
                dist.barrier()
                c0, m0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
                fns[k]()
                t1, c1, m1 = time.perf_counter(), time.process_time(), time.thread_time()
                res[k].append((t1 - t0, c1 - c0, m1 - m0))

        def med(xs):
            return sorted(xs)[len(xs) // 2]

        row = {k: {"wall_ms": round(med([x[0] for x in v]) * 1e3, 1), "cpu_ms": round(med([x[1] for x in v]) * 1e3, 1),
                   "main_thread_cpu_ms": round(med([x[2] for x in v]) * 1e3, 1)} for k, v in res.items()}
        out.append({"rank": rank, "size": size, "case": case, **row,
                    "paired_new_old": round(med([a[0] / b[0] for a, b in zip(res["new"], res["old"])]), 3),
                    "new_over_floor": round(row["new"]["wall_ms"] / row["floor"]["wall_ms"], 2),
                    "old_over_floor": round(row["old"]["wall_ms"] / row["floor"]["wall_ms"], 2),
                    "floor_local_over_floor": round(row["floor_local"]["wall_ms"] / row["floor"]["wall_ms"], 2),
                    "loadavg": round(os.getloadavg()[0], 2)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", required=True, help="git revision whose rounds.py is the 'old' executor")
    ap.add_argument("--size", default="100M", choices=sorted(live.SIZES))
    ap.add_argument("--reps", type=int, default=11, help="interleaved timed calls per method (default: 11)")
    a = ap.parse_args()
    text = subprocess.run(["git", "show", f"{a.rev}:mcore_reshard/core/executor/rounds.py"], check=True,
                          capture_output=True, text=True).stdout
    text = text.replace("from . import", "from mcore_reshard.core.executor import").replace(
        "from .", "from mcore_reshard.core.executor.")
    with tempfile.NamedTemporaryFile("w", suffix="_old_rounds.py", delete=False) as f:
        f.write(text)
    mcore_cpu, _ = live.import_test_helpers()
    try:
        rows = mcore_cpu.spawn(worker, 4, a.size, a.reps, f.name, timeout=1800, gloo_timeout=600)
    finally:
        os.unlink(f.name)
    for per_rank in rows:
        for row in per_rank:
            print(json.dumps(row))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
