"""Time per copy: a Python loop of ``copy_`` vs one ``torch._foreach_copy_`` over the same views
(what the executor's pack / unpack / local copies do; BENCHMARKS.md C.3).

    python benchmarks/copy_calls.py            # CPU (one thread), and CUDA when present

Views: n contiguous rows of a bf16 source copied into consecutive slices of a flat staging buffer,
and the same for strided sources (a column slice of each row block: a TP shard's view).
"""
from __future__ import annotations

import json
import sys
import time

import torch


def bench(n: int, elems: int, strided: bool, device: str, reps: int = 3) -> dict:
    width = 2 * elems if strided else elems
    src = torch.randn(n, width, device=device).to(torch.bfloat16)
    stage = torch.empty(n * elems, dtype=torch.bfloat16, device=device)
    srcs = [src[i, :elems] for i in range(n)]
    dsts = [stage[i * elems:(i + 1) * elems] for i in range(n)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    best = {"loop": float("inf"), "foreach": float("inf")}
    for _ in range(reps):
        for name in best:
            sync()
            t = time.perf_counter()
            if name == "loop":
                for d, s in zip(dsts, srcs):
                    d.copy_(s)
            else:
                torch._foreach_copy_(dsts, srcs)
            sync()
            best[name] = min(best[name], time.perf_counter() - t)
    assert torch.equal(stage.view(n, elems), src[:, :elems])
    return {"device": device, "copies": n, "bytes_per_copy": 2 * elems, "strided": strided,
            "loop_us_per_copy": best["loop"] / n * 1e6, "foreach_us_per_copy": best["foreach"] / n * 1e6}


def main() -> int:
    torch.set_num_threads(1)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    rows = [bench(n, e, s, d) for d in devices for n, e in ((22000, 64), (2000, 4096), (200, 65536))
            for s in (False, True)]
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
