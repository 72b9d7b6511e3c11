"""Smoke of ``benchmarks/colocated_bench.py`` at the tiny size, Megatron TP2 x EP2 (4 trainer ranks,
2 of them with a vLLM TP2 worker on their device): its structure and the invariants it reports
(every variant bit-exact; what the colocated path sends plus what it copies out of mapped memory is
exactly what the engines need; it sends less than the disaggregated refit; (b) hands every engine
the whole model through a bucket the trainer holds), never its timing."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from repo_paths import ROOT

from mcore_reshard.core.layout import itemsize

VARIANTS = ["colocated", "disagg", "gather", "assemble", "floor"]


def _layouts(case: str):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import colocated_bench
    finally:
        sys.path.pop(0)
    return colocated_bench.layouts("tiny", case)


def _bytes(layout, rank=None) -> int:
    ranks = layout.buffers if rank is None else [rank]
    return sum(math.prod(b.shape) * itemsize(b.dtype) for r in ranks for b in layout.buffers[r].values())


def test_colocated_bench_tiny(tmp_path):
    out = tmp_path / "res.json"
    bucket_mib = 0.25
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "colocated_bench.py"), "--size", "tiny",
                           "--case", "tp2ep2", "--reps", "2", "--bucket-mib", str(bucket_mib), "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    src, dst = _layouts("tp2ep2")
    need = _bytes(dst)
    weights = sum(math.prod(m.shape) * itemsize(m.dtype) for m in src.tensors.values())
    assert res["engine_need_bytes"] == need and res["weights_bytes"] == weights
    assert sorted(res["variants"]) == sorted(VARIANTS)
    # Megatron TP2 x EP2 on 4 trainer ranks, vLLM TP2 workers on the devices of trainer ranks 0 and 1
    assert [p["role"] for p in res["processes"]] == ["trainer"] * 4 + ["engine"] * 2
    for name, row in res["variants"].items():
        assert row["ok"] is True, name                      # every refit checked against independent values
        assert len(row["times_s"]) == 2 and all(t > 0 for t in row["times_s"]), name
    col, dis, gat, asm = (res["variants"][n] for n in ("colocated", "disagg", "gather", "assemble"))
    # colocated: the group carries only what crosses devices; the rest is read out of the mapped trainer storages
    assert 0 < col["bytes_group"] < dis["bytes_group"] == need
    assert col["bytes_group"] + col["bytes_local"] == need
    assert col["bytes_mapped"] >= _bytes(src, 0) + _bytes(src, 1)     # each worker maps its trainer rank's storages
    engines = [p for p in res["processes"] if p["role"] == "engine"]
    for p in engines:
        c = p["calls"]["colocated"][-1]
        assert c["bytes_group"] < p["need"] and c["bytes_mapped"] >= _bytes(src, p["index"])
    # (b): the whole model handed to every engine; the trainer holds the shared-memory bucket (measured outside)
    assert gat["bytes_handed"] == len(engines) * weights
    assert gat["trainer_held_shmem_bytes"] >= min(c["bucket_bytes"] for p in engines for c in p["calls"]["gather"])
    # (b'): each engine's shard handed over whole, assembled over the same cross-device bytes as colocated
    assert asm["bytes_handed"] == need and asm["bytes_group"] == col["bytes_group"]
