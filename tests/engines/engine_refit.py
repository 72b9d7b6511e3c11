"""Live refit into a REAL engine model, in the engine's venv (megatron-core installed beside it).

    tests/engines/engine_refit.py vllm|sglang refit JOB.json OUT_DIR    (four ranks, by rank_launch.run_ranks)

Ranks 0-1 are the trainer: a Megatron-Core DeepSeek-V3-style model (``mcore_cpu.build_dsv3_tiny``, TP2
with EP2 / expert-TP 1) on its own gloo world.  Ranks 2-3 are the engine: the engine's real model class
at TP2 on its own gloo world, built as in ``engine_worker.py``.  The four join one group by the
project's protocol (``join_group``, beside both worlds) and refit; the engine side goes through the
integration itself (vLLM: ``McoreReshardWorkerExtension`` methods and the ``mcore_reshard``
weight-transfer backend's worker engine; SGLang: the custom loader ``sglang_loader.load`` with
``mcore_reshard.*`` commands).  Reference: the engine's own ``load_weights`` of an HF export of the
same Megatron weights (gathered by the simple attribute path and renamed by hand,
``hf_tp_refit_worker.hf_reference``), into a second copy of the engine model; every parameter must
be bit-identical, and the refit model's parameters keep their storage.

Cases (run in order, one group): ``megatron`` (disaggregated: every Megatron shard straight to every
engine shard), ``hf_rank0`` (the trainer holds the HF export, +1, on rank 0 only), and for vLLM
``backend`` (the weight-transfer backend, Megatron weights perturbed again).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(os.path.dirname(HERE), "helpers")]   # engine scripts, shared helpers
ENGINE = sys.argv[1]
if ENGINE == "vllm":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import engine_models  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from rank_launch import install_stack_dump, rendezvous  # noqa: E402

TRAINERS = 2


def megatron_hf_config() -> dict:
    """The HF config of ``mcore_cpu.build_dsv3_tiny`` (4 layers, vocab 128, 4 expert groups, one MTP layer)."""
    return engine_models.dsv3(layers=4, vocab=128, n_group=4, mtp=1)


def wait_for(path: str, timeout: float = 600.0) -> None:
    t0 = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(path)
        time.sleep(0.2)


def checkpoint_of(hf: dict, cfg: dict, mtp: bool = False) -> dict:
    """Canonical (fused-expert) HF tensors -> the on-disk per-expert checkpoint the engines read
    (``mtp``: with the MTP layer and its own embed_tokens / shared_head.head copies, as DeepSeek ships it)."""
    from mcore_reshard.targets import from_hf_config, hf_layout
    from mcore_reshard.tools.synthetic import materialize
    mc = from_hf_config({**cfg, "num_nextn_predict_layers": cfg["num_nextn_predict_layers"] if mtp else 0})
    return materialize(hf_layout(mc, fused_experts=False, dtype="float32", mtp_copies=mtp), 0, hf)


def hf_export(chunks, cfg: dict) -> dict:
    """Megatron full tensors (simple attribute path) -> HF tensors by name, by hand, MTP layer included
    (Megatron ``mtp.layers.0.*`` is HF layer ``num_hidden_layers``)."""
    from hf_tp_refit_worker import hf_reference, world_reference
    full = world_reference(chunks, TRAINERS)
    n = cfg["num_hidden_layers"]
    own = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight", "eh_proj.weight": "eh_proj.weight",
           "final_layernorm.weight": "shared_head.norm.weight"}
    renamed, mtp_own = {}, {}
    for name, t in full.items():
        if name.startswith("mtp.layers.0."):
            rest = name[len("mtp.layers.0."):]
            if rest in own:
                mtp_own[f"model.layers.{n}.{own[rest]}"] = t
                continue
            for inner in ("mtp_model_layer.", "transformer_layer."):   # parameter / sharded_state_dict names
                rest = rest.removeprefix(inner)
            name = f"decoder.layers.{n}." + rest
        renamed[name] = t
    return {**hf_reference(renamed, chunks[0].config, "dsv3"), **mtp_own}


# ----------------------------------------------------------------------------------- trainer

def trainer(rank: int, out: str, cases: list) -> dict:
    # SGLang's venv ships flash_mla (CUDA-only: dlopen fails with OSError, which Megatron-Core's optional
    # ``from flash_mla import ...`` does not catch): make it a plain missing module for the trainer.
    sys.modules.setdefault("flash_mla", None)
    from megatron_refit_worker import perturb_replicated

    from mcore_reshard.integrations.protocol import join_group, join_refit, megatron_source
    from mcore_reshard.targets import from_hf_config, hf_layout
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    dist.init_process_group("gloo", init_method=rendezvous("trainers"), world_size=TRAINERS, rank=rank)
    mcore_cpu.init_megatron(tp=2, ep=2, etp=1)
    chunks = mcore_cpu.build_dsv3_tiny(dtype=torch.float32, mtp=True)
    cfg = megatron_hf_config()
    g = join_group(rendezvous("refit"), 4, rank, timeout_s=300)
    rep = {"role": "trainer", "errors": []}
    for step, case in enumerate(cases, start=1):
        perturb_replicated(chunks, step)
        hf = hf_export(chunks, cfg)
        kind = case["kind"]
        if kind == "hf_rank0":
            hf = {n: t + 1.0 for n, t in hf.items()}
        if rank == 0:
            path = os.path.join(out, f"export{step}.pt")
            torch.save(hf, path + ".tmp")
            os.replace(path + ".tmp", path)
        if kind == "megatron":
            src, tensors = megatron_source(chunks, rank)
            r = join_refit(g, src=src, src_tensors=tensors, ignore_unused=True, timeout=600)
            r.refit(step)
        elif kind == "hf_rank0":
            mc = from_hf_config(cfg)
            src = hf_layout(mc, rank=0, dtype="float32") if rank == 0 else None
            r = join_refit(g, src=src, src_tensors=hf if rank == 0 else {}, ignore_unused=True, timeout=600)
            r.refit(step)
        elif kind == "backend":
            from mcore_reshard.integrations import vllm_transfer
            vllm_transfer.register()
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
            calls = []

            class Client:   # the sender's control plane; the engine ranks make the same calls themselves
                def init_weight_transfer_engine(self, info):
                    calls.append(("init", info))

                def start_weight_update(self):
                    calls.append(("start",))

                def start_draft_weight_update(self):
                    calls.append(("start_draft",))

                def update_weights(self, info):
                    calls.append(("update", info))

                def finish_weight_update(self, weight_version=None):
                    calls.append(("finish",))

                def reset_prefix_cache(self):
                    calls.append(("reset_prefix_cache",))
            info = vllm_transfer.McoreReshardTrainerInitInfo(
                init_method=rendezvous("backend"), world_size=4, trainer_ranks=TRAINERS, rank=rank)
            src = vllm_transfer.MegatronSource(chunks, rank)
            eng = WeightTransferTrainerFactory.trainer_init(info, client=Client(), source=src)
            rep["prefix_cache_reset"] = eng.send_weights(version=step).get("prefix_cache_reset")  # the sender only
            eng.send_weights(draft=True, version=step)        # the MTP draft model
            rep["calls"] = [c[0] for c in calls]
            rep["worker_info"] = info.worker_info()
            eng.shutdown()
        dist.barrier()
    return rep


# ----------------------------------------------------------------------------------- engines

def compare(model, ref_model) -> tuple[int, list[str]]:
    got, want = dict(model.named_parameters()), dict(ref_model.named_parameters())
    errs = [f"{n}: only in one model" for n in sorted(set(got) ^ set(want))]
    n = 0
    for name in sorted(set(got) & set(want)):
        n += 1
        a, b = got[name].detach(), want[name].detach()
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            bad = int((a != b).sum()) if a.shape == b.shape else -1
            errs.append(f"{name}: refit != load_weights ({bad} elements differ)")
    return n, errs


def compare_derived(model, ref_model) -> tuple[dict, list[str]]:
    """Every tensor an engine's post-load processing derived and keeps OUTSIDE its parameters and
    buffers (SGLang's MLA ``w_kc`` / ``w_vc``, scales, fused or shuffled copies): plain tensor
    attributes of each module, bit for bit against the reference model's, after its own load
    (``load_weights``, which ends in ``post_load_weights``).  Returns ({attribute: count}, errors)."""
    want = dict(ref_model.named_modules())
    counts: dict[str, int] = {}
    errs = []
    for mname, mod in model.named_modules():
        ref = want.get(mname)
        for attr, a in vars(mod).items():
            if not isinstance(a, torch.Tensor) or attr.startswith("_") or isinstance(a, torch.nn.Parameter):
                continue
            b = getattr(ref, attr, None) if ref is not None else None
            counts[attr] = counts.get(attr, 0) + 1
            if not isinstance(b, torch.Tensor):
                errs.append(f"{mname}.{attr}: derived after the refit, missing from the reference")
            elif a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
                bad = int((a != b).sum()) if a.shape == b.shape else -1
                errs.append(f"{mname}.{attr}: refit + post-load != load_weights + post-load ({bad} elements differ)")
    return counts, errs


def vllm_engine(rank: int, out: str, cases: list) -> dict:
    from types import SimpleNamespace

    import engine_worker

    from mcore_reshard.integrations.vllm_worker import McoreReshardWorkerExtension
    os.environ.update(RANK=str(rank - TRAINERS), WORLD_SIZE=str(TRAINERS), LOCAL_RANK=str(rank - TRAINERS))
    eng = engine_worker.VllmEngine(rank - TRAINERS, TRAINERS, rendezvous("engines"))
    cfg = megatron_hf_config()
    vc = eng.config(cfg, {"tp": 2}, "dsv3_megatron")
    model = eng.build(vc)
    engine_worker.sentinel(model)
    rvc = eng.config(cfg, {"tp": 2}, "dsv3_megatron")     # a second model needs its own config (layer names)
    ref = eng.build(rvc)

    class Worker(McoreReshardWorkerExtension):
        pass
    w = Worker()
    w.vllm_config, w.model_runner, w.rank = vc, SimpleNamespace(model=model), rank - TRAINERS
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    rep = {"role": "engine", "errors": [], "checked": 0, "steps": []}
    w.mcore_reshard_join(rendezvous("refit"), 4, TRAINERS, 300.0)
    for step, case in enumerate(cases, start=1):
        kind = case["kind"]
        if kind in ("megatron", "hf_rank0"):
            w.mcore_reshard_prepare(ignore_unused=True, post_load="none")   # load_weights only: nothing processed
            rep["steps"].append(w.mcore_reshard_refit(step))
        elif kind == "backend":
            from vllm.config import WeightTransferConfig
            from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

            from mcore_reshard.integrations import vllm_transfer
            vllm_transfer.register()
            wt = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="mcore_reshard"), vc,
                                                           torch.device("cpu"), model)
            info = {"init_method": rendezvous("backend"), "world_size": 4, "rank_offset": TRAINERS,
                    "post_load": "none"}
            wt.init_transfer_engine(wt.parse_init_info(info))   # what the worker does on init_weight_transfer_engine
            wt.start_weight_update()
            wt.update_weights({"version": step})
            wt.finish_weight_update()
            # the draft update, as the worker's start_draft_weight_update / finish_weight_update do it
            draft = eng.build_mtp(vc)
            engine_worker.sentinel(draft)
            dptrs = {n: p.data_ptr() for n, p in draft.named_parameters()}
            wt.set_weight_update_target(draft, vc.model_config)
            wt.start_weight_update()
            wt.update_weights({"version": step})
            wt.finish_weight_update()
            wt.reset_weight_update_target()
            rep["steps"] += wt.reports
            rep["backend"] = type(wt).__name__
            wt.shutdown()
        path = os.path.join(out, f"export{step}.pt")
        wait_for(path)
        hf = torch.load(path)
        engine_worker.sentinel(ref)
        eng.load(ref, rvc, checkpoint_of(hf, cfg))
        n, errs = compare(model, ref)
        rep["checked"] += n
        rep["errors"] += [f"{kind}: {e}" for e in errs]
        if kind == "backend":
            ref_draft = eng.build_mtp(rvc)
            engine_worker.sentinel(ref_draft)
            eng.load(ref_draft, rvc, checkpoint_of(hf, cfg, mtp=True))
            n, errs = compare(draft, ref_draft)
            rep["draft_checked"] = n
            rep["checked"] += n
            rep["errors"] += [f"{kind} (MTP draft): {e}" for e in errs]
            rep["draft_same_storage"] = dptrs == {n: p.data_ptr() for n, p in draft.named_parameters()}
        dist.barrier()
    rep["same_storage"] = ptrs == {n: p.data_ptr() for n, p in model.named_parameters()} and \
        rep.get("draft_same_storage", True)
    return rep


def sglang_engine(rank: int, out: str, cases: list) -> dict:
    import sglang_worker

    from mcore_reshard.integrations import sglang_loader
    os.environ.update(RANK=str(rank - TRAINERS), WORLD_SIZE=str(TRAINERS), LOCAL_RANK=str(rank - TRAINERS))
    eng = sglang_worker.SGLangEngine(rank - TRAINERS, TRAINERS, rendezvous("engines"))
    cfg = megatron_hf_config()
    par = {"tp": 2}
    model = eng.build(cfg, par, "dsv3_megatron")
    sglang_worker.sentinel(model)
    ref = eng.build(cfg, par, "dsv3_megatron", reinit=False)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    rep = {"role": "engine", "errors": [], "checked": 0, "steps": []}
    s = sglang_loader.session()
    sglang_loader.load(model, [sglang_loader.command("join", init_method=rendezvous("refit"), world_size=4,
                                                     rank_offset=TRAINERS, **{"raise": True})])
    for step, case in enumerate(cases, start=1):
        kind = case["kind"]
        sglang_loader.load(model, [sglang_loader.command("prepare", ignore_unused=True, **{"raise": True})])
        if s.last_error:
            rep["errors"].append(f"{kind} prepare: {s.last_error}")
        sglang_loader.load(model, [sglang_loader.command("refit", version=step)])
        rep["steps"].append(s.reports[-1] if s.reports else None)
        rep["spec_kwargs"] = s.spec["kwargs"] if s.spec else None
        path = os.path.join(out, f"export{step}.pt")
        wait_for(path)
        hf = torch.load(path)
        sglang_worker.sentinel(ref)
        eng.load(ref, checkpoint_of(hf, cfg))
        n, errs = compare(model, ref)
        rep["checked"] += n
        rep["errors"] += [f"{kind}: {e}" for e in errs]
        rep["derived"], errs = compare_derived(model, ref)
        rep["errors"] += [f"{kind} (derived): {e}" for e in errs]
        dist.barrier()
    rep["same_storage"] = ptrs == {n: p.data_ptr() for n, p in model.named_parameters()}
    return rep


def main() -> None:
    engine, _mode, job, out = sys.argv[1:5]
    rank = int(os.environ["RANK"])
    install_stack_dump()
    with open(job) as f:
        cases = json.load(f)
    os.makedirs(out, exist_ok=True)
    t0 = time.monotonic()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE",
              "TORCHELASTIC_USE_AGENT_STORE"):
        os.environ.pop(k, None)
    try:
        if rank < TRAINERS:
            rep = trainer(rank, out, cases)
        else:
            rep = (vllm_engine if engine == "vllm" else sglang_engine)(rank, out, cases)
    except Exception as e:  # noqa: BLE001
        rep = {"errors": [f"{type(e).__name__}: {e}"], "traceback": traceback.format_exc()[-4000:]}
    rep["seconds"] = round(time.monotonic() - t0, 1)
    results = {c["id"]: rep for c in cases}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
