"""``mcore-reshard`` command line."""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

DESCRIPTION = """\
Reshard live Megatron-Core weights shard to shard between parallel layouts.

  demo   launch local gloo processes, reshard a synthetic model (fused QKV, [gate; up], experts,
         vocab padding, an uneven tensor) from one layout to another, check every destination
         tensor bit for bit, and print bytes moved vs the lower bound, messages and time.
  plan     plan a refit without moving anything: bytes vs the lower bound vs gather+broadcast,
           per-rank load, messages, rounds, staging; write the plan as JSON.
  explain  for one tensor: which rank sends which region to which rank.
  bench    full-size DeepSeek-V3 plans with a cost model, live CPU runs side by side with
           megatron.core.resharding and gather+broadcast, pictures (see BENCHMARKS.md).

Layout strings (see docs/layout-strings.md):
  tp=2,pp=16,ep=64  or  megatron:tp=2,pp=16,ep=64   Megatron-Core (keys tp pp cp ep etp dp vpp first last)
  vllm:tp=8,dp=2,ep                                   vLLM (ep = enable_expert_parallel)
  sglang:tp=16,dp=16,ep=16,dpattn                     SGLang (dpattn = DP attention)
  hf                                                  Hugging Face, whole model on one rank
The demo's synthetic model takes Megatron strings only: "tp=2,pp=2,ep=2,etp=1,dp=1".
"""

#: ``--model`` name -> "module:function" (relative to mcore_reshard) making its ModelConfig
PRESETS = {
    "dsv3-671b": "targets:dsv3_671b", "dsv3-tiny": "targets:dsv3_tiny", "llama-tiny": "targets:gqa_tiny",
    "qwen3-moe-tiny": "targets:qwen3_moe_tiny", "kimi-k2-1t": "tools.bench.configs:kimi_k2_1t",
}


def model_preset(name: str):
    """The ModelConfig of ``--model name`` (:data:`PRESETS`)."""
    import importlib
    module, _, function = PRESETS[name].partition(":")
    return getattr(importlib.import_module(f"mcore_reshard.{module}"), function)()


