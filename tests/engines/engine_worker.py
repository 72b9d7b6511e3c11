"""Runs inside an engine's venv (``.venv-vllm`` / ``.venv-sglang``) as four ranks (``rank_launch``):
the engine's REAL model classes and ``load_weights`` on CPU over gloo, checked against the library's layouts.

    tests/engines/engine_worker.py vllm layouts JOB.json OUT_DIR    (four ranks, by rank_launch.run_ranks)

``JOB.json``: a list of cases ``{"id", "model" (engine_models.MODELS), "par": {...}, "probe": bool}``.
One process import (15-40 s) serves every case: the engine's model-parallel state is rebuilt per case
on the same gloo world; a case of ``g`` ranks runs as ``world / g`` independent replicas (vLLM's
"external DP" numbering, SGLang's several TP groups), each rank checked against rank ``r % g`` of
the layout.  Every rank writes ``OUT_DIR/rank{r}.json``: case id -> report.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "helpers")]   # engine scripts, shared helpers

ENGINE = sys.argv[1] if len(sys.argv) > 1 else ""
if ENGINE == "vllm":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

import engine_models  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_launch import install_stack_dump, rendezvous  # noqa: E402

SENTINEL = 4242.0     # parameters start as this: a loader that leaves an element alone is seen


def compare_params(model_params: dict, layout, lrank: int, full: dict, prefix: str = "") -> list[str]:
    """Every parameter against what the layout says it holds: names (both ways), shapes, contents."""
    from mcore_reshard.tools.synthetic import materialize
    want = materialize(layout, lrank, full, dtype=torch.float32)
    got = {prefix + n: p.detach() for n, p in model_params.items()}
    errs = [f"param {n} not in the layout" for n in sorted(set(got) - set(want))]
    errs += [f"layout buffer {n} not a parameter" for n in sorted(set(want) - set(got))]
    for n in sorted(set(got) & set(want)):
        g, w = got[n], want[n]
        if tuple(g.shape) != tuple(w.shape):
            errs.append(f"{n}: shape {tuple(g.shape)} != layout {tuple(w.shape)}")
        elif not torch.equal(g.float(), w):
            bad = (g.float() != w).nonzero()
            errs.append(f"{n}: {len(bad)} of {w.numel()} elements differ, first at {bad[0].tolist()}"
                        f" (got {g.flatten()[0].item():.4g}..., sentinel {SENTINEL})")
    return errs


def expert_ids(layout, lrank: int) -> list[int]:
    """Global expert ids the layout puts in this rank's first w13 buffer (slot order)."""
    for name, buf in sorted(layout.buffers.get(lrank, {}).items()):
        if name.endswith("w13_weight"):
            ids = []
            for p in sorted(buf.pieces, key=lambda p: p.local.offsets):
                if p.tensor.endswith("experts.gate_up_proj") and p.local.offsets[1] == 0:
                    ids += range(p.box.offsets[0], p.box.offsets[0] + p.box.sizes[0])
            return ids
    return []


def hf_items(ck: dict):
    return iter([(n, t.clone()) for n, t in ck.items()])


