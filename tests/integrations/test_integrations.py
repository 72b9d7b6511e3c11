"""Engine integrations (vLLM worker extension, SGLang custom loader, the shared protocol, hooks)
against fake engines, over real gloo process groups.

One launch of 4 processes runs every multi-process scenario: spawn ranks 0-1 are engine workers
(tp_rank = spawn rank, as in an engine's own world), spawn ranks 2-3 are trainer ranks.  Both sides
join a *second* group with :func:`join_group` (as inside a real engine, whose world already exists):
trainer ranks 0-1, workers ``rank_offset=2 + tp_rank``.  The fake engines hold ``torch.zeros``
parameters shaped and named like the engine's runtime parameters (from the target layouts) plus the
derived MLA tensors an engine keeps; the reference for every parameter is
``materialize(target_layout, rank, full)`` and for derived tensors an inline re-derivation written
here (vLLM: ``kv_b.T.view(L, N, P+V)`` split/permute; SGLang: ``unflatten``/``split``).
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import types

import pytest
import torch
from repo_paths import ROOT

from mcore_reshard.core.executor import ReshardError
from mcore_reshard.integrations import hooks
from mcore_reshard.integrations.protocol import (
    build_layout,
    check_tensors,
    join_group,
    join_refit,
    layout_spec,
    live_tensors,
    rank_part,
)
from mcore_reshard.integrations.sglang_loader import COMMAND_PREFIX, command, decode, load, session
from mcore_reshard.integrations.vllm_worker import McoreReshardWorkerExtension
from mcore_reshard.targets import canonical_tensors, dsv3_tiny, from_hf_config, hf_layout, sglang_layout, vllm_layout
from mcore_reshard.tools.launch import spawn
from mcore_reshard.tools.synthetic import materialize, reference_tensor

CFG = dsv3_tiny()
DT = "float32"
P, V, L = CFG.qk_nope_head_dim, CFG.v_head_dim, CFG.kv_lora_rank
OFFSET = 2


# ----------------------------------------------------------------------------------- fakes

def hf_dict(cfg) -> dict:
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "intermediate_size", "n_routed_experts", "moe_intermediate_size", "n_shared_experts",
            "first_k_dense_replace", "moe_layer_freq", "n_group", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers", "tie_word_embeddings")
    return {**{k: getattr(cfg, k) for k in keys}, "topk_method": "noaux_tc"}


def full_tensors(step: int) -> dict[str, torch.Tensor]:
    return {m.name: reference_tensor(m.name, m.shape, torch.float32, step) for m in canonical_tensors(CFG, DT)}


def populate(root: torch.nn.Module, shapes: dict, rename: dict | None = None) -> torch.nn.Module:
    """Zero parameters named and shaped like ``shapes`` (dotted names become submodules)."""
    for name, shape in sorted(shapes.items()):
        name = (rename or {}).get(name, name)
        *path, leaf = name.split(".")
        m = root
        for part in path:
            if part not in m._modules:
                m.add_module(part, torch.nn.Module())
            m = m._modules[part]
        m.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape), requires_grad=False))
    return root


def shapes_of(layout, rank: int) -> dict:
    return {n: b.shape for n, b in layout.buffers[rank].items()}


def vllm_absorb_ref(kv_b: torch.Tensor):
    n = kv_b.shape[0] // (P + V)
    w = kv_b.T.view(L, n, P + V)
    uk, uv = w.split([P, V], dim=-1)
    return uk.permute(1, 2, 0), uv.transpose(0, 1)


def sglang_absorb_ref(kv_b: torch.Tensor):
    w_kc, w_vc = kv_b.unflatten(0, (-1, P + V)).split([P, V], dim=1)
    return w_kc, w_vc.transpose(1, 2)


class FakeRunner:
    """``GPUModelRunner`` stand-in: the model and a prefix-cache reset that records calls."""

    def __init__(self, model):
        self.model = model
        self.resets: list[int] = []

    def reset_prefix_cache(self):
        self.resets.append(len(self.resets))
        return True


def fake_vllm_model(layout, rank: int, rename: dict | None = None) -> torch.nn.Module:
    """vLLM-like model; MLA absorbed weights on ``self_attn.mla_attn.impl``: layer 0 keeps views of
    ``kv_b_proj`` (bf16 path), the others contiguous copies (the ``.contiguous()`` variants)."""
    model = populate(torch.nn.Module(), shapes_of(layout, rank), rename)
    for layer in range(CFG.num_hidden_layers):
        attn = model.get_submodule(f"model.layers.{layer}.self_attn")
        uk, uv = vllm_absorb_ref(attn.kv_b_proj.weight.detach())
        if layer:
            uk, uv = uk.contiguous(), uv.contiguous()
        attn.add_module("mla_attn", torch.nn.Module())
        attn.mla_attn.impl = types.SimpleNamespace(W_UK_T=uk, W_UV=uv, kv_b_proj=attn.kv_b_proj)
    return model


class FakeVllmWorker(McoreReshardWorkerExtension):
    def __init__(self, local_rank: int, model, tp: int = 2, enable_expert_parallel: bool = False):
        pc = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1,
                                   data_parallel_rank=0, enable_expert_parallel=enable_expert_parallel, enable_eplb=False)
        mc = types.SimpleNamespace(hf_config=hf_dict(CFG), dtype=torch.float32, quantization=None)
        self.vllm_config = types.SimpleNamespace(model_config=mc, parallel_config=pc)
        self.rank = local_rank
        self.model_runner = FakeRunner(model)


class FakeDeepseekV3ForCausalLM(torch.nn.Module):
    """SGLang-like model: runtime parameters, ``w_kc``/``w_vc`` copies with SGLang's strides, and a
    ``post_load_weights`` that re-derives them for the layers named in ``weight_names``."""

    def __init__(self, layout, rank: int, fused: bool):
        super().__init__()
        populate(self, shapes_of(layout, rank))
        self.config = hf_dict(CFG)
        self.num_fused_shared_experts = int(fused)
        self.post_load_calls: list = []
        for layer in range(CFG.num_hidden_layers):
            attn = self.get_submodule(f"model.layers.{layer}.self_attn")
            kc, vc = sglang_absorb_ref(attn.kv_b_proj.weight.detach())
            attn.w_kc = kc.transpose(1, 2).contiguous().transpose(1, 2)     # SGLang's storage order
            attn.w_vc = vc.transpose(1, 2).contiguous().transpose(1, 2)

    def post_load_weights(self, is_nextn=False, weight_names=None):
        self.post_load_calls.append(sorted(weight_names or []))
        for layer in sorted({int(n.split(".")[2]) for n in weight_names or [] if "kv_b_proj" in n}):
            attn = self.get_submodule(f"model.layers.{layer}.self_attn")
            kc, vc = sglang_absorb_ref(attn.kv_b_proj.weight.detach())
            attn.w_kc.copy_(kc)
            attn.w_vc.copy_(vc)


def compare(model, want: dict) -> list[str]:
    got = dict(model.named_parameters())
    bad = sorted(set(want) ^ set(got))
    bad += [n for n in sorted(set(want) & set(got)) if not torch.equal(got[n].detach(), want[n])]
    return bad


def ptrs(model) -> dict:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------- the launch

def _trainer(g, src, tensors, expect_error: bool = False, steps=(), keep: dict | None = None, **kw) -> dict:
    try:
        r = join_refit(g, src=src, src_tensors=tensors, timeout=60, **kw)
    except ReshardError as e:
        return {"error": str(e), "expected": expect_error}
    if keep is not None:
        keep["resharder"] = r
    for step, full in steps:
        # the trainer's weights change in place between refits (an optimizer step)
        new = materialize(build_layout(src) if isinstance(src, dict) else src, dist_rank(g), full)
        for n, t in tensors.items():
            t.copy_(new[n])
        r.refit(step)
    return {"error": None, "rounds": r.plan.rounds, "messages": len(r.plan.messages)}


def outcome(fn) -> dict:
    """``{"type", "error", "value"}`` of ``fn()`` (type None: it returned)."""
    try:
        return {"type": None, "error": None, "value": fn()}
    except Exception as e:  # noqa: BLE001 - the test judges the type
        return {"type": type(e).__name__, "error": str(e), "value": None}


def dist_rank(g) -> int:
    import torch.distributed as dist
    return dist.get_rank(g)


def scenarios(rank: int, world: int, tmp: str) -> dict:
    out: dict = {}
    full = {1: full_tensors(1), 2: full_tensors(2)}
    trainer = rank >= 2
    tr = rank - 2
    # ---------------- vLLM: join the shared group (trainer ranks 0-1, workers 2-3)
    if trainer:
        g = join_group(f"file://{tmp}/vllm", 4, tr, timeout_s=60)
    else:
        lay1 = vllm_layout(CFG, tp=2, rank_offset=OFFSET, dtype=DT)
        model = fake_vllm_model(lay1, OFFSET + rank)
        w = FakeVllmWorker(rank, model)
        out["join"] = w.mcore_reshard_join(f"file://{tmp}/vllm", 4, OFFSET, 60.0)
    opts = dict(ignore_unused=True, budget_bytes=1 << 16)

    # 1. vLLM tp=2 from an unsharded HF source replicated on both trainer ranks; two refits
    if trainer:
        src = hf_layout(CFG, rank=tr, dtype=DT)
        S = materialize(src, tr, full[1])
        kept: dict = {}
        out["vllm_hf"] = _trainer(g, src, S, steps=[(1, full[1]), (2, full[2])], keep=kept, **opts)
    else:
        gr = OFFSET + rank
        before = ptrs(model)
        uk_ptr = [model.get_submodule(f"model.layers.{i}.self_attn.mla_attn").impl.W_UK_T.data_ptr() for i in range(4)]
        prep = w.mcore_reshard_prepare(**opts)
        res = {"prepare": prep, "refits": []}
        for step in (1, 2):
            rep = w.mcore_reshard_refit(step)
            attn = [model.get_submodule(f"model.layers.{i}.self_attn") for i in range(4)]
            mla_ok = all(torch.equal(a.mla_attn.impl.W_UK_T, vllm_absorb_ref(a.kv_b_proj.weight.detach())[0]) and
                         torch.equal(a.mla_attn.impl.W_UV, vllm_absorb_ref(a.kv_b_proj.weight.detach())[1]) for a in attn)
            res["refits"].append({"bad": compare(model, materialize(lay1, gr, full[step])), "mla_ok": mla_ok,
                                  "post": rep["post_refit"], "version": rep["version"]})
        res["ptrs_same"] = before == ptrs(model) and uk_ptr == [
            model.get_submodule(f"model.layers.{i}.self_attn.mla_attn").impl.W_UK_T.data_ptr() for i in range(4)]
        res["resets"] = len(w.model_runner.resets)
        res["state"] = w.mcore_reshard_state()["version"]
        out["vllm_hf"] = res

    # 1b. worker 1 calls prepare (join_refit) a second time while every other rank refits: refused on
    #     every rank (the library's error), nothing moves, the worker lives, and the next refit lands
    if trainer:
        r = kept["resharder"]
        for n, t in materialize(src, tr, full[1]).items():    # new weights: what refit 3 must land
            S[n].copy_(t)
        out["rejoin"] = {"first": outcome(lambda: r.refit(3) and None), "second": outcome(lambda: r.refit(3)["version"])}
    else:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        first = outcome(lambda: (w.mcore_reshard_prepare(**opts) if rank == 1 else w.mcore_reshard_refit(3)) and None)
        untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        second = outcome(lambda: w.mcore_reshard_refit(3)["version"])
        out["rejoin"] = {"first": first, "second": second, "untouched": untouched,
                         "bad": compare(model, materialize(lay1, OFFSET + rank, full[1]))}

    # 1c. worker 0 replaces a module of its engine (model.norm) after prepare: vLLM's binding cannot
    #     follow it (its loader-format buffers are per module), so refit 4 is refused on every rank naming
    #     it, nothing moves; with the module put back, refit 4 lands
    if trainer:
        out["vllm_swap"] = {"first": outcome(lambda: r.refit(4) and None), "second": outcome(lambda: r.refit(4)["version"])}
    else:
        import copy
        norm = model.model.norm
        if rank == 0:
            model.model.norm = copy.deepcopy(norm)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        first = outcome(lambda: w.mcore_reshard_refit(4) and None)
        untouched = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        model.model.norm = norm
        out["vllm_swap"] = {"first": first, "untouched": untouched, "second": outcome(lambda: w.mcore_reshard_refit(4)["version"])}

    # 2. vLLM tp=2 with expert parallelism, from a Megatron tp=2 ep=2 source given as a spec
    msrc = layout_spec("megatron", CFG, sizes={"tp": 2, "ep": 2, "etp": 1}, dtype=DT)
    if trainer:
        out["vllm_mcore"] = _trainer(g, msrc, materialize(build_layout(msrc), tr, full[2]), steps=[(1, full[2])], **opts)
    else:
        lay2 = vllm_layout(CFG, tp=2, enable_expert_parallel=True, rank_offset=OFFSET, dtype=DT)
        model2 = fake_vllm_model(lay2, OFFSET + rank)
        w.model_runner = FakeRunner(model2)
        w.vllm_config.parallel_config.enable_expert_parallel = True
        before = ptrs(model2)
        w.mcore_reshard_prepare(**opts)
        w.mcore_reshard_refit(1)
        out["vllm_mcore"] = {"bad": compare(model2, materialize(lay2, OFFSET + rank, full[2])),
                             "ptrs_same": before == ptrs(model2), "resets": len(w.model_runner.resets)}

    # 3. a worker whose parameter names do not match the layout: every rank refuses, nothing moves
    if trainer:
        src = hf_layout(CFG, rank=tr, dtype=DT)
        out["vllm_bad"] = _trainer(g, src, materialize(src, tr, full[1]), expect_error=True, **opts)
    else:
        w.vllm_config.parallel_config.enable_expert_parallel = False
        rename = {"model.norm.weight": "model.final_norm.weight"} if rank == 1 else None
        model3 = fake_vllm_model(lay1, OFFSET + rank, rename)
        w.model_runner = FakeRunner(model3)
        try:
            w.mcore_reshard_prepare(**opts)
            out["vllm_bad"] = {"error": None}
        except ReshardError as e:
            out["vllm_bad"] = {"error": str(e), "untouched": all(not p.any() for p in model3.parameters())}

    # ---------------- SGLang: DP attention (tp=2, dp=2), shared expert fused as slot E, via the loader
    sg = sglang_layout(CFG, tp=2, dp=2, enable_dp_attention=True, fuse_shared_expert=True, rank_offset=OFFSET, dtype=DT)
    layout_kw = {"tp": 2, "dp": 2, "enable_dp_attention": True}
    if trainer:
        g2 = join_group(f"file://{tmp}/sglang", 4, tr, timeout_s=60)
        S2, kept2 = materialize(build_layout(msrc), tr, full[1]), {}
        out["sglang"] = _trainer(g2, msrc, S2, steps=[(1, full[1]), (2, full[2])], keep=kept2, **opts)
    else:
        sm = FakeDeepseekV3ForCausalLM(sg, OFFSET + rank, fused=True)
        before = ptrs(sm)
        kc_ptr = sm.get_submodule("model.layers.1.self_attn").w_kc.data_ptr()
        load(sm, [command("join", init_method=f"file://{tmp}/sglang", world_size=4, rank_offset=OFFSET, timeout_s=60)])
        load(sm, [command("prepare", layout=layout_kw, **opts)])
        res = {"rank": session().rank, "refits": []}
        for step in (1, 2):
            load(sm, [command("refit", version=step)])
            attn = [sm.get_submodule(f"model.layers.{i}.self_attn") for i in range(4)]
            absorbed_ok = all(torch.equal(a.w_kc, sglang_absorb_ref(a.kv_b_proj.weight.detach())[0]) and
                              torch.equal(a.w_vc, sglang_absorb_ref(a.kv_b_proj.weight.detach())[1]) for a in attn)
            res["refits"].append({"bad": compare(sm, materialize(sg, OFFSET + rank, full[step])),
                                  "absorbed_ok": absorbed_ok})
        res["post_load_calls"] = list(sm.post_load_calls)
        res["ptrs_same"] = before == ptrs(sm) and kc_ptr == sm.get_submodule("model.layers.1.self_attn").w_kc.data_ptr()
        res["last_error"] = session().last_error
        res["hooks"] = [h["hook"] for h in session().reports[-1]["hooks"]]
        out["sglang"] = res

    # 4b. worker 1 replaces a module of its SGLang model (model.norm, a zeroed copy) after two refits;
    #     the trainer loads step 1's weights again: refit 3 follows the new module (SGLang writes its
    #     parameters in place, so the binding can move to the new ones), the old module keeps its bytes
    if trainer:
        for n, t in materialize(build_layout(msrc), tr, full[1]).items():
            S2[n].copy_(t)
        out["sglang_swap"] = {"refit": outcome(lambda: kept2["resharder"].refit(3)["version"])}
    else:
        import copy
        old_norm = sm.model.norm
        kept = {n: p.detach().clone() for n, p in old_norm.named_parameters()}
        if rank == 1:
            sm.model.norm = copy.deepcopy(old_norm).requires_grad_(False)
            with torch.no_grad():
                for p in sm.model.norm.parameters():
                    p.zero_()
        ref = outcome(lambda: load(sm, [command("refit", version=3)]))
        out["sglang_swap"] = {"refit": ref, "bad": compare(sm, materialize(sg, OFFSET + rank, full[1])),
                              "old_kept": all(torch.equal(kept[n], p) for n, p in old_norm.named_parameters()),
                              "swapped": sm.model.norm is not old_norm}

    # 5. SGLang worker whose model is not what the layout says (fusion claimed, 8 expert slots held)
    if trainer:
        out["sglang_bad"] = _trainer(g2, msrc, materialize(build_layout(msrc), tr, full[1]), expect_error=True, **opts)
    else:
        unfused = sglang_layout(CFG, tp=2, dp=2, enable_dp_attention=True, fuse_shared_expert=False,
                                rank_offset=OFFSET, dtype=DT)
        bad_model = FakeDeepseekV3ForCausalLM(unfused, OFFSET + rank, fused=True) if rank == 0 else \
            FakeDeepseekV3ForCausalLM(sg, OFFSET + rank, fused=True)
        load(bad_model, [command("prepare", layout=layout_kw, **opts)])   # refused: logged, not raised
        out["sglang_bad"] = {"last_error": session().last_error,
                             "untouched": all(not p.any() for p in bad_model.parameters())}
    return out


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as tmp:
        return spawn(scenarios, 4, tmp, timeout=300, pg_timeout=60)


# ----------------------------------------------------------------------------------- multi-process tests

@pytest.mark.multiproc
def test_vllm_refit_from_hf_source_bit_exact_in_place(runs):
    assert [r["join"]["rank"] for r in runs[:2]] == [2, 3]
    for r in runs[2:]:
        assert r["vllm_hf"]["error"] is None and r["vllm_hf"]["rounds"] > 1
    for r in runs[:2]:
        res = r["vllm_hf"]
        assert res["prepare"]["buffers"] == 55
        for step in res["refits"]:
            assert step["bad"] == [] and step["mla_ok"], step
            mla = [h for h in step["post"]["hooks"] if h["hook"] == "mla_absorb"][0]
            assert mla["views"] == ["model.layers.0.self_attn.mla_attn.impl"]          # bf16 path: nothing to do
            assert len(mla["recomputed"]) == 3 and not mla["refused"]                 # copies: copy_ in place
            cache = [h for h in step["post"]["hooks"] if h["hook"] == "prefix_cache"][0]
            assert cache["done"] and cache["owner"] == "FakeRunner"
        assert [s["version"] for s in res["refits"]] == [1, 2] and res["state"] == 2
        assert res["ptrs_same"] and res["resets"] == 2


@pytest.mark.multiproc
def test_second_join_refused_on_every_rank_worker_lives(runs):
    """A worker calling prepare (join_refit) again while its peers refit: gloo used to abort the worker's
    process on the mismatched collective sizes (its peers then got TransferError).  Now every rank
    raises ReshardError naming the steps, nothing moves, and the next refit lands bit-exact."""
    for k, r in enumerate(runs):
        o = r["rejoin"]
        assert o["first"]["type"] == "ReshardError", (k, o["first"])
        assert "different protocol steps" in o["first"]["error"] and "metadata exchange" in o["first"]["error"], o
        assert "ranks [3] in metadata exchange" in o["first"]["error"], o["first"]["error"]
        assert o["second"] == {"type": None, "error": None, "value": 3}, (k, o["second"])
    for r in runs[:2]:
        assert r["rejoin"]["untouched"] and r["rejoin"]["bad"] == [], r["rejoin"]


@pytest.mark.multiproc
def test_engine_module_replaced_after_prepare(runs):
    """vLLM (loader-format buffers bound per module: cannot follow): a module the engine replaced after
    prepare makes every rank refuse the refit naming it and the rank, nothing moves; put back, the
    refit lands.  SGLang (parameters written in place): the binding follows the new module."""
    for k, r in enumerate(runs):
        o = r["vllm_swap"]
        assert o["first"]["type"] == "ReshardError", (k, o)
        assert "rank 2: dst module model: model.norm (Module) was replaced after binding" in o["first"]["error"], o
        assert o["second"]["type"] is None and o["second"]["value"] == 4, (k, o)
    assert all(r["vllm_swap"]["untouched"] for r in runs[:2])
    for k, r in enumerate(runs):
        o = r["sglang_swap"]
        assert o["refit"]["type"] is None, (k, o)
    for r in runs[:2]:
        assert r["sglang_swap"]["bad"] == [], r["sglang_swap"]       # step 1's weights, in the new module on rank 1
    assert runs[1]["sglang_swap"]["swapped"] and runs[1]["sglang_swap"]["old_kept"]   # the old one not written
    assert not runs[0]["sglang_swap"]["swapped"]


@pytest.mark.multiproc
def test_vllm_refit_expert_parallel_from_megatron_spec(runs):
    for r in runs[2:]:
        assert r["vllm_mcore"]["error"] is None
    for r in runs[:2]:
        assert r["vllm_mcore"] == {"bad": [], "ptrs_same": True, "resets": 1}


@pytest.mark.multiproc
def test_vllm_name_mismatch_refused_everywhere_before_transfer(runs):
    for r in runs:
        err = r["vllm_bad"]["error"]
        assert err and "rank 3" in err and "model.norm.weight" in err and "model.final_norm.weight" in err, err
        assert "refused before any transfer" in err
    assert all(r["vllm_bad"]["untouched"] for r in runs[:2])


@pytest.mark.multiproc
def test_sglang_loader_refit_dp_attention_fused_shared_expert(runs):
    for r in runs[2:]:
        assert r["sglang"]["error"] is None
    for k, r in enumerate(runs[:2]):
        res = r["sglang"]
        assert res["rank"] == OFFSET + k and res["last_error"] is None
        for step in res["refits"]:
            assert step["bad"] == [] and step["absorbed_ok"], step
        kv_b = [f"model.layers.{i}.self_attn.kv_b_proj.weight" for i in range(4)]
        assert res["post_load_calls"] == [kv_b, kv_b]
        assert res["ptrs_same"] and res["hooks"] == ["fp8_guard", "mla_post_load", "flush_cache"]


@pytest.mark.multiproc
def test_sglang_shape_mismatch_refused_everywhere(runs):
    for r in runs[2:]:
        err = r["sglang_bad"]["error"]
        assert err and "rank 2" in err and "mlp.experts.w13_weight" in err, err
    assert "mlp.experts.w13_weight" in runs[0]["sglang_bad"]["last_error"]
    assert all(r["sglang_bad"]["untouched"] for r in runs[:2])


def megatron_part(rank: int, world: int) -> dict:
    """megatron_source on a live tiny Megatron-Core model equals the megatron spec's part."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from mcore_reshard.integrations.protocol import megatron_source
    from mcore_reshard.testing import megatron_cpu as mcore_cpu
    mcore_cpu.install_cpu_shims()
    mcore_cpu.init_megatron(1, 1)
    part, tensors = megatron_source(mcore_cpu.build_dsv3_tiny(mtp=True), rank)
    spec = build_layout(layout_spec("megatron", CFG, sizes={}, dtype=DT))
    a, b = part.buffers[rank], spec.buffers[rank]
    same = sorted(a) == sorted(b) and all(
        (a[n].shape, a[n].dtype, sorted(a[n].pieces, key=str)) == (b[n].shape, b[n].dtype, sorted(b[n].pieces, key=str))
        for n in a)
    out = {"buffers": len(a), "same": same, "tensors": sorted(tensors) == sorted(a)}
    out["swap"] = megatron_source_swap(mcore_cpu, megatron_source)
    return out