def _positive(kind):
    """An argparse type: a finite number > 0 of ``kind`` (argparse's error then names the option)."""
    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not math.isfinite(v) or v <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be a finite number > 0")
        return v
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _add_layout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--src", default="tp=2,ep=2,etp=1,pp=2", help="source layout (default: %(default)s)")
    p.add_argument("--dst", default="tp=4", help="destination layout (default: %(default)s)")
    p.add_argument("--colocated", action="store_true",
                   help="destination on the same ranks as the source (default: disaggregated, ranks after the source's)")
    p.add_argument("--scale", type=_positive(int), default=1, help="multiply the synthetic model's widths by this (default: 1)")
    p.add_argument("--budget-mib", type=_positive(float), default=256.0, help="staging budget per rank and round, MiB (default: 256)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="source dtype")
    p.add_argument("--dst-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="destination dtype (differs from --dtype: cast on the receiver)")


#: a Hugging Face config.json field the layouts cannot do without (a whole number >= 1)
REQUIRED_CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
#: most ranks a layout string may take (a typo such as dp=1000000 would otherwise build for hours)
MAX_WORLD = 1 << 16


def _families() -> str:
    """'deepseek_v3 (model_type deepseek_v3, deepseek_v2), llama (...), ...'."""
    from ..targets.config import FAMILY_OF_MODEL_TYPE
    by_family: dict[str, list[str]] = {}
    for model_type, family in FAMILY_OF_MODEL_TYPE.items():
        by_family.setdefault(family, []).append(model_type)
    return ", ".join(f"{f} (model_type {', '.join(ts)})" for f, ts in sorted(by_family.items()))


def _model_config(args):
    from .. import targets
    if args.config:
        from ..targets.config import FAMILY_OF_MODEL_TYPE
        with open(args.config) as f:
            try:
                config = json.load(f)
            except ValueError as e:
                raise ValueError(f"--config {args.config}: not a JSON config: {e}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--config {args.config}: a JSON {type(config).__name__}, not a config object")
        model_type = config.get("model_type")
        if model_type not in FAMILY_OF_MODEL_TYPE:
            raise ValueError(f"--config {args.config}: model_type {model_type!r} is of no family this tool knows; "
                             f"the families there are: {_families()}")
        bad = [k for k in REQUIRED_CONFIG_FIELDS
               if not (type(config.get(k)) is int and config[k] >= 1)]
        if bad:
            raise ValueError(f"--config {args.config}: " + ", ".join(
                f"{k} {'missing' if k not in config else repr(config[k])}" for k in bad)
                + f"; a {model_type} config.json gives each of {', '.join(REQUIRED_CONFIG_FIELDS)} as a whole "
                "number >= 1")
        try:
            return targets.from_hf_config(config)
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"--config {args.config}: {type(e).__name__}: {e}") from None
    return model_preset(args.model)


def _model_name(args) -> str:
    return args.config if args.config else args.model


def _check_layout_options(args) -> dict:
    """``--src`` / ``--dst`` parsed once up front, so that a bad string is an error naming its
    option and the bad part (the grammar: :data:`.layout_strings.GRAMMAR`): option -> LayoutSpec."""
    from . import layout_strings
    specs = {}
    for option, text in (("--src", args.src), ("--dst", args.dst)):
        try:
            specs[option] = spec = layout_strings.parse(text)
            world = spec.world()
        except ValueError as e:
            raise ValueError(f"{option} {text!r}: {e}") from None
        if world > MAX_WORLD:
            raise ValueError(f"{option} {text!r}: {world:,} ranks; this tool plans at most {MAX_WORLD:,}")
    return specs


def _synthetic_sizes(args) -> None:
    """The synthetic model's layouts take Megatron strings only: each option checked on its own."""
    from .synthetic import parse_parallel
    for option, text in (("--src", args.src), ("--dst", args.dst)):
        try:
            parse_parallel(text)
        except ValueError as e:
            raise ValueError(f"{option} {text!r}: {e}") from None


def _source_fits(args, spec, cfg) -> None:
    """A Megatron source's expert parallelism against its world and its layers against its pipeline
    stages, checked before anything is built; a ValueError naming the fix, with numbers for ``cfg``."""
    from . import layout_fixes, layout_strings
    sizes = layout_strings.megatron_sizes(spec)
    fix = layout_fixes.expert_dp_fix(sizes)
    if fix:
        raise ValueError(f"--src {args.src!r}: world {sizes.world} = tp*pp*cp*dp is not a multiple of "
                         f"etp*ep*pp = {sizes.etp}*{sizes.ep}*{sizes.pp}; fits: {fix}")
    layers = cfg.num_hidden_layers
    fix = layout_fixes.stage_fix(layers, spec)
    if fix:
        what = (f"{layers} layers do not divide over pp={sizes.pp} x vpp={sizes.vpp}"
                if sizes.first_stage_layers is None and sizes.last_stage_layers is None else
                f"{layers} layers cannot be split as first={sizes.first_stage_layers} "
                f"last={sizes.last_stage_layers} over pp={sizes.pp}")
        raise ValueError(f"--src {args.src!r}: {what} ({_model_name(args)}); what fits (first= / last=: layers on "
                         f"the first / last pipeline stage): {fix}")


def _build(option: str, text: str, spec, cfg, args, rank_offset: int, dtype: str):
    """The layout of ``spec`` for ``cfg``; a size that does not fit the model is an error naming the
    sizes that do (:func:`.layout_fixes.fix_text`)."""
    from . import layout_fixes, layout_strings
    try:
        return layout_strings.build(spec, cfg, rank_offset, dtype)
    except ValueError as e:
        raise ValueError(f"{option} {text!r}: {e}{layout_fixes.fix_text(spec, cfg, _model_name(args))}") from None


def _layouts(args, steps):
    """(source, destination) layouts for the plan/explain commands."""
    specs = _check_layout_options(args)
    if args.model == "synthetic" and not args.config:
        from .demo import build_layouts
        _synthetic_sizes(args)
        steps.step("synthetic layouts")
        try:
            return build_layouts(args.src, args.dst, args.colocated, args.scale, args.dtype, args.dst_dtype)
        except ValueError as e:   # the builder sees both strings: name the options it was given
            raise ValueError(f"--src {args.src!r} / --dst {args.dst!r}: {e}") from None
    cfg = _model_config(args)
    src_spec, dst_spec = specs["--src"], specs["--dst"]
    if src_spec.engine != "megatron":
        raise ValueError(f"--src {args.src!r}: the source must be a Megatron layout (e.g. 'tp=2,pp=2'), "
                         f"not {src_spec.engine}")
    _source_fits(args, src_spec, cfg)
    steps.step(f"source layout {args.src} of {_model_name(args)}")
    src = _build("--src", args.src, src_spec, cfg, args, 0, args.dtype)
    offset = 0 if args.colocated else src_spec.world()
    steps.step(f"destination layout {args.dst}")
    dst = _build("--dst", args.dst, dst_spec, cfg, args, offset, args.dst_dtype or args.dtype)
    return src, dst


def _gather_broadcast_bytes(plan, traffic) -> int:
    """What a Bridge-style export moves: every destination rank receives whole tensors for each
    tensor it holds a piece of (after a gather on the source side, not counted): the plan's
    :func:`~mcore_reshard.core.planner.plan_traffic` ``received_bytes``."""
    return traffic.received_bytes


def _plan(args):
    from ..core.planner import make_plan
    from ..util.progress import Steps
    synthetic = args.model == "synthetic" and not args.config
    with Steps(3 if synthetic else 4, args.command) as steps:
        t0, c0 = time.perf_counter(), time.process_time()
        src, dst = _layouts(args, steps)
        args.layouts_s, args.layouts_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        steps.step(f"planning {len(src.tensors)} tensors, {len(src.ranks)} -> {len(dst.ranks)} ranks")
        t0, c0 = time.perf_counter(), time.process_time()
        topology = None
        if getattr(args, "two_level", False):
            from .costmodel import preset
            topology = preset(args.hardware).topology       # its NVLink domain size
        plan = make_plan(src, dst, budget_bytes=int(args.budget_mib * (1 << 20)),
                         allow_cast=args.dst_dtype not in (None, args.dtype), ignore_unused=True, topology=topology)
        seconds, args.plan_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        steps.step("summary")
    return src, dst, plan, seconds


def cmd_plan_fp8(args) -> int:
    """``plan --fp8 128``: the destination in block-FP8 (scales included), quantized in transit."""
    from ..fp8.quant_layout import fp8_target
    from ..fp8.quant_plan import make_fp8_plan, quantized_tensors
    from ..util.progress import Steps
    if args.model == "synthetic" and not args.config:
        raise ValueError("--fp8 needs a model preset or --config (which tensors are quantized is family knowledge)")
    block = (args.fp8, args.fp8)
    with Steps(3, "plan --fp8") as steps:
        src, dst = _layouts(args, steps)
        dst = fp8_target(dst, quantized_tensors(dst, _model_config(args).family, block), block)
        steps.step(f"planning FP8 {block[0]}x{block[1]}: {len(src.tensors)} tensors, {len(src.ranks)} -> {len(dst.ranks)} ranks")
        t0 = time.perf_counter()
        plan = make_fp8_plan(src, dst, block, budget_bytes=int(args.budget_mib * (1 << 20)),
                             allow_cast=args.dst_dtype not in (None, args.dtype), ignore_unused=True)
    _header(args, src, dst, plan, " in FP8")
    print(f"plan hash          {plan.hash[:16]}  built in {time.perf_counter() - t0:.3f} s")
    _write(args, plan)
    return 0


def _header(args, src, dst, plan, what: str = "") -> None:
    print(f"source {args.src} ({len(src.ranks)} ranks) -> destination {args.dst}{what} ({len(dst.ranks)} ranks, "
          f"{'colocated' if args.colocated else 'disaggregated'})")
    print(plan.summary())


def _write(args, plan) -> None:
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.dumps())
        print(f"plan written to {args.out}")


