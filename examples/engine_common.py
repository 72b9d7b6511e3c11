"""What the vLLM and SGLang refit examples share: their common options, the trainer side (a
torchrun process holding a transformers copy of the policy) and the stand-in optimizer step."""
from __future__ import annotations

import argparse
import importlib.util
import os


def common_args(ap: argparse.ArgumentParser, engine: str, init: str) -> None:
    ap.add_argument("--model", default="deepseek-ai/DeepSeek-V2-Lite", help="HF model path or id (trainer and engine)")
    ap.add_argument("--tp", type=int, default=2, help=f"{engine} tensor-parallel size (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="training steps, one refit after each (default 3)")
    ap.add_argument("--init", default=init, help="rendezvous of the refit group (trainer rank 0 hosts it)")
    ap.add_argument("--budget-mb", type=int, default=256, help="staging budget per rank per round, MiB (default 256)")


def cannot_run(engine_module: str, script: str) -> str | None:
    """Why this example cannot run here (None when it can)."""
    missing = [m for m in (engine_module, "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return (f"{' and '.join(missing)} not installed here: this example drives a real {engine_module} engine on "
                "GPUs (see --help and docs/engines.md); nothing to run.")
    if "RANK" not in os.environ:
        return f"run it under torchrun, e.g.: torchrun --nproc-per-node 1 examples/{script} --tp 2"
    return None


def main(argv, parse, run, engine_module: str, script: str) -> int:
    """An example's entry point: parse the options, then run it, or say why it cannot run here."""
    args = parse(argv)
    why = cannot_run(engine_module, script)
    if why:
        print(why)
        return 0
    return run(args)


def trainer(args):
    """Join the trainer's own NCCL world and load the policy: ``(rank, T, plan_kw, src, tensors)``.

    With Megatron-Core, the source is ``megatron_source(model_chunks, rank)`` instead."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from mcore_reshard.sources.hf_model import read_hf_layout
    dist.init_process_group("nccl")
    rank, T = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    plan_kw = dict(budget_bytes=args.budget_mb << 20, ignore_unused=True, allow_cast=True)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, trust_remote_code=True).cuda()
    src, tensors = read_hf_layout(policy, rank)
    return rank, T, plan_kw, src, tensors


def optimizer_step(tensors, step: int) -> None:
    """Stands in for an optimizer step: every floating-point weight changes in place."""
    import torch
    with torch.no_grad():
        for t in tensors.values():
            if t.is_floating_point():
                t.mul_(1.0 + 1e-3 * step)