def megatron_source_swap(mcore_cpu, megatron_source) -> dict:
    """join_refit of two live Megatron models read by megatron_source (one rank: every copy local);
    then modules replaced on both sides (the source's layer-1 MoE by one with new values, the
    destination's by zeros): the next refit follows both; a source module with an extra (LoRA)
    parameter is refused, nothing moves."""
    import torch.distributed as dist
    from megatron_refit_worker import clone_module
    src, dst = mcore_cpu.build_dsv3_tiny(mtp=True), mcore_cpu.build_dsv3_tiny(mtp=True)
    with torch.no_grad():
        for p in src[0].parameters():
            p.add_(1.0)
    g = dist.new_group([0])
    sp, st = megatron_source(src, 0)
    dp, dt = megatron_source(dst, 0)
    r = join_refit(g, src=sp, src_tensors=st, dst=dp, dst_tensors=dt, timeout=60)
    r.refit()

    def same() -> list:
        want = dict(src[0].named_parameters())
        return sorted(n for n, p in dst[0].named_parameters() if not torch.equal(p, want[n]))
    out = {"first": same()}
    old_dst = dst[0].decoder.layers[1].mlp
    kept = {n: p.detach().clone() for n, p in old_dst.named_parameters()}
    src[0].decoder.layers[1].mlp = clone_module(src[0].decoder.layers[1].mlp, add=0.5)
    dst[0].decoder.layers[1].mlp = clone_module(old_dst)
    r.refit()
    out["followed"] = same()
    out["old_dst_kept"] = all(torch.equal(p, kept[n]) for n, p in old_dst.named_parameters())
    lp = src[0].decoder.layers[2].self_attention.linear_proj
    lora = clone_module(lp, add=0.0)
    lora.lora_A = torch.nn.Parameter(torch.zeros(4, lp.weight.shape[1]))
    src[0].decoder.layers[2].self_attention.linear_proj = lora
    before = {n: p.detach().clone() for n, p in dst[0].named_parameters()}
    out["lora"] = outcome(lambda: r.refit() and None)
    out["lora_untouched"] = all(torch.equal(before[n], p) for n, p in dst[0].named_parameters())
    return out


