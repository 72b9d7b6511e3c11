"""The demo: reshard the synthetic model between two layouts on local gloo processes and check it."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..core.executor import Resharder
from ..core.planner import make_plan
from .synthetic import SyntheticModel, materialize, parse_parallel, reference_tensor, synthetic_layout, world_size_of


def build_layouts(src_spec: str, dst_spec: str, colocated: bool, scale: int = 1, src_dtype: str = "float32",
                  dst_dtype: str | None = None):
    """Source and destination layouts of the synthetic model (destination ranks after the source's
    unless colocated).  Its uneven tensor has 3 * world + 1 rows on both sides."""
    src_sizes, dst_sizes = parse_parallel(src_spec), parse_parallel(dst_spec)
    model = SyntheticModel(odd_rows=3 * max(world_size_of(src_sizes), world_size_of(dst_sizes)) + 1)
    model = model.scaled(scale) if scale > 1 else model
    src = synthetic_layout(src_sizes, model, src_dtype)
    dst = synthetic_layout(dst_sizes, model, dst_dtype or src_dtype, rank_offset=0 if colocated else world_size_of(src_sizes))
    return src, dst


def world_needed(src_spec: str, dst_spec: str, colocated: bool) -> int:
    a, b = world_size_of(parse_parallel(src_spec)), world_size_of(parse_parallel(dst_spec))
    return max(a, b) if colocated else a + b


def demo_worker(rank: int, world: int, src_spec: str, dst_spec: str, colocated: bool, scale: int = 1,
                budget: int = 256 << 20, reps: int = 3, src_dtype: str = "float32", dst_dtype: str | None = None) -> dict:
    """One rank of the demo; returns its own measurements and checks (JSON-able)."""
    t0 = time.perf_counter()
    src, dst = build_layouts(src_spec, dst_spec, colocated, scale, src_dtype, dst_dtype)
    plan = make_plan(src, dst, budget_bytes=budget, allow_cast=dst_dtype not in (None, src_dtype))
    plan_s = time.perf_counter() - t0
    from ..core.executor import torch_dtype
    sdt = torch_dtype(src_dtype)
    ddt = torch_dtype(dst_dtype or src_dtype)

    def refs(step):
        return {n: reference_tensor(n, m.shape, sdt, step) for n, m in src.tensors.items()}

    S = materialize(src, rank, refs(0))
    D = materialize(dst, rank, refs(0), fill=float("nan"), dtype=ddt)
    ptrs = {n: t.data_ptr() for n, t in D.items()}
    r = Resharder(plan, S, D)
    times, mismatches, stats = [], 0, {}
    from ..util.progress import bar
    steps = bar(range(reps), desc=f"rank 0 refits ({plan.stats['messages']} messages each)", unit="refit",
                leave=False) if rank == 0 else range(reps)
    for step in steps:
        full = refs(step)
        fresh = materialize(src, rank, full)
        for n, t in S.items():
            t.copy_(fresh[n])       # "a training step": new weights, same storage
        dist.barrier()
        t1 = time.perf_counter()
        stats = r.refit()
        dist.barrier()
        times.append(time.perf_counter() - t1)
        expect = materialize(dst, rank, {n: v.to(ddt) for n, v in full.items()}, dtype=ddt)
        mismatches += sum(0 if torch.equal(expect[n], D[n]) else 1 for n in D)
    moved = all(D[n].data_ptr() == p for n, p in ptrs.items())
    return {"rank": rank, "plan_s": plan_s, "times": times, "mismatched_tensors": mismatches,
            "dst_tensors": len(D), "same_storage": moved, "staging_bytes": r.staging_bytes,
            "messages_sent": stats.get("messages_sent", 0), "bytes_sent": stats.get("staged_bytes_sent", 0),
            "plan_hash": plan.hash, "stats": plan.stats if rank == 0 else None}
