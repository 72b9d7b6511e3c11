"""export_hf streaming: the writer's resident memory and the time, by group size, in one run::

    .venv/bin/python benchmarks/export_memory.py [memory_bytes ...]      # default: 4 MiB, 16 MiB, 1 GiB

4-rank gloo launches (TP2 x EP2) of the DeepSeek-V3-style test model widened to ~70 MB of fp32
checkpoint (hidden 256, 16 routed experts of 256, MTP, vocab 2048), exported per group size (a launch each) by
``export_hf(..., memory_bytes=m, budget_bytes=1 MiB)`` to a temporary directory, written by rank 0.
Per size, one JSON line: checkpoint bytes, the largest group, shards, bytes over the network, the
writer's resident-memory growth at its peak while streaming (VmHWM, reset before), the seconds of
the transfers + shard writes and of the whole call (which includes importing transformers on the
writer for config.json, ~3 s here).
"""
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "helpers"), os.path.join(HERE, "..", "tests", "integrations")]   # hf_export_worker, test_hf_export

if __name__ == "__main__":
    import hf_export_worker
    from test_hf_export import DSV3, WIDE

    from mcore_reshard.testing.megatron_cpu import spawn

    sizes = [int(a) for a in sys.argv[1:]] or [4 << 20, 16 << 20, 1 << 30]
    for m in sizes:   # one launch per size: fresh writer processes, so no size inherits another's freed memory
        case = {"id": f"wide_{m}", "model": "dsv3", "src": {"tp": 2, "ep": 2}, "kw": dict(DSV3, num_experts=16, widths=WIDE),
                "memory_bytes": m, "budget_bytes": 1 << 20}
        with tempfile.TemporaryDirectory() as out:
            s = spawn(hf_export_worker.export_scenarios, 4, [case], out, timeout=900)[0][0]["stats"]
        print(json.dumps({"memory_bytes": m, "checkpoint_bytes": s["total_bytes"], "max_group_bytes": s["max_group_bytes"],
                          "shards": len(s["files"]) - 2, "network_bytes": s["network_bytes"],
                          "writer_peak_added_bytes": s["writer_peak_added_bytes"],
                          "stream_seconds": round(s["stream_seconds"], 2), "seconds": round(s["seconds"], 2)}))