def cmd_plan(args) -> int:
    from ..core.gcpause import paused_gc
    with paused_gc():       # layouts, plan and report: millions of acyclic objects, no garbage cycles
        return _cmd_plan(args)


def _cmd_plan(args) -> int:
    if getattr(args, "fp8", None):
        return cmd_plan_fp8(args)
    src, dst, plan, seconds = _plan(args)
    from ..core.planner import plan_traffic
    s = plan.stats
    _header(args, src, dst, plan)
    traffic = plan_traffic(plan)        # totals only: a templated plan's copies are never made
    gb = _gather_broadcast_bytes(plan, traffic)
    print(f"gather+broadcast   {gb:,} B to destinations ({gb / max(1, s['network_bytes'] + s['local_bytes']):.2f}x this plan's bytes)")
    senders = max(1, sum(1 for v in s["sent_bytes"].values() if v))
    receivers = max(1, sum(1 for v in s["recv_bytes"].values() if v))
    print(f"mean sent / sender {s['network_bytes'] / senders:,.0f} ({senders} senders)  "
          f"mean received / receiver {s['network_bytes'] / receivers:,.0f} ({receivers} receivers)")
    if s.get("unused_tensors"):
        print(f"not in target      {len(s['unused_tensors'])} source tensors (e.g. {s['unused_tensors'][0]})")
    from .costmodel import predict, preset
    if "hierarchical_bound_bytes" in s:
        print(f"two-level          NIC {s['nic_bytes']:,} B (hierarchical bound {s['hierarchical_bound_bytes']:,}), "
              f"NVLink {s['nvlink_bytes']:,} B, forwarded {s['forwarded_bytes']:,} B (domains of "
              f"{preset(args.hardware).gpus_per_domain})")
    pred = predict(plan, preset(args.hardware), traffic=traffic, with_paced=False)
    print(f"predicted refit    {pred['seconds']:.3f} s on {args.hardware} (link-bound limit {pred['link_bound_s']:.3f} s)")
    print(f"plan hash          {plan.hash[:16]}  built in {seconds:.3f} s ({args.plan_cpu_s:.3f} s CPU) from "
          f"layouts built in {args.layouts_s:.3f} s ({args.layouts_cpu_s:.3f} s CPU)")
    if args.heatmap:
        _heatmap(plan.ranks, traffic, args.heatmap)
        print(f"traffic heatmap written to {args.heatmap}")
    _write(args, plan)
    return 0