@pytest.mark.megatron
@pytest.mark.multiproc
def test_megatron_source_matches_megatron_spec():
    out = spawn(megatron_part, 1, timeout=300)[0]
    swap = out.pop("swap")
    assert out == {"buffers": 134, "same": True, "tensors": True}
    # join_refit of tensors read by megatron_source follows replaced modules on both sides, refuses a LoRA one
    assert swap["first"] == [] and swap["followed"] == [] and swap["old_dst_kept"], swap
    assert swap["lora"]["type"] == "ReshardError", swap["lora"]
    assert "rank 0: src module [0]: decoder.layers.2.self_attention.linear_proj" in swap["lora"]["error"], swap["lora"]
    assert "lora_A" in swap["lora"]["error"] and swap["lora_untouched"], swap


# ----------------------------------------------------------------------------------- single-process tests

def test_import_needs_no_engine():
    import mcore_reshard.integrations.probe  # noqa: F401
    import mcore_reshard.integrations.sglang_loader as sl
    import mcore_reshard.integrations.vllm_transfer as vt
    import mcore_reshard.integrations.vllm_worker as vw
    assert callable(sl.load) and hasattr(vw.McoreReshardWorkerExtension, "mcore_reshard_refit")
    assert vt.BACKEND == "mcore_reshard" and callable(vt.register)
    assert "vllm" not in sys.modules and "sglang" not in sys.modules    # nothing imported them
    assert sl._server_args() == {}          # without SGLang: nothing to read, no error


