"""GPU check (one NVIDIA GPU, a few minutes): the executor's pack / unpack and local-copy paths on
CUDA tensors, against the device's own memory bandwidth, bit for bit.

    python examples/gpu_check.py                 # scale 48 (~1 GB fp32 model), 5 timed refits
    python examples/gpu_check.py --scale 64 --reps 10 --budget-mib 256

Two gloo processes share the one GPU (no second GPU, no NCCL needed):

1. Disaggregated: rank 0 holds the synthetic model (fused QKV, [gate; up], experts, vocab padding)
   as CUDA tensors, rank 1 receives it into its own CUDA tensors.  Every byte is packed on rank 0
   into the CUDA staging buffer and unpacked on rank 1 -- the executor's real code.  gloo cannot
   move CUDA memory, so ``torch.distributed.batch_isend_irecv`` is wrapped to bounce each staging
   buffer through host memory; that time is measured and subtracted, leaving pack (rank 0) and
   unpack (rank 1) time.
2. Colocated: both ranks hold a full source copy (``dp=2``) and a ``tp=2`` destination: every byte
   is a local ``copy_`` on the GPU (no message).

Throughput is reported as bytes read + written per second next to ``dst.copy_(src)`` on one
contiguous 512 MiB buffer (the device's practical copy bandwidth).  Exit status: 0 when every
destination tensor is bit-exact, 1 otherwise, 2 when there is no GPU (nothing is run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# tests may set MCORE_RESHARD_GPU_CHECK_DEVICE=cpu to exercise this script's logic without a GPU
_DEVICE = os.environ.get("MCORE_RESHARD_GPU_CHECK_DEVICE", "cuda")


def _sync() -> None:
    if _DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 512 << 20, reps: int = 20) -> float:
    """Bytes read + written per second by ``b.copy_(a)`` on one contiguous buffer."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=_DEVICE)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    _sync()
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    _sync()
    return 2 * nbytes * reps / (time.perf_counter() - t)


