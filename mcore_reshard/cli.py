"""``mcore-reshard`` command line."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

DESCRIPTION = """\
Reshard live Megatron-Core weights shard to shard between parallel layouts.

  demo   launch local gloo processes, reshard a synthetic model (fused QKV, [gate; up], experts,
         vocab padding, an uneven tensor) from one layout to another, check every destination
         tensor bit for bit, and print bytes moved vs the lower bound, messages and time.
  plan   compute the same plan without moving anything and print or save it (JSON).

Layouts are short strings of parallel sizes: "tp=2,pp=2,ep=2,etp=1,dp=1".  Missing sizes are 1;
etp defaults to tp.  World size of a layout = tp * pp * cp * dp.
"""


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default="tp=2,ep=2,etp=1,pp=2", help="source layout (default: %(default)s)")
    p.add_argument("--dst", default="tp=4", help="destination layout (default: %(default)s)")
    p.add_argument("--colocated", action="store_true",
                   help="destination on the same ranks as the source (default: disaggregated, ranks after the source's)")
    p.add_argument("--scale", type=int, default=1, help="multiply the synthetic model's widths by this (default: 1)")
    p.add_argument("--budget-mib", type=float, default=256.0, help="staging budget per rank and round, MiB (default: 256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="source dtype")
    p.add_argument("--dst-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="destination dtype (differs from --dtype: cast on the receiver)")


def _progress(msg: str) -> None:
    print(f"[mcore-reshard] {msg}", file=sys.stderr, flush=True)


def cmd_plan(args) -> int:
    from .demo import build_layouts
    from .planner import make_plan
    t0 = time.perf_counter()
    src, dst = build_layouts(args.src, args.dst, args.colocated, args.scale, args.dtype, args.dst_dtype)
    plan = make_plan(src, dst, budget_bytes=int(args.budget_mib * (1 << 20)),
                     allow_cast=args.dst_dtype not in (None, args.dtype))
    print(f"source {args.src} ({len(src.ranks)} ranks) -> destination {args.dst} ({len(dst.ranks)} ranks, "
          f"{'colocated' if args.colocated else 'disaggregated'})")
    print(plan.summary())
    print(f"plan hash          {plan.hash[:16]}  built in {time.perf_counter() - t0:.3f} s")
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.dumps())
        print(f"plan written to {args.out}")
    return 0


def cmd_demo(args) -> int:
    from .demo import demo_worker, world_needed
    from .launch import spawn
    world = world_needed(args.src, args.dst, args.colocated)
    _progress(f"launching {world} gloo processes: {args.src} -> {args.dst} "
              f"({'colocated' if args.colocated else 'disaggregated'}), {args.reps} refits")
    t0 = time.perf_counter()
    results = spawn(demo_worker, world, args.src, args.dst, args.colocated, args.scale,
                    int(args.budget_mib * (1 << 20)), args.reps, args.dtype, args.dst_dtype, timeout=args.timeout)
    _progress(f"all ranks done in {time.perf_counter() - t0:.1f} s")
    stats = results[0]["stats"]
    times = [max(r["times"][i] for r in results) for i in range(args.reps)]
    bad = sum(r["mismatched_tensors"] for r in results)
    hashes = {r["plan_hash"] for r in results}
    ok = bad == 0 and len(hashes) == 1 and all(r["same_storage"] for r in results)
    print(f"layout             {args.src} -> {args.dst} on {world} ranks")
    print(f"bytes over network {stats['network_bytes']:,} (lower bound {stats['lower_bound_bytes']:,}; "
          f"{'equal' if stats['network_bytes'] == stats['lower_bound_bytes'] else 'ABOVE'})")
    print(f"bytes copied local {stats['local_bytes']:,}")
    print(f"messages           {stats['messages']} per refit in {stats['rounds']} round(s)")
    print(f"refit time         median {statistics.median(times) * 1e3:.1f} ms over {args.reps} refits "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    print(f"staging per rank   max {max(r['staging_bytes'] for r in results):,} B")
    print(f"bit-exact          {'yes' if bad == 0 else f'NO: {bad} tensor mismatches'} "
          f"({sum(r['dst_tensors'] for r in results)} destination tensors x {args.reps} refits); "
          f"destination storage {'unchanged' if all(r['same_storage'] for r in results) else 'MOVED'}")
    if args.json:
        print(json.dumps({"stats": stats, "times": times, "mismatches": bad}))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-reshard", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="reshard a synthetic model on local gloo processes and check it bit for bit")
    _add_layout_args(p)
    p.add_argument("--reps", type=int, default=3, help="refits to run (new weights each time; default: 3)")
    p.add_argument("--timeout", type=float, default=600, help="give up after this many seconds (default: 600)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("plan", help="compute and summarise the plan only (no processes, no data)")
    _add_layout_args(p)
    p.add_argument("--out", help="write the plan as JSON to this file")
    p.set_defaults(func=cmd_plan)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
