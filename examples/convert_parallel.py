"""Convert a live Megatron-Core model between parallel configs in memory (no checkpoint on disk).

    python examples/convert_parallel.py                       # DSV3-style TP2 PP2 -> TP1 EP4, 4 processes
    python examples/convert_parallel.py --src tp=2,ep=2 --dst tp=4
    torchrun --nproc-per-node 4 examples/convert_parallel.py

Builds the model in the source layout, builds an empty one in the target layout on the same
ranks, moves every weight with ``MegatronRefit``, and checks both give the same logits.
CPU-only torch needs Megatron-Core's CUDA-only calls patched: ``mcore_reshard.testing.megatron_cpu``.
"""
from __future__ import annotations

import argparse
import os
import sys


def run(rank: int, world: int, src: str, dst: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.testing import megatron_cpu as mcore_cpu

    def init(text):
        s = {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()   # the first model keeps its own groups
        mcore_cpu.init_megatron(s.get("tp", 1), s.get("pp", 1), ep=s.get("ep", 1), etp=s.get("etp"))

    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    init(src)
    model = mcore_cpu.build_dsv3_tiny(mtp=True)
    before = mcore_cpu.forward_logits(model, tokens)
    init(dst)
    converted = mcore_cpu.build_dsv3_tiny(mtp=True)
    refit = MegatronRefit(model, converted)
    refit.refit()
    after = mcore_cpu.forward_logits(converted, tokens)
    s = refit.plan.stats
    return {"diff": float((before - after).abs().max()), "bytes": s["network_bytes"], "local": s["local_bytes"],
            "messages": s["messages"], "tensors": len(refit.plan.tensors)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", default="tp=2,pp=2", help="source layout (default tp=2,pp=2)")
    ap.add_argument("--dst", default="tp=1,ep=4,etp=1", help="target layout (default tp=1,ep=4,etp=1)")
    ap.add_argument("--nproc", type=int, default=4, help="processes when not under torchrun (default 4)")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:
        import torch.distributed as dist
        dist.init_process_group("gloo")
        res = [run(dist.get_rank(), dist.get_world_size(), args.src, args.dst)]
    else:
        from mcore_reshard.testing.megatron_cpu import spawn
        res = spawn(run, args.nproc, args.src, args.dst, timeout=600)
    r = res[0]
    print(f"{args.src} -> {args.dst}: {r['tensors']} tensors, {r['bytes']:,} B sent + {r['local']:,} B copied locally "
          f"in {r['messages']} messages; max |logits difference| {max(x['diff'] for x in res):.2e}")
    return 0 if max(x["diff"] for x in res) < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