def _heatmap(ranks: list[int], traffic, path: str) -> None:
    """Sender x receiver bytes of a plan (its :func:`~mcore_reshard.core.planner.plan_traffic`) as a
    PNG (matplotlib, Agg)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from .costmodel import parts_arrays
    pos = np.full(traffic.span, -1)
    pos[ranks] = np.arange(len(ranks))
    grid = np.zeros((len(ranks), len(ranks)))
    parts = parts_arrays(traffic)
    np.add.at(grid, (pos[parts.src], pos[parts.dst]), parts.payload)
    for (s, d), n in traffic.local_bytes.items():
        grid[pos[s], pos[d]] += n
    fig, ax = plt.subplots(figsize=(6, 5))
    im = ax.imshow(grid, cmap="viridis", interpolation="nearest")
    ax.set_xlabel("receiving rank")
    ax.set_ylabel("sending rank")
    ax.set_title("bytes per (sender, receiver); diagonal = local copies")
    fig.colorbar(im, ax=ax, label="bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_explain(args) -> int:
    _, _, plan, _ = _plan(args)
    if args.name not in plan.tensors:
        close = [n for n in plan.tensors if args.name in n][:10]
        print(f"mcore-reshard explain: error: argument name: no tensor {args.name!r} in the plan" + (f"; similar: {', '.join(close)}" if close else ""), file=sys.stderr)
        return 2
    meta = plan.tensors[args.name]
    print(f"{args.name}  shape {meta['shape']}  {meta['src_dtype']} -> {meta['dst_dtype']}")
    print(f"{'kind':5} {'round':>5} {'from':>5} -> {'to':<5} {'global box':28} {'source buffer[local]':48} {'destination buffer[local]':48} {'bytes':>10}")
    rows = [("local", "-", c) for c in plan.local_copies if c.tensor == args.name]
    rows += [("send", str(m.round), c) for m in plan.messages for c in m.entries if c.tensor == args.name]
    for kind, rnd, c in sorted(rows, key=lambda x: (x[2].dst, x[2].box)):
        print(f"{kind:5} {rnd:>5} {c.src:>5} -> {c.dst:<5} {str(c.box):28} {c.src_buffer + str(c.src_local):48} "
              f"{c.dst_buffer + str(c.dst_local):48} {c.nbytes:>10,}")
    pads = [(r, b, box) for r, b, box in plan.padding]
    if pads:
        print(f"({len(pads)} padding region(s) in destination buffers are zero-filled)")
    return 0


def cmd_demo(args) -> int:
    _check_layout_options(args)
    _synthetic_sizes(args)
    from .demo import demo_worker, world_needed
    from .launch import spawn
    world = world_needed(args.src, args.dst, args.colocated)
    from ..util.progress import Steps
    with Steps(2, "demo") as steps:
        steps.step(f"launching {world} gloo processes: {args.src} -> {args.dst} "
                   f"({'colocated' if args.colocated else 'disaggregated'}), {args.reps} refits")
        t0 = time.perf_counter()
        results = spawn(demo_worker, world, args.src, args.dst, args.colocated, args.scale,
                        int(args.budget_mib * (1 << 20)), args.reps, args.dtype, args.dst_dtype, timeout=args.timeout)
        steps.step(f"all ranks done in {time.perf_counter() - t0:.1f} s")
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
    import statistics
    print(f"refit time         median {statistics.median(times) * 1e3:.1f} ms over {args.reps} refits "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    print(f"staging per rank   max {max(r['staging_bytes'] for r in results):,} B")
    print(f"bit-exact          {'yes' if bad == 0 else f'NO: {bad} tensor mismatches'} "
          f"({sum(r['dst_tensors'] for r in results)} destination tensors x {args.reps} refits); "
          f"destination storage {'unchanged' if all(r['same_storage'] for r in results) else 'MOVED'}")
    if args.json:
        print(json.dumps({"stats": stats, "times": times, "mismatches": bad}))
    return 0 if ok else 1


def _add_global_args(p: argparse.ArgumentParser, default) -> None:
    """The options every command takes, before or after its name (``mcore-reshard --progress never
    plan ...`` = ``mcore-reshard plan ... --progress never``): on the main parser with their default,
    on each subparser with ``argparse.SUPPRESS`` (given there, it overrides; not given, the main
    parser's value stands)."""
    p.add_argument("--progress", choices=["auto", "always", "never"], default=default,
                   help="progress bars on stderr: auto = only on a terminal (default; also "
                        "MCORE_RESHARD_PROGRESS), always, never")


def main(argv: list[str] | None = None) -> int:
    """The ``mcore-reshard`` command.  Third-party notices no one can act on (:mod:`..util.notices`)
    go to a log file, one line at the end says where; every other warning shows."""
    from ..util import notices
    with notices.captured() as kept:
        try:
            return _main(argv)
        finally:
            line = kept.summary()
            if line:
                print(f"[mcore-reshard] {line}", file=sys.stderr)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="mcore-reshard", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_global_args(parser, None)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="reshard a synthetic model on local gloo processes and check it bit for bit")
    _add_layout_args(p)
    p.add_argument("--reps", type=_positive(int), default=3, help="refits to run (new weights each time; default: 3)")
    p.add_argument("--timeout", type=_positive(float), default=600, help="give up after this many seconds (default: 600)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    p.set_defaults(func=cmd_demo)
    for name, func, text in (("plan", cmd_plan, "compute and summarise a plan (no processes, no data)"),
                             ("explain", cmd_explain, "show how one tensor moves: ranks, regions, bytes")):
        p = sub.add_parser(name, help=text)
        if name == "explain":
            p.add_argument("name", help="canonical (Hugging Face) tensor name, e.g. model.layers.3.mlp.experts.gate_up_proj")
        _add_layout_args(p)
        p.add_argument("--model", default="synthetic", choices=["synthetic"] + sorted(PRESETS),
                       help="model preset (default: the demo's synthetic model)")
        p.add_argument("--config", help="a Hugging Face config.json instead of a preset")
        if name == "plan":
            p.add_argument("--out", help="write the plan as JSON to this file")
            p.add_argument("--heatmap", help="write the sender x receiver traffic heatmap as PNG to this file")
            p.add_argument("--fp8", type=_positive(int), metavar="BLOCK", help="quantize in transit to block-FP8 with BLOCKxBLOCK "
                           "scales (e.g. 128, DeepSeek-V3's format); prints assembly, FP8 and BF16 bytes")
            p.add_argument("--hardware", default="dgx_h100", choices=["dgx_h100", "gb200_nvl72", "gb200_nvl72_800g"],
                           help="hardware preset for the predicted refit time (default: dgx_h100)")
            p.add_argument("--two-level", action="store_true", help="plan in two levels (NVLink domain / NIC) for the "
                           "--hardware preset's NVLink domain size: what several receivers of a domain need crosses the "
                           "network once and is forwarded inside the domain")
        p.set_defaults(func=func)
    from .bench import add_bench_parser
    add_bench_parser(sub)
    for p in sub.choices.values():      # global options also after the subcommand
        _add_global_args(p, argparse.SUPPRESS)
    args = parser.parse_args(argv)
    from ..util import progress
    if args.progress:
        progress.set_mode(args.progress)
    from ..core.layout import LayoutError
    from ..core.planner import PlanError
    try:
        return args.func(args)
    except (ValueError, LayoutError, PlanError) as e:   # bad input: one clear line, no traceback
        print(f"mcore-reshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:       # a file named by an option (--config, --out, --heatmap) cannot be read or written
        print(f"mcore-reshard {args.command}: error: {e.strerror or e}: {e.filename!r} (check --config / --out / "
              f"--heatmap)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
