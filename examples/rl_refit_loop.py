"""An RL-style loop: train a Megatron-Core DeepSeek-V3-style model, refit inference weights every step.

Trainer ranks hold the policy in one parallel layout (default TP2), inference ranks hold the same
architecture in another (default TP1 EP2).  After every optimizer step ``MegatronRefit.refit()``
moves every weight shard to shard, and the inference model's logits must follow the trainer's.

    python examples/rl_refit_loop.py                  # 4 local gloo processes, disaggregated
    python examples/rl_refit_loop.py --colocated      # trainer and inference on the same ranks
    torchrun --nproc-per-node 4 examples/rl_refit_loop.py

Disaggregated here: ranks [0, N/2) train and ranks [N/2, N) infer.  Megatron's parallel_state
spans the whole world, so the trainer is built with dp slowest ("tp-cp-ep-pp-dp"): ranks [0, N/2)
hold one whole replica, which alone feeds the refit (the other replica is never read).  CPU-only
torch needs Megatron-Core's CUDA-only calls patched: ``mcore_reshard.testing.megatron_cpu``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def run(rank: int, world: int, steps: int, colocated: bool, train: str, infer: str) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.testing import megatron_cpu as mcore_cpu

    def sizes(text):
        return {k: int(v) for k, v in (kv.split("=") for kv in text.split(","))}

    mcore_cpu.install_cpu_shims()
    t, i = sizes(train), sizes(infer)

    def activate(s, order="tp-cp-ep-dp-pp"):
        # Megatron's parallel_state is process-global; the models keep the groups they were built
        # with, but some forward paths read the global state, so make the right layout current.
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        mcore_cpu.init_megatron(s.get("tp", 1), s.get("pp", 1), ep=s.get("ep", 1), etp=s.get("etp"), order=order)

    train_order = "tp-cp-ep-dp-pp" if colocated else "tp-cp-ep-pp-dp"
    activate(t, train_order)
    policy = mcore_cpu.build_dsv3_tiny(mtp=False, sequence_parallel=t.get("tp", 1) > 1)  # MoE training with TP needs SP
    opt = torch.optim.SGD([p for m in policy for p in m.parameters()], lr=0.05)
    activate(i)
    engine = mcore_cpu.build_dsv3_tiny(mtp=False)
    trains = colocated or rank < world // 2
    infers = colocated or rank >= world // 2
    refit = MegatronRefit(policy if trains else [], engine if infers else [])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 100, (2, 8), generator=g)
    pos = torch.arange(8)[None].expand(2, 8)
    mask = mcore_cpu.causal_mask(8)
    history = []
    for step in range(steps):
        activate(t, train_order)
        # one optimizer step on a next-token loss (every trainer replica sees the same batch)
        for m in policy:
            m.train()
        loss = policy[0](tokens, pos, mask, labels=torch.roll(tokens, -1, 1)).float().mean()
        opt.zero_grad()
        loss.backward()
        # what Megatron's finalize_model_grads does for sequence parallelism: norm (and router)
        # weights see only this rank's part of the sequence, so sum their grads over TP
        tp_group = ps.get_tensor_model_parallel_group()
        for m in policy:
            for p in m.parameters():
                if getattr(p, "sequence_parallel", False) and p.grad is not None:
                    torch.distributed.all_reduce(p.grad, group=tp_group)
        opt.step()
        with torch.no_grad():
            for m in policy:
                m.eval()
            want = mcore_cpu.forward_logits(policy, tokens)
        activate(i)
        t0 = time.perf_counter()
        refit.refit()
        refit_s = time.perf_counter() - t0
        with torch.no_grad():
            got = mcore_cpu.forward_logits(engine, tokens)
        diff = float((want - got).abs().max())
        history.append({"step": step, "loss": float(loss), "refit_ms": refit_s * 1e3, "max_logit_diff": diff})
    return {"rank": rank, "infers": infers, "history": history, "bytes": refit.plan.stats["network_bytes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, default=4, help="processes to launch when not under torchrun (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="training steps, one refit after each (default 3)")
    ap.add_argument("--colocated", action="store_true", help="trainer and inference on the same ranks")
    ap.add_argument("--train", default="tp=2", help="trainer layout (PP=1; default tp=2)")
    ap.add_argument("--infer", default="tp=1,ep=2,etp=1", help="inference layout (PP=1; default tp=1,ep=2,etp=1)")
    args = ap.parse_args(argv)
    if "RANK" in os.environ:   # under torchrun
        import torch.distributed as dist
        dist.init_process_group("gloo")
        res = [run(dist.get_rank(), dist.get_world_size(), args.steps, args.colocated, args.train, args.infer)]
    else:
        from mcore_reshard.testing.megatron_cpu import spawn
        res = spawn(run, args.nproc, args.steps, args.colocated, args.train, args.infer, timeout=600)
    ok = True
    for r in res:
        if not r["infers"]:
            continue
        for h in r["history"]:
            print(f"rank {r['rank']} step {h['step']}: loss {h['loss']:.4f}  refit {h['refit_ms']:.1f} ms  "
                  f"max |logits(engine) - logits(trainer)| = {h['max_logit_diff']:.2e}")
            ok &= h["max_logit_diff"] < 1e-4
    print("inference logits follow the trainer" if ok else "MISMATCH: inference logits do not follow the trainer")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