def test_hf_config_round_trip():
    assert from_hf_config(hf_dict(CFG)) == CFG


def test_vllm_mla_hook_views_copies_and_refusal():
    lay = vllm_layout(CFG, tp=2, dtype=DT)
    model = fake_vllm_model(lay, 0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    rep = hooks.vllm_mla_absorb(model)
    assert len(rep["views"]) == 1 and len(rep["recomputed"]) == 3
    for i in range(4):
        a = model.get_submodule(f"model.layers.{i}.self_attn")
        want = vllm_absorb_ref(a.kv_b_proj.weight.detach())
        assert torch.equal(a.mla_attn.impl.W_UK_T, want[0]) and torch.equal(a.mla_attn.impl.W_UV, want[1])
    impl = model.get_submodule("model.layers.2.self_attn.mla_attn").impl
    impl.W_UK_T = impl.W_UK_T.to(torch.float16)          # a quantized / other-dtype copy cannot be redone here
    with pytest.raises(hooks.PostRefitError, match="model.layers.2"):
        hooks.vllm_mla_absorb(model)
    assert hooks.vllm_mla_absorb(model, {"strict": False})["refused"]


def test_sglang_hook_without_post_load_weights_and_fp8_guard():
    sg = sglang_layout(CFG, tp=2, dtype=DT)
    model = FakeDeepseekV3ForCausalLM(sg, 0, fused=False)
    model.post_load_weights = None                       # an SGLang model without the method
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    ptr = model.get_submodule("model.layers.3.self_attn").w_vc.data_ptr()
    rep = hooks.run_post_refit("sglang", model, owners=[types.SimpleNamespace(flush_cache=lambda: True)])
    by = {h["hook"]: h for h in rep["hooks"]}
    assert by["mla_post_load"]["via"] == "copy_" and len(by["mla_post_load"]["layers"]) == 4
    assert by["flush_cache"]["done"] and by["fp8_guard"]["fp8_params"] == 0
    for i in range(4):
        a = model.get_submodule(f"model.layers.{i}.self_attn")
        want = sglang_absorb_ref(a.kv_b_proj.weight.detach())
        assert torch.equal(a.w_kc, want[0]) and torch.equal(a.w_vc, want[1])
    assert model.get_submodule("model.layers.3.self_attn").w_vc.data_ptr() == ptr
    model.model.layers._modules["0"].self_attn.kv_b_proj.register_parameter(
        "weight_scale_inv", torch.nn.Parameter(torch.ones(2, 2), requires_grad=False))
    with pytest.raises(hooks.PostRefitError, match="FP8"):
        hooks.run_post_refit("sglang", model)


def test_check_tensors_and_live_tensors():
    lay = vllm_layout(CFG, tp=2, rank_offset=OFFSET, dtype=DT)
    model = populate(torch.nn.Module(), shapes_of(lay, OFFSET), {"model.norm.weight": "model.norm.weights"})
    tensors, aliases = live_tensors({"": model})
    assert not aliases
    tensors["lm_head.weight"] = torch.zeros(3, 64)
    errs = " | ".join(check_tensors(lay, OFFSET, tensors, what="vLLM parameters"))
    assert "missing: model.norm.weight [64] float32 (the model has model.norm.weights)" in errs
    assert "not in the layout (would keep stale weights): model.norm.weights" in errs
    assert "of another shape or dtype: lm_head.weight [3, 64] float32 (layout: [64, 64] float32)" in errs
    assert "post-load" not in errs
    # an engine that emptied a parameter after loading (vLLM's CPU linears): the message says why
    tensors["lm_head.weight"] = torch.empty(0)
    errs = " | ".join(check_tensors(lay, OFFSET, tensors, what="vLLM parameters"))
    assert ("lm_head.weight [0] float32 (layout: [64, 64] float32) -- empty: the engine's post-load processing "
            "moved this weight elsewhere") in errs and "post_load='reprocess'" in errs
    # a drafter sharing the target's embedding: listed once, the alias reported
    draft = torch.nn.Module()
    draft.embed = model.model.embed_tokens.weight
    tensors, aliases = live_tensors({"": model, "mtp.": draft})
    assert aliases == {"mtp.embed": "model.embed_tokens.weight"}
    part = rank_part(lay, OFFSET, drop=["model.norm.weight"])
    assert part.ranks == [OFFSET] and "model.norm.weight" not in part.buffers[OFFSET]


def test_join_refit_single_process_group_and_spec_json(tmp_path):
    """One rank holding source and destination (world of 1): the protocol end to end in-process."""
    import torch.distributed as dist
    g = join_group(f"file://{tmp_path}/one", 1, 0, timeout_s=30)
    try:
        full = full_tensors(3)
        src = hf_layout(CFG, rank=0, dtype=DT)
        spec = layout_spec("vllm", CFG, tp=1, dtype=DT)
        dst = materialize(build_layout(spec), 0, full, fill=7.0)
        r = join_refit(g, src=src, src_tensors=materialize(src, 0, full), dst=spec, dst_tensors=dst, ignore_unused=True)
        r.refit()
        want = materialize(build_layout(spec), 0, full)
        assert all(torch.equal(dst[n], want[n]) for n in want)
        with pytest.raises(ReshardError, match="pass only this rank's buffers"):
            join_refit(g, src=vllm_layout(CFG, tp=2, dtype=DT), src_tensors={})
    finally:
        dist.destroy_process_group()


def test_loader_commands():
    name, t = command("refit", version=3)
    assert name == COMMAND_PREFIX + "refit" and decode(t) == {"version": 3} and t.dtype == torch.uint8
    with pytest.raises(ValueError):
        command("reboot")


@pytest.mark.parametrize("script", ["vllm_refit.py", "sglang_refit.py"])
def test_examples_without_engine(script):
    path = os.path.join(ROOT, "examples", script)
    out = subprocess.run([sys.executable, path], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "not installed" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "trainer" in out.stdout, out.stdout + out.stderr


def test_loader_casts_floating_only():
    """``allow_cast="loader"`` (the engine integrations' default): floating-point casts as an engine's
    ``load_weights`` makes them, anything else refused naming the tensor; the planner keeps refusing."""
    from mcore_reshard.core.layout import Layout, LayoutError
    from mcore_reshard.core.planner import PlanError, make_plan
    from mcore_reshard.integrations.protocol import loader_casts

    def lay(**dtypes):
        out = Layout()
        for name, dt in dtypes.items():
            out.add_tensor(name, (4,), dt)
        return out
    assert loader_casts(lay(w="float32", b="float32"), lay(w="float32", b="float32")) is False
    assert loader_casts(lay(w="float32", b="bfloat16"), lay(w="bfloat16", b="float32")) is True
    with pytest.raises(LayoutError, match=r"1 tensor\(s\) would need a cast no engine loader makes: idx \(int64 -> float32\)"):
        loader_casts(lay(w="float32", idx="int64"), lay(w="bfloat16", idx="float32"))
    src, dst = build_layout(layout_spec("hf", CFG, rank=0, dtype="float32")), build_layout(
        layout_spec("hf", CFG, rank=0, dtype="bfloat16"))
    with pytest.raises(PlanError, match="allow_cast"):
        make_plan(src, dst)
    assert loader_casts(src, dst) is True
    with pytest.raises(ValueError, match="allow_cast='bogus'"):
        join_refit(None, allow_cast="bogus")
