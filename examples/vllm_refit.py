"""Refit a running vLLM engine from trainer ranks, shard to shard, in place (needs vLLM and GPUs).

Two sides, one process group (``mcore_reshard.integrations.protocol``):

* trainer ranks ``0..T-1`` (here: torchrun processes; rank 0 also drives the engine) bring their
  weights as a canonical layout part -- a live Megatron-Core model through ``megatron_source``,
  or, in this self-contained demo, a transformers model through ``read_hf_layout``;
* the vLLM workers (``worker_extension_cls=McoreReshardWorkerExtension``) bring their live
  parameters; worker (dp, pp, tp) is group rank ``T + (dp*pp + pp_rank)*tp + tp_rank``.

Every engine call below is collective with the trainer ranks, so trainer rank 0 issues
``llm.collective_rpc`` from a thread while every trainer rank runs its own side:

    trainer ranks                         | vLLM workers (through collective_rpc)
    g = join_group(init, W, rank)         | mcore_reshard_join(init, W, T, timeout)
    r = join_refit(g, src=part, ...)      | mcore_reshard_prepare(**same plan options)
    per step: r.refit(step)               | mcore_reshard_refit(step) (+ vLLM post-load re-run, hooks)
    rank 0: llm.reset_prefix_cache()      |

Run (single node, T=1 trainer rank holding a transformers copy of the model, vLLM tp=2)::

    torchrun --nproc-per-node 1 examples/vllm_refit.py --model deepseek-ai/DeepSeek-V2-Lite --tp 2

Each "training step" here nudges every trainer weight in place; after the refit the engine's
generations change accordingly and every worker reports the refit version it holds.  With
Megatron-Core, replace the transformers source by ``megatron_source(model_chunks, rank)`` on
every trainer rank (all DP replicas may join: the planner spreads the sends over them).
Limits: bf16/fp16 weights only (no FP8 block scales), no EPLB redundant experts (docs/engines.md).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine_common import common_args, optimizer_step, trainer  # noqa: E402
from engine_common import main as run_example  # noqa: E402

EXT = "mcore_reshard.integrations.vllm_worker.McoreReshardWorkerExtension"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_args(ap, "vLLM", "tcp://127.0.0.1:29555")
    ap.add_argument("--gpu-mem", type=float, default=0.5, help="vLLM gpu_memory_utilization (default 0.5)")
    return ap.parse_args(argv)


def run(args) -> int:
    from concurrent.futures import ThreadPoolExecutor

    import torch.distributed as dist
    from vllm import LLM, SamplingParams

    from mcore_reshard.integrations.protocol import join_group, join_refit

    # --- the trainer's own world (torchrun) and policy; the refit group is a second, separate group
    rank, T, plan_kw, src, tensors = trainer(args)
    world = T + args.tp                      # trainer ranks + every vLLM worker (dp = pp = 1 here)

    # --- engine side: trainer rank 0 owns the LLM (vLLM starts its workers in their own processes)
    llm = pool = None
    if rank == 0:
        llm = LLM(model=args.model, tensor_parallel_size=args.tp, dtype="bfloat16", trust_remote_code=True,
                  gpu_memory_utilization=args.gpu_mem, worker_extension_cls=EXT)
        pool = ThreadPoolExecutor(1)

    def engine(method, *a, **kw):
        """Start a collective RPC on every worker without blocking this trainer rank."""
        return pool.submit(llm.collective_rpc, method, args=a, kwargs=kw) if rank == 0 else None

    # 1. one group for trainer ranks [0, T) and workers [T, T + tp)
    fut = engine("mcore_reshard_join", args.init, world, T, 600.0)
    group = join_group(args.init, world, rank, timeout_s=600)
    joined = fut.result() if fut else None
    if joined:
        print("workers joined as ranks", [j["rank"] for j in joined])

    # 2. plan + bind once (workers check their live parameter names/shapes against vllm_layout first)
    fut = engine("mcore_reshard_prepare", **plan_kw)
    refit = join_refit(group, src=src, src_tensors=tensors, timeout=600, **plan_kw)
    if fut:
        print("prepared:", fut.result()[0])

    prompt, sp = ["The capital of France is"], SamplingParams(max_tokens=12, temperature=0.0)
    for step in range(1, args.steps + 1):
        optimizer_step(tensors, step)
        fut = engine("mcore_reshard_refit", step)
        stats = refit.refit(step)
        if rank == 0:
            reports = fut.result()
            llm.reset_prefix_cache()        # the V1 scheduler owns the prefix cache
            versions = [w["version"] for w in reports]
            mla = [h for h in reports[0]["post_refit"]["hooks"] if h["hook"] == "mla_absorb"]
            out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].text
            print(f"step {step}: trainer sent {stats['staged_bytes_sent']} B; workers hold versions {versions}; "
                  f"MLA {mla and {k: len(v) for k, v in mla[0].items() if isinstance(v, list)}}; -> {out!r}")
    dist.barrier()
    return 0


def main(argv=None) -> int:
    return run_example(argv, parse, run, "vllm", "vllm_refit.py")


if __name__ == "__main__":
    sys.exit(main())