def sentinel(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(SENTINEL)


# ----------------------------------------------------------------------------------- vLLM

class VllmEngine:
    """The real vLLM 0.33 model classes on the CPU platform (``VLLM_TARGET_DEVICE=cpu``)."""

    def __init__(self, rank: int, world: int, init_method: str = "env://"):
        from vllm.distributed import parallel_state as ps
        self.ps, self.rank, self.world = ps, rank, world
        self.root = tempfile.mkdtemp(prefix="mr-vllm-")
        ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, distributed_init_method=init_method,
                                        backend="gloo")

    def config(self, cfg: dict, par: dict, name: str):
        from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig
        d = engine_models.write_config(self.root, name, cfg)
        mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
                         max_model_len=256)
        pk = dict(tensor_parallel_size=par.get("tp", 1), pipeline_parallel_size=par.get("pp", 1),
                  enable_expert_parallel=bool(par.get("ep", False)))
        if par.get("placement"):
            pk["expert_placement_strategy"] = par["placement"]
        if par.get("dp", 1) > 1:
            g = par.get("tp", 1) * par.get("pp", 1)
            pk.update(data_parallel_size=par["dp"], data_parallel_rank=(self.rank % (g * par["dp"])) // g)
        pc = ParallelConfig(**pk)
        return VllmConfig(model_config=mc, parallel_config=pc, device_config=DeviceConfig("cpu"),
                          load_config=LoadConfig(load_format="dummy"))

    def build(self, vc, cls_name: str | None = None):
        """Model-parallel state for ``vc`` (rebuilt), then the model class vLLM's registry picks."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.utils import get_model_architecture
        from vllm.utils.torch_utils import set_default_torch_dtype
        ps = self.ps
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        pc = vc.parallel_config
        with set_current_vllm_config(vc):
            ps.initialize_model_parallel(tensor_model_parallel_size=pc.tensor_parallel_size,
                                         pipeline_model_parallel_size=pc.pipeline_parallel_size, backend="gloo")
            cls = get_model_architecture(vc.model_config)[0]
            with set_default_torch_dtype(torch.float32), torch.device("cpu"):
                model = cls(vllm_config=vc, prefix="")
        return model

    def build_mtp(self, vc):
        # The drafter's config as vLLM's EAGLE/MTP proposer hands it over: the target's, with a
        # speculative config whose draft model config is the MTP model's (here: the same HF config).
        import copy
        from types import SimpleNamespace

        from vllm.config import set_current_vllm_config
        from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP
        from vllm.utils.torch_utils import set_default_torch_dtype
        dvc = copy.copy(vc)
        class Spec(SimpleNamespace):      # only what building the draft reads; other options off
            def __getattr__(self, name):
                return None
        object.__setattr__(dvc, "speculative_config", Spec(draft_model_config=vc.model_config, method="mtp",
                                                           num_speculative_tokens=1))
        with set_current_vllm_config(dvc), set_default_torch_dtype(torch.float32), torch.device("cpu"):
            return DeepSeekMTP(vllm_config=dvc, prefix="")

    def worker(self, vc, model, drafter=None):
        """What the worker extension sees of a vLLM worker."""
        from types import SimpleNamespace
        runner = SimpleNamespace(model=model)
        if drafter is not None:
            runner.drafter = SimpleNamespace(model=drafter)
        return SimpleNamespace(vllm_config=vc, model_runner=runner, rank=self.rank)

    def load(self, model, vc, ck: dict):
        from vllm.config import set_current_vllm_config
        with set_current_vllm_config(vc), torch.no_grad():
            return model.load_weights(hf_items(ck))

    def spec(self, vc, model, rank_offset: int = 0, mtp: bool = False, drafter=None):
        from mcore_reshard.integrations.vllm_worker import vllm_names, vllm_spec
        w = self.worker(vc, model, drafter)
        names = vllm_names(w, {n for n, _ in model.named_parameters()})
        return vllm_spec(w, rank_offset, names=names, mtp=mtp)


def vllm_layout_case(eng: VllmEngine, case: dict) -> dict:
    from mcore_reshard.integrations.probe import compare_layouts, probe_layout
    from mcore_reshard.integrations.protocol import build_layout
    from mcore_reshard.targets import from_hf_config, hf_layout
    cfg, par = engine_models.MODELS[case["model"]](), case["par"]
    vc = eng.config(cfg, par, case["model"])
    g = par.get("tp", 1) * par.get("pp", 1) * par.get("dp", 1)
    lrank = eng.rank % g
    full, ck = engine_models.random_checkpoint(cfg, seed=zlib.crc32(case["id"].encode()))
    t0 = time.monotonic()
    model = eng.build(vc)
    sentinel(model)
    eng.load(model, vc, ck)
    spec = eng.spec(vc, model, mtp=False)
    layout = build_layout(spec)
    params = dict(model.named_parameters())
    rep = {"errors": compare_params(params, layout, lrank, full), "params": len(params),
           "kwargs": spec["kwargs"], "shapes": {n: list(p.shape) for n, p in params.items()},
           "experts": expert_ids(layout, lrank)}
    if case.get("mtp"):
        draft = eng.build_mtp(vc)
        sentinel(draft)
        eng.load(draft, vc, ck)
        spec = eng.spec(vc, model, mtp=True, drafter=draft)
        layout = build_layout(spec)
        from mcore_reshard.integrations.protocol import live_tensors
        from mcore_reshard.integrations.vllm_worker import MTP_PREFIX
        live, aliases = live_tensors({"": model, MTP_PREFIX: draft})
        rep["mtp_params"] = len(list(draft.named_parameters()))
        rep["mtp_aliases"] = aliases
        errs = compare_params({n: t for n, t in live.items()}, layout, lrank, full)
        rep["errors"] += [f"(with MTP) {e}" for e in errs]
    if case.get("probe"):
        mc = from_hf_config(cfg)
        probed, unwritten = probe_layout(model, hf_layout(mc, fused_experts=False, dtype="float32"), lrank,
                                         load_weights=lambda it: eng.load(model, vc, dict(it)))
        hand = build_layout({**spec, "kwargs": {**spec["kwargs"], "dtype": "float32", "mtp": False}})
        rep["probe_errors"] = compare_layouts(probed, hand, [lrank])
        rep["unwritten"] = unwritten
        rep["probe_buffers"] = len(probed.buffers.get(lrank, {}))
    rep["seconds"] = round(time.monotonic() - t0, 2)
    return rep


# ----------------------------------------------------------------------------------- main

def main() -> None:
    engine, mode, job, out = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(job) as f:
        cases = json.load(f)
    install_stack_dump()
    t0 = time.monotonic()
    if engine == "vllm":
        eng = VllmEngine(rank, world, rendezvous("world"))
        run = {"layouts": vllm_layout_case}[mode]
    else:
        import sglang_worker
        eng = sglang_worker.SGLangEngine(rank, world, rendezvous("world"))
        run = {"layouts": sglang_worker.layout_case}[mode]
    setup_s = time.monotonic() - t0
    results = {"_setup_s": round(setup_s, 1)}
    for case in cases:
        par = case["par"]
        g = par.get("tp", 1) * par.get("pp", 1) * (1 if par.get("dp_attention") else par.get("dp", 1))
        if world % g:
            results[case["id"]] = {"errors": [f"case needs a multiple of {g} ranks, world is {world}"]}
            continue
        try:
            results[case["id"]] = run(eng, case)
        except Exception as e:  # noqa: BLE001 - reported to the test
            results[case["id"]] = {"errors": [f"{type(e).__name__}: {e}"], "traceback": traceback.format_exc()[-4000:]}
        _write_report(out, rank, results)     # case by case: a launch that stalls still says how far it got
        dist.barrier()
    results["_total_s"] = round(time.monotonic() - t0, 1)
    _write_report(out, rank, results)
    dist.barrier()


def _write_report(out: str, rank: int, results: dict) -> None:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1, default=str)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
