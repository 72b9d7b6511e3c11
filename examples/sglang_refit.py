"""Refit a running SGLang engine from trainer ranks, shard to shard, in place (needs SGLang and GPUs).

SGLang runs the custom weight loader ``mcore_reshard.integrations.sglang_loader.load`` inside every
TP worker when ``update_weights_from_tensor`` is called with that ``load_format``; the loader reads
*commands* (named tensors ``mcore_reshard.<cmd>`` holding JSON) and runs the refit protocol:

    trainer ranks                         | SGLang TP workers (through update_weights_from_tensor)
    g = join_group(init, W, rank)         | command("join", init_method, world_size, rank_offset=T)
    r = join_refit(g, src=part, ...)      | command("prepare", layout={...}, **same plan options)
    per step: r.refit(step)               | command("refit", version=step): copy_ in place, then
                                          |  post_load_weights (w_kc/w_vc); the scheduler flushes
                                          |  the radix cache after the call

TP worker ``tp_rank`` is group rank ``T + tp_rank`` (DP attention stays inside the TP group; plain
DP replicas are separate engines, each with its own ``rank_offset``).  Every engine call is
collective with the trainer ranks, so trainer rank 0 issues it from a thread.

Run (single node, T=1 trainer rank holding a transformers copy of the model, SGLang tp=2)::

    torchrun --nproc-per-node 1 examples/sglang_refit.py --model deepseek-ai/DeepSeek-V2-Lite --tp 2

With Megatron-Core, use ``megatron_source(model_chunks, rank)`` as the trainer's source on every
trainer rank.  Limits: bf16/fp16 weights only (no FP8 block scales), no EPLB redundant experts, the
FlashInfer-TRTLLM MoE ``[up; gate]`` order is not modelled (docs/engines.md).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_common import common_args, optimizer_step, trainer  # noqa: E402
from engine_common import main as run_example  # noqa: E402


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "SGLang", "tcp://127.0.0.1:29556")
    ap.add_argument("--dp", type=int, default=1, help="SGLang dp size (with --dp-attention: inside the TP group)")
    ap.add_argument("--dp-attention", action="store_true", help="--enable-dp-attention")
    return ap.parse_args(argv)


def run(args) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import sglang
    import torch.distributed as dist

    from mcore_reshard.integrations.protocol import join_group, join_refit
    from mcore_reshard.integrations.sglang_loader import LOAD_FORMAT, command

    rank, T, plan_kw, src, tensors = trainer(args)    # Megatron-Core: megatron_source(model_chunks, rank)
    world = T + args.tp
    layout = {"tp": args.tp, "dp": args.dp, "enable_dp_attention": args.dp_attention}   # optional: read from
    # SGLang's server args when importable in the worker; given explicitly here for clarity

    engine = pool = None
    if rank == 0:
        engine = sglang.Engine(model_path=args.model, tp_size=args.tp, dp_size=args.dp,
                               enable_dp_attention=args.dp_attention, mem_fraction_static=0.5,
                               trust_remote_code=True, custom_weight_loader=[LOAD_FORMAT])
        pool = ThreadPoolExecutor(1)

    def send(name, **payload):
        """Run one loader command on every TP worker, without blocking this trainer rank."""
        if rank != 0:
            return None
        return pool.submit(engine.update_weights_from_tensor, named_tensors=[command(name, **payload)],
                           load_format=LOAD_FORMAT)

    fut = send("join", init_method=args.init, world_size=world, rank_offset=T, timeout_s=600)
    group = join_group(args.init, world, rank, timeout_s=600)
    fut and fut.result()

    fut = send("prepare", layout=layout, **plan_kw)
    refit = join_refit(group, src=src, src_tensors=tensors, timeout=600, **plan_kw)   # raises on every rank
    fut and fut.result()                                                              # if a worker refused

    for step in range(1, args.steps + 1):
        optimizer_step(tensors, step)
        fut = send("refit", version=step)
        stats = refit.refit(step)
        if rank == 0:
            fut.result()                     # the loader ran post_load_weights; SGLang flushed its cache
            out = engine.generate("The capital of France is", {"max_new_tokens": 12, "temperature": 0.0})
            print(f"step {step}: trainer sent {stats['staged_bytes_sent']} B -> {out['text']!r}")
    dist.barrier()
    if rank == 0:
        engine.shutdown()
    return 0


def main(argv=None) -> int:
    return run_example(argv, parse, run, "sglang", "sglang_refit.py")


if __name__ == "__main__":
    sys.exit(main())
