"""``mcore-reshard bench`` / ``python -m mcore_reshard.tools.bench``: options and the driver."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .configs import CONFIGS, DEFAULT_OUT, FULL_SIZE_DEFAULT

# ----------------------------------------------------------------------------------- CLI

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object (``mcore-reshard bench``)."""
    p = subparsers.add_parser("bench", help="benchmarks: full-size plans + cost model, live CPU runs, pictures",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full-size", action="store_true", help="plan DeepSeek-V3 671B configurations (metadata only)")
    p.add_argument("--configs", default=",".join(FULL_SIZE_DEFAULT),
                   help="full-size configurations, comma separated (default: %(default)s; also: small)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per full-size configuration, and per live model size (default: %(default)s)")
    p.add_argument("--max-mem-gib", type=float, default=16,
                   help="address-space cap per full-size configuration process, GiB (0: none; default: %(default)s)")
    p.add_argument("--memory", choices=["rss", "tracemalloc"], default="rss",
                   help="plan memory: peak resident set added while planning (rss, cheap) or tracemalloc's peak "
                        "(Python allocations only; slows planning ~5x) (default: %(default)s)")
    p.add_argument("--cli", action="store_true", help="only `mcore-reshard plan` on each --configs configuration, "
                                                       "its wall against the plan build time it prints (side by side)")
    p.add_argument("--no-cli", action="store_true", help="--full-size without the `mcore-reshard plan` runs")
    p.add_argument("--live", action="store_true", help="live CPU+gloo runs: mcore_reshard vs megatron.core.resharding "
                                                        "vs gather+broadcast (4 processes)")
    p.add_argument("--sizes", default="20M,100M,300M", help="live model sizes (default: %(default)s; also: tiny, 1B)")
    p.add_argument("--cases", default=None, help="live layout pairs, ';'-separated (default: all)")
    p.add_argument("--methods", default=None, help="live methods, comma separated (default: all of "
                                                    "bench.live.METHODS)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="live model dtype")
    p.add_argument("--budget-mib", type=float, default=256.0, help="staging budget per rank and round (default: 256)")
    p.add_argument("--smoke", action="store_true", help="small full-size config + cost model + one tiny live rep")
    p.add_argument("--out-dir", default=DEFAULT_OUT, help="results/ and img/ go here (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG pictures")
    p.add_argument("--report", metavar="JSON", help="re-print the tables and redraw the pictures of saved results "
                                                     "(benchmarks/results/full_size.json or live.json); runs nothing")
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stderr)     # above any progress bar being drawn


def cmd_bench(args) -> int:
    from .fullsize import run_cli_only, run_full_size, run_full_size_config, save_json
    from .report import markdown_cli, markdown_full_size, markdown_live, plot_full_size, plot_live
    budget = int(args.budget_mib * (1 << 20))
    out_dir = Path(args.out_dir)
    if args.in_process:     # one full-size configuration, called by run_full_size
        res = [run_full_size_config(n, budget, args.memory, partial=args.json + ".partial")
               for n in args.configs.split(",") if n]
        with open(args.json, "w") as f:
            json.dump(res, f)
        return 0
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        live = bool(data) and "methods" in data[0]
        if not args.no_plots:
            if live:
                plot_live(data, out_dir / "img")
            else:
                for r in data:
                    if "matrix" in r:
                        plot_full_size(r, out_dir / "img")
        print(markdown_live(data) if live else markdown_full_size(data))
        return 0
    if args.cli and not args.full_size:
        names = [n for n in args.configs.split(",") if n]
        unknown = [n for n in names if n not in CONFIGS]
        if unknown:
            _log(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
            return 2
        rows = run_cli_only(names, args.timeout, log=_log)
        save_json(out_dir / "results" / "cli.json", rows)
        print(markdown_cli(rows))
        return 1 if any("error" in r["cli"] for r in rows) else 0
    if not (args.full_size or args.live or args.smoke):
        _log("nothing to do: pass --full-size, --cli, --live and/or --smoke")
        return 2
    status = 0
    report = []
    if args.full_size or args.smoke:
        names = ["small"] if args.smoke and not args.full_size else [n for n in args.configs.split(",") if n]
        for n in names:
            if n not in CONFIGS:
                _log(f"unknown configuration {n!r}; known: {', '.join(CONFIGS)}")
                return 2
        tag = "smoke" if args.smoke and not args.full_size else "full_size"
        results = run_full_size(names, budget, "tracemalloc" if args.smoke and not args.full_size else args.memory,
                                args.timeout, log=_log, max_mem_gib=args.max_mem_gib,
                                progress=out_dir / "results" / f"{tag}.json", cli=not args.no_cli)
        save_json(out_dir / "results" / f"{tag}.json", results)
        if not args.no_plots:
            for r in results:
                if "error" not in r:
                    plot_full_size(r, out_dir / "img")
        report.append(markdown_full_size(results))
        if any("error" in r for r in results):
            status = 1
        for r in results:
            if "error" not in r and not (r["plan"]["network_bytes"] == r["plan"]["lower_bound_bytes"] == r["layout_lower_bound"]):
                status = 1
    if args.live or args.smoke:
        from .live import CASES, run_live
        sizes = ["tiny"] if args.smoke and not args.live else [s for s in args.sizes.split(",") if s]
        reps = 1 if args.smoke and not args.live else args.reps
        cases = [c for c in args.cases.split(";") if c] if args.cases else list(CASES)
        tag = "live_smoke" if args.smoke and not args.live else "live"
        rows = []
        from ...util.progress import bar
        for size in bar(sizes, desc="live sizes", unit="size"):   # one launch per size: a size that does not fit leaves the others' results
            _log(f"[bench] live {size}: cases {cases}, {reps} rep(s) after one warm-up, 4 processes")
            t0 = time.perf_counter()
            load = os.getloadavg()[0]
            try:
                got = run_live([size], cases, reps=reps, budget=budget, dtype=args.dtype, timeout=args.timeout,
                               methods=[m for m in args.methods.split(",") if m] if args.methods else None)
            except Exception as e:  # noqa: BLE001 - reported, the other sizes still run
                _log(f"[bench] live {size} failed: {str(e)[-2000:]}")
                status = 1
                continue
            for row in got:
                row.update(loadavg_before=load, cpus=os.cpu_count(), dtype=args.dtype, budget_bytes=budget)
            rows += got
            _log(f"[bench] live {size} done in {time.perf_counter() - t0:.0f} s")
            save_json(out_dir / "results" / f"{tag}.json", rows)
        if not args.no_plots and not (args.smoke and not args.live):
            plot_live(rows, out_dir / "img")
        report.append(markdown_live(rows))
        if not all(e.get("bit_exact", True) for r in rows for m, e in r["methods"].items() if m != "megatron_resharding_unpatched"):
            status = 1
    print("\n\n".join(report))
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_reshard.tools.bench", description=__doc__.split("\n\n")[0])
    _add_args(parser)
    args = parser.parse_args(argv)
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())