class BounceTransport:
    """Wraps ``torch.distributed.batch_isend_irecv``: every buffer goes through host memory (gloo
    moves CPU tensors only); the seconds spent here are recorded so they can be subtracted."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist
        self.real = dist.batch_isend_irecv
        self.seconds = 0.0

    def __enter__(self):
        self.dist.batch_isend_irecv = self
        return self

    def __exit__(self, *exc):
        self.dist.batch_isend_irecv = self.real
        return False

    def __call__(self, ops):
        dist = self.dist
        _sync()                  # pack kernels finish before the clock starts (they are pack time)
        t = time.perf_counter()
        host, back = [], []
        for op in ops:
            if op.op is dist.isend:
                h = op.tensor.to("cpu", copy=True)
            else:
                h = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                back.append((op.tensor, h))
            host.append(dist.P2POp(op.op, h, group=op.group, tag=op.tag, group_peer=op.group_peer))
        for w in self.real(host):
            w.wait()
        for dev, h in back:
            dev.copy_(h)
        _sync()
        self.seconds += time.perf_counter() - t
        return [_Done() for _ in ops]


class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _bit_exact(layout, rank: int, full: dict, got: dict) -> tuple[int, int]:
    from mcore_reshard.tools.synthetic import materialize
    want = materialize(layout, rank, full)
    bad = sum(0 if torch.equal(want[n], got[n].cpu()) else 1 for n in want)
    return bad, len(want)


def worker(rank: int, world: int, scale: int, reps: int, budget: int) -> dict:
    import torch.distributed as dist

    from mcore_reshard.core.executor import Resharder
    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.tools.demo import build_layouts
    from mcore_reshard.tools.synthetic import materialize, reference_tensor
    if _DEVICE == "cuda":
        torch.cuda.set_device(0)
    out = {"rank": rank}
    for case, (s_spec, d_spec, coloc) in {"disaggregated": ("tp=1", "tp=1", False),
                                          "colocated": ("tp=1,dp=2", "tp=2", True)}.items():
        src, dst = build_layouts(s_spec, d_spec, coloc, scale)
        plan = make_plan(src, dst, budget_bytes=budget)
        full = {n: reference_tensor(n, m.shape) for n, m in sorted(src.tensors.items())}
        S = {n: t.to(_DEVICE) for n, t in materialize(src, rank, full).items()}
        D = {n: t.to(_DEVICE) for n, t in materialize(dst, rank, full, fill=float("nan")).items()}
        # confirm=False: no closing all-gather, so a rank's time is its own work (pack or unpack)
        r = Resharder(plan, S, D, confirm=False)
        with BounceTransport() as bounce:
            r.refit()                              # warm-up: first touch of staging, allocator
            times, moved = [], []
            for _ in range(reps):
                dist.barrier()
                _sync()
                bounce.seconds = 0.0
                t = time.perf_counter()
                r.refit()
                _sync()
                times.append(time.perf_counter() - t - bounce.seconds)
                moved.append(bounce.seconds)
            dist.barrier()
        sent = sum(c.nbytes for m in plan.messages if m.src == rank for c in m.entries)
        recvd = sum(c.nbytes for m in plan.messages if m.dst == rank for c in m.entries)
        local = sum(c.nbytes for c in plan.local_copies if c.dst == rank)
        bad, total = _bit_exact(dst, rank, full, D)
        out[case] = {"compute_s": statistics.median(times), "bounce_s": statistics.median(moved),
                     "sent": sent, "recv": recvd, "local": local, "bad": bad, "tensors": total,
                     "entries": sum(len(m.entries) for m in plan.messages if rank in (m.src, m.dst)),
                     "local_copies": sum(1 for c in plan.local_copies if c.dst == rank), "rounds": plan.rounds,
                     "staging": r.staging_bytes}
        del S, D, r
        if _DEVICE == "cuda":
            torch.cuda.empty_cache()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=int, default=48, help="synthetic model width factor (48: ~1 GB fp32)")
    ap.add_argument("--reps", type=int, default=5, help="timed refits per case after one warm-up")
    ap.add_argument("--budget-mib", type=float, default=256.0, help="staging budget per rank and round, MiB")
    args = ap.parse_args(argv)
    if _DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py needs an NVIDIA GPU: torch.cuda.is_available() is False here; nothing was run.",
              file=sys.stderr)
        return 2
    from mcore_reshard.tools.launch import spawn
    name = torch.cuda.get_device_name(0) if _DEVICE == "cuda" else "cpu (test mode)"
    bw = copy_bandwidth()
    print(f"device             {name}")
    print(f"copy bandwidth     {bw / 1e9:,.0f} GB/s (read + write, 512 MiB contiguous copy_)")
    t0 = time.perf_counter()
    res = spawn(worker, 2, args.scale, args.reps, int(args.budget_mib * (1 << 20)), timeout=600)
    ok = True
    for case in ("disaggregated", "colocated"):
        for r in res:
            c = r[case]
            ok &= c["bad"] == 0
            what = []
            if c["sent"]:
                what.append(f"pack {c['sent'] / 1e9:.2f} GB")
            if c["recv"]:
                what.append(f"unpack {c['recv'] / 1e9:.2f} GB")
            if c["local"]:
                what.append(f"local copy {c['local'] / 1e9:.2f} GB")
            nbytes = c["sent"] + c["recv"] + c["local"]
            thr = 2 * nbytes / c["compute_s"] if c["compute_s"] > 0 else 0.0
            print(f"{case:13s} rank {r['rank']}: {', '.join(what) or 'nothing'} in {c['compute_s'] * 1e3:.1f} ms "
                  f"(median of {args.reps}; host bounce {c['bounce_s'] * 1e3:.0f} ms excluded) = "
                  f"{thr / 1e9:,.0f} GB/s = {100 * thr / bw:.0f}% of copy bandwidth; "
                  f"{c['entries']} entries, {c['local_copies']} local copies, {c['rounds']} round(s), "
                  f"staging {c['staging'] / 2**20:.0f} MiB; bit-exact: "
                  + ("yes" if c["bad"] == 0 else f"NO ({c['bad']} of {c['tensors']} tensors differ)"))
    print(f"total {time.perf_counter() - t0:.0f} s; {'all destination tensors bit-exact' if ok else 'MISMATCHES'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
