"""Markdown tables and PNG pictures of full-size and live results."""
from __future__ import annotations

from pathlib import Path

# ----------------------------------------------------------------------------------- pictures

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_full_size(res: dict, img_dir: Path) -> list[str]:
    """Traffic heatmap (sender x receiver group) and per-rank load bars of one configuration."""
    plt = _plt()
    import numpy as np
    img_dir.mkdir(parents=True, exist_ok=True)
    files = []
    mat = np.array(res["matrix"], dtype=float) / 1e9
    g = res["matrix_group"]
    fig, ax = plt.subplots(figsize=(6.4, 5.4), dpi=110)
    from matplotlib.colors import LogNorm
    shown = np.where(mat > 0, mat, np.nan)
    pos = mat[mat > 0]
    norm = LogNorm(vmin=pos.min(), vmax=pos.max()) if pos.size and pos.max() > 10 * pos.min() else None
    im = ax.imshow(shown, cmap="viridis", interpolation="nearest", origin="upper", norm=norm)
    fig.colorbar(im, ax=ax, label="GB sent")
    unit = "rank" if g == 1 else f"node ({g} ranks)"
    ax.set_xlabel(f"receiver {unit}")
    ax.set_ylabel(f"sender {unit}")
    ax.set_title(f"{res['name']}: network bytes, {res['ranks']} ranks", fontsize=10)
    fig.tight_layout()
    p = img_dir / f"{res['name']}_traffic.png"
    fig.savefig(p)
    plt.close(fig)
    files.append(str(p))
    pr = res["per_rank"]
    ranks = pr["ranks"]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    sent = np.array(pr["sent"], dtype=float) / 1e9
    recv = np.array(pr["recv"], dtype=float) / 1e9
    ax.bar(ranks, sent, width=1.0, color="tab:blue", label="sent (plan)")
    ax.bar(ranks, -recv, width=1.0, color="tab:orange", label="received (plan)")
    bmax = res["baseline"]["recv"]["max"] / 1e9
    if bmax:
        ax.axhline(-bmax, color="tab:red", lw=1, ls="--",
                   label=f"gather+broadcast: max received per rank ({bmax:.3g} GB)")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("rank")
    ax.set_ylabel("GB (received below 0)")
    ax.set_title(f"{res['name']}: bytes per rank", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    p = img_dir / f"{res['name']}_load.png"
    fig.savefig(p)
    plt.close(fig)
    files.append(str(p))
    return files


def plot_live(rows: list[dict], img_dir: Path) -> list[str]:
    plt = _plt()
    img_dir.mkdir(parents=True, exist_ok=True)
    cases = sorted({r["case"] for r in rows})
    methods = [m for m in ("mcore_reshard", "megatron_resharding", "gather_broadcast", "floor")
               if any(m in r["methods"] for r in rows)]
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 3.8), dpi=110, squeeze=False)
    colors = {"mcore_reshard": "tab:green", "megatron_resharding": "tab:blue", "gather_broadcast": "tab:red", "floor": "tab:gray"}
    for ax, case in zip(axes[0], cases):
        sub = [r for r in rows if r["case"] == case]
        xs = range(len(sub))
        w = 0.8 / max(len(methods), 1)
        for k, m in enumerate(methods):
            med = [r["methods"].get(m, {}).get("median_s", 0) for r in sub]
            lo = [med[i] - r["methods"].get(m, {}).get("min_s", 0) for i, r in enumerate(sub)]
            hi = [r["methods"].get(m, {}).get("max_s", 0) - med[i] for i, r in enumerate(sub)]
            ax.bar([x + (k - (len(methods) - 1) / 2) * w for x in xs], med, w, yerr=[lo, hi], capsize=2,
                   color=colors[m], label=m)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['size']}\n({r['params'] / 1e6:.0f}M)" for r in sub])
        ax.set_ylabel("refit time, s (median, min-max)")
        ax.set_title(case, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = img_dir / "live_times.png"
    fig.savefig(p)
    plt.close(fig)
    return [str(p)]


# ----------------------------------------------------------------------------------- tables

def _gb(n) -> str:
    return f"{n / 1e9:,.1f}" if n >= 1e8 else f"{n / 1e9:.3f}"


def _s(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x * 1e3:.2f} ms"


def _mib(n) -> str:
    return f"{n / 2**20:,.0f}" if n is not None else "-"


def cli_cell(r: dict) -> str:
    """``mcore-reshard plan``'s wall / its own plan build time (and peak RSS) of one result, or '-'."""
    c = r.get("cli")
    if not c:
        return "-"
    if "error" in c:
        return f"failed: {c['error'][:60]}"
    return (f"{c['wall_s']:.1f} / {c['plan_s']:.1f} = **{c['wall_over_plan']:.2f}x**; CPU {c['cpu_s']:.1f} / "
            f"{c['plan_cpu_s']:.1f} = **{c['cpu_over_plan_cpu']:.2f}x** (layouts {c['layouts_cpu_s']:.1f}; "
            f"{c['max_rss_bytes'] / 2**20:,.0f} MiB)")


def markdown_cli(rows: list[dict]) -> str:
    """``mcore-reshard bench --cli``: one line per configuration."""
    lines = ["| config | CLI / plan build: wall s, CPU s (layouts CPU s; peak RSS) | command |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {cli_cell(r)} | `{r['cli'].get('command', '')}` |")
    return "\n".join(lines)


def markdown_full_size(results: list[dict]) -> str:
    lines = ["| config | ranks | model GB | plan GB (= lower bound?) | gather+bcast GB | ratio | send max / mean GB |"
             " recv max / mean GB | g+b recv max GB | messages | rounds (lower bound) | staging MiB/rank |"
             " plan s (whole / one rank's part) | plan MiB | CLI / plan build: wall, CPU s (layouts; RSS) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            if "baseline" not in r:
                lines.append(f"| {r['name']} | | | {r['error']} | | | | | | | | | | | |")
                continue
            b = r["baseline"]
            lb = r["lower_bound_per_rank"]
            lines.append(
                f"| {r['name']} | {r['src_ranks']}->{r['dst_ranks']}{' (coloc.)' if r['colocated'] else ''} | "
                f"{_gb(r['model_bytes'])} | no plan ({r['error']}); lower bound {_gb(r['layout_lower_bound'])} | "
                f"{_gb(b['bytes'])} | {b['bytes'] / max(r['layout_lower_bound'], 1):.1f}x (vs lower bound) | - | "
                f"{_gb(lb['max'])} / {_gb(lb['mean'])} (lower bound) | {_gb(b['recv']['max'])} | - | - | - | - | - | "
                f"{cli_cell(r)} |")
            continue
        p, b = r["plan"], r["baseline"]
        eq = "yes" if p["network_bytes"] == p["lower_bound_bytes"] == r["layout_lower_bound"] else "NO"
        mem = r.get("plan_tracemalloc_peak") or r.get("plan_rss_peak_added")
        lines.append(
            f"| {r['name']} | {r['src_ranks']}->{r['dst_ranks']}{' (coloc.)' if r['colocated'] else ''} | "
            f"{_gb(r['model_bytes'])} | {_gb(p['network_bytes'])} ({eq}) | {_gb(b['bytes'])} | "
            f"{b['bytes'] / max(p['network_bytes'], 1):.1f}x | {_gb(p['send']['max'])} / {_gb(p['send']['mean'])} | "
            f"{_gb(p['recv']['max'])} / {_gb(p['recv']['mean'])} | {_gb(b['recv']['max'])} | {p['messages']:,} | "
            f"{p['rounds']} ({p.get('rounds_lower_bound', '-')}) | {_mib(p.get('max_stage_bytes'))} | "
            f"{r['plan_s']:.1f} / {r['plan_s'] + r.get('plan_part_s', 0):.1f} | {_mib(mem)} | {cli_cell(r)} |")
    lines += ["", "| config | topology | predicted s | link bound s | NVLink fan-out: predicted s | link bound s | "
              "NIC GB saved | gather+bcast model s | published |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "cost" not in r:
            continue
        c = r["cost"][r["topology"]]
        pub = "; ".join(f"{a}: {b}" for a, b in r.get("published", [])) or "-"
        lines.append(f"| {r['name']} | {c['topology']} | {_s(c['predicted_s'])} | {_s(c['link_bound_s'])} | "
                     f"{_s(c['hier_predicted_s'])} | {_s(c['hier_link_bound_s'])} | {_gb(c['hier_nic_bytes_saved'])} | "
                     f"{_s(r['baseline']['model']['seconds'])} | {pub} |")
    return "\n".join(lines)


def markdown_live(rows: list[dict]) -> str:
    lines = ["| size (params) | case | method | median s | min-max s | time / mcore_reshard | time / floor | bytes sent | "
             "bytes / lower bound | messages | peak added MiB/rank | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["methods"].get("mcore_reshard", {}).get("median_s")
        lb = r["methods"].get("mcore_reshard", {}).get("lower_bound")
        floor = r["methods"].get("floor", {}).get("median_s")
        for m, e in r["methods"].items():
            if "median_s" not in e:
                ex = "yes" if e.get("bit_exact") else f"NO ({e.get('differ')} of {e.get('tensors')} tensors differ)"
                if "error" in e:
                    ex = "error: " + e["error"][:80]
                lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['case']} | {m} (as shipped) | - | - | - | - | - | - "
                             f"| - | - | {ex} |")
                continue
            ratio = f"{e['median_s'] / ours:.2f}x" if ours else "-"
            vs_floor = f"{e['median_s'] / floor:.2f}x" if floor else "-"
            ex = "yes" if e.get("bit_exact") else f"NO ({e.get('differ')} of {e.get('tensors')} differ)"
            if m == "floor":
                ex = "n/a (bare transport)"
            elif m == "floor_local":
                ex = "n/a (bare transport + local copies)"
            extra = f" ({e['rounds']} round(s))" if m.startswith("mcore_reshard") else ""
            vs_lb = f"{e['bytes'] / lb:.2f}" if lb else "-"
            lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['case']} | {m} | {e['median_s']:.3f} | "
                         f"{e['min_s']:.3f}-{e['max_s']:.3f} | {ratio} | {vs_floor} | {e['bytes'] / 1e6:,.1f} MB | {vs_lb} | "
                         f"{e['messages']:,}{extra} | {_mib(e['peak_added_bytes'])} | {ex} |")
    return "\n".join(lines)

