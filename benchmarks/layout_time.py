"""Time building a full-size configuration's layouts (and, for the 256-rank ones, merging them back
from one JSON part per rank as MegatronRefit does), with the reference loop timed in the same process.

    python benchmarks/layout_time.py nccl_m2n      # one JSON line: layout_s, layout_cpu_s, merge_s, loop_s

BENCHMARKS.md A.2 (layouts built with the collector paused)."""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan_time as pt  # noqa: E402

MERGED = ("nccl_m2n", "nemo_rl_ep")     # the others: 1-2 k parts declaring every tensor each take minutes to make


def main(name: str) -> dict:
    loop = pt.loop_s()
    c0, w0 = time.process_time(), time.perf_counter()
    src, dst = pt.build(name)
    w, c = time.perf_counter() - w0, time.process_time() - c0
    a = b = 0.0
    if name in MERGED:
        (_, a), (_, b) = pt.via_json(src), pt.via_json(dst)
    return {"name": name, "layout_s": round(w, 3), "layout_cpu_s": round(c, 3), "merge_s": round(a + b, 3),
            "loop_s": round(loop[0], 3), "layout_x_loop": round(w / loop[0], 2), "merge_x_loop": round((a + b) / loop[0], 2)}


if __name__ == "__main__":
    for n in sys.argv[1:]:
        print(json.dumps(main(n)))
