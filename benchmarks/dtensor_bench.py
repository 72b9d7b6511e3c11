"""``mcore_reshard.reshard`` on DTensors vs torch's own ways, on the same tensors, in one run (CPU, 4 gloo ranks).

    python benchmarks/dtensor_bench.py [--tensors 32] [--rows 128] [--cols 512] [--reps 5] [--json]

Two cases over ``--tensors`` fp32 tensors of ``[rows, cols]``:

* ``same mesh``: a (2, 2) DeviceMesh of ranks 0-3, ``[Shard(0), Replicate()]`` -> ``[Replicate(), Shard(1)]``;
  baseline: ``DTensor.redistribute`` per tensor (torch's collectives), the result copied into the
  destination shard.
* ``disjoint meshes``: ``Shard(0)`` over ranks 0-1 -> ``Shard(1)`` over ranks 2-3; baseline: gather + slice
  (``full_tensor()`` on the source mesh, a broadcast of every full tensor from rank 0 over the group,
  each destination rank copies its slice).

Ways, each timed per repetition after one warm-up call (plan + bind for ours), median of ``--reps``:
``grouped`` (one ``reshard_group`` of the per-tensor calls: one plan, one refit), ``whole`` (one call
with dicts), ``per-tensor`` (one cached ``reshard`` call per tensor), and the baseline.  Every
destination shard is checked bit for bit against the source (exit 1 otherwise).  Ratios are
``way / grouped``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _locals(full, mesh_shape, coord, placements):
    t = full
    from torch.distributed.tensor import Replicate
    for size, c, p in zip(mesh_shape, coord, placements):
        if not isinstance(p, Replicate):
            t = p._split_tensor(t, size, with_padding=False)[0][c]
    return t.contiguous()


def _case(rank, n, rows, cols, same: bool):
    """(fulls, src DTensors or None, dst DTensors or None, dst locals, src mesh, dst mesh, dst placements)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    if same:
        sm = dm = DeviceMesh("cpu", torch.arange(4).reshape(2, 2))
        sp, dp = [Shard(0), Replicate()], [Replicate(), Shard(1)]
    else:
        sm, dm = DeviceMesh("cpu", torch.tensor([0, 1])), DeviceMesh("cpu", torch.tensor([2, 3]))
        sp, dp = [Shard(0)], [Shard(1)]
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(rows, cols, generator=g) for _ in range(n)]
    src, dst, dlocal = {}, {}, {}
    for i, f in enumerate(fulls):
        sc, dc = sm.get_coordinate(), dm.get_coordinate()
        if sc is not None:
            src[f"w{i}"] = DTensor.from_local(_locals(f, sm.mesh.shape, sc, sp), sm, sp, run_check=False,
                                              shape=f.shape, stride=f.stride())
        if dc is not None:
            dlocal[f"w{i}"] = torch.zeros_like(_locals(f, dm.mesh.shape, dc, dp))
            dst[f"w{i}"] = DTensor.from_local(dlocal[f"w{i}"], dm, dp, run_check=False, shape=f.shape, stride=f.stride())
    return fulls, src, dst, dlocal, sm, dm, dp


def _timed(fn, reps: int) -> tuple[float, float]:
    """(first call s, median of ``reps`` later calls s), every rank in step (barrier before each)."""
    import torch.distributed as dist
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def _worker(rank: int, world: int, n: int, rows: int, cols: int, reps: int) -> dict:
    import torch
    import torch.distributed as dist

    import mcore_reshard
    import mcore_reshard.dtensor_reshard
    out = {}
    for same in (True, False):
        fulls, src, dst, dlocal, sm, dm, dp = _case(rank, n, rows, cols, same)
        names = [f"w{i}" for i in range(n)]

        def grouped():
            with mcore_reshard.reshard_group():
                for k in names:
                    mcore_reshard.reshard(src.get(k), dst.get(k), name=k)

        def whole():
            mcore_reshard.reshard(src, dst)

        def per_tensor():
            for k in names:
                mcore_reshard.reshard(src.get(k), dst.get(k), name=k)

        def redistribute():
            for k in names:
                dlocal[k].copy_(src[k].redistribute(dm, dp).to_local())

        def gather_slice():
            for i, k in enumerate(names):
                full = src[k].full_tensor() if k in src else torch.empty(rows, cols)
                dist.broadcast(full, src=0)
                if k in dlocal:
                    dlocal[k].copy_(_locals(full, dm.mesh.shape, dm.get_coordinate(), dp))

        ways = {"grouped": grouped, "whole": whole, "per-tensor": per_tensor,
                "baseline": redistribute if same else gather_slice}
        row = {}
        for label, fn in ways.items():
            for t in dlocal.values():
                t.zero_()
            mcore_reshard.dtensor_reshard.clear_cache()      # every way's first call plans and binds
            row[label] = _timed(fn, reps)
            row[label + "_ok"] = all(torch.equal(dlocal[k], _locals(fulls[i], dm.mesh.shape, dm.get_coordinate(), dp))
                                     for i, k in enumerate(names) if k in dlocal)
        res = mcore_reshard.reshard(src, dst)
        row["network_bytes"] = res.plan.stats["network_bytes"]
        row["lower_bound_bytes"] = res.plan.stats["lower_bound_bytes"]
        out["same mesh" if same else "disjoint meshes"] = row
    return out


def table(results: list, n: int, rows: int, cols: int) -> str:
    lines = [f"{n} fp32 tensors of [{rows}, {cols}] ({n * rows * cols * 4 / 2**20:.1f} MiB), 4 gloo ranks; "
             "seconds per call (slowest rank's median), first call in parentheses; ratio = way / grouped",
             "", "| case | grouped | whole-model call | per-tensor calls | torch baseline | per-tensor / grouped | baseline / grouped |",
             "|---|---|---|---|---|---|---|"]
    for case in results[0]:
        med = {w: max(r[case][w][1] for r in results) for w in ("grouped", "whole", "per-tensor", "baseline")}
        first = {w: max(r[case][w][0] for r in results) for w in med}
        base = "redistribute" if case == "same mesh" else "gather + slice"
        cell = {w: f"{med[w] * 1e3:.1f} ms ({first[w] * 1e3:.0f} ms)" for w in med}
        lines.append(f"| {case} | {cell['grouped']} | {cell['whole']} | {cell['per-tensor']} | {base}: {cell['baseline']} "
                     f"| {med['per-tensor'] / med['grouped']:.2f} | {med['baseline'] / med['grouped']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=32)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--cols", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print every rank's numbers as JSON too")
    a = ap.parse_args(argv)
    from mcore_reshard.tools.launch import spawn
    results = spawn(_worker, 4, a.tensors, a.rows, a.cols, a.reps, timeout=300)
    print(table(results, a.tensors, a.rows, a.cols))
    bad = [(rank, case, k) for rank, r in enumerate(results) for case, row in r.items() for k, v in row.items()
           if k.endswith("_ok") and not v]
    for r in results:
        for case, row in r.items():
            if row["network_bytes"] != row["lower_bound_bytes"]:
                bad.append((case, "network bytes above the lower bound"))
    if a.json:
        print(json.dumps(results))
    if bad:
        print(f"MISMATCH: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
