"""Where a live refit's time goes beyond the transport floor (4 gloo ranks on this machine)::

    python benchmarks/live_phases.py [--size 100M] [--direct-min 262144,4194304] [--reps 7]

For each layout pair of ``mcore_reshard.tools.bench.live.CASES``, inside the 4 workers: the local
copies of a rank run alone (the other ranks idle) and by all four at once (memory bandwidth
shared), each the median of 5; then one ``MegatronRefit`` bound per ``_DIRECT_MIN`` value (entries of
at least that many bytes get their own gloo operation) and the bare transport floor, timed
interleaved call by call (``bench.live._timed_interleaved``), medians and ratios to the floor.
Prints one JSON line per pair (rank 0's view; every rank's wall time is the same between barriers).
"""
import argparse
import json
import os
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from mcore_reshard.tools.bench import live  # noqa: E402


def _median(fn, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        dist.barrier()
    return sorted(ts)[len(ts) // 2]


def worker(rank: int, world: int, size: str, direct_mins: list, reps: int) -> list:
    mcore_cpu, _ = live.import_test_helpers()
    mcore_cpu.install_cpu_shims()
    from mcore_reshard.core.executor import common
    from mcore_reshard.refit import MegatronRefit
    out = []
    default = common._DIRECT_MIN
    for case, (s, t) in live.CASES.items():
        src = live._build(mcore_cpu, live.SIZES[size], s, torch.bfloat16)
        dst = live._build(mcore_cpu, live.SIZES[size], t, torch.bfloat16)
        fns, ops = {}, {}
        try:
            for v in direct_mins:
                common._DIRECT_MIN = v          # read when a Resharder binds (binding.parts)
                refit = MegatronRefit(src, dst, budget_bytes=256 << 20)
                fns[f"direct_min={v}"] = refit.refit
                ops[v] = sum(len(parts) for rnd in refit.resharder.rounds for side in (rnd.sends, rnd.recvs)
                             for *_, parts in side)
        finally:
            common._DIRECT_MIN = default
        r = refit.resharder
        alone = _median(lambda: r.copy_local() if rank == 0 else None)
        together = _median(lambda: r.copy_local())
        fns["floor"] = live.TransportFloor(refit.plan).run
        timed = live._timed_interleaved(fns, reps)
        med = {k: sorted(o["times"])[len(o["times"]) // 2] for k, o in timed.items()}
        out.append({"size": size, "case": case, "local_mb": round(sum(x[2].nbytes for x in r.local) / 1e6, 1),
                    "local_alone_s": round(alone, 4), "local_all_ranks_s": round(together, 4),
                    "gloo_ops": {str(k): v for k, v in ops.items()},
                    "median_s": {k: round(v, 4) for k, v in med.items()},
                    "over_floor": {k: round(v / med["floor"], 2) for k, v in med.items()},
                    "loadavg": os.getloadavg()[0]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="100M", choices=sorted(live.SIZES))
    ap.add_argument("--direct-min", default=f"{256 << 10},{4 << 20}",
                    help="comma-separated _DIRECT_MIN values (bytes) to compare (default: 262144,4194304)")
    ap.add_argument("--reps", type=int, default=7, help="interleaved timed calls per method (default: 7)")
    a = ap.parse_args()
    mcore_cpu, _ = live.import_test_helpers()
    rows = mcore_cpu.spawn(worker, 4, a.size, [int(v) for v in a.direct_min.split(",")], a.reps,
                           timeout=1800, gloo_timeout=600)
    for row in rows[0]:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
