"""Scenarios for the Megatron-to-Megatron refit tests, run inside spawned gloo processes.

The reference is deliberately independent of the code under test: full tensors are rebuilt from
each parameter's own attributes (``tensor_model_parallel``, ``partition_dim``,
``partition_stride``, ``allreduce=False`` for experts), Megatron's process groups and the layers'
``layer_number`` by plain all-gathers, never from ``sharded_state_dict()`` (which the adapter reads).
Every rank reports a sha256 per full tensor; the test compares source and destination reports.
"""
from __future__ import annotations

import hashlib
import re
import time
import zlib

import torch
import torch.distributed as dist

from mcore_reshard.testing import megatron_cpu as mcore_cpu

BUILDERS = {"dsv3": "build_dsv3_tiny", "gqa": "build_gqa_dense_tiny", "qwen3": "build_qwen3_moe_tiny"}


def _global_name(chunk, name: str, ep_rank: int) -> str:
    m = re.search(r"local_experts\.(\d+)\.", name)
    if m:
        n_local = len(chunk.get_submodule(name[:m.start()].rstrip(".")).local_experts)
        name = name[:m.start()] + f"experts.{ep_rank * n_local + int(m.group(1))}." + name[m.end():]
    m = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if m:
        layer = chunk.decoder.layers[int(m.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}.{m.group(2)}"
    return name


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().flatten().view(torch.uint8).numpy().tobytes()).hexdigest()[:24]


def _gather(t: torch.Tensor, group, dim: int, stride: int) -> torch.Tensor:
    n = dist.get_world_size(group)
    if n == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    if stride == 1:
        return torch.cat(parts, dim)
    chunks = [p.chunk(stride, dim) for p in parts]
    return torch.cat([c[s] for s in range(stride) for c in chunks], dim)


def _named_tensors(chunk):
    yield from chunk.named_parameters()
    for n, b in chunk.named_buffers():
        if n.endswith("expert_bias"):
            yield n, b


def reference_digests(chunks) -> dict[str, list]:
    """Global name -> [shape, dtype, sha256 prefix] of every full tensor, by the simple path."""
    return {n: [list(t.shape), str(t.dtype), _digest(t)] for n, t in reference_full(chunks).items()}


def reference_full(chunks) -> dict[str, torch.Tensor]:
    """Global name -> full tensor, gathered by the simple attribute-driven path."""
    from megatron.core import parallel_state as ps
    tp_group, etp_group = ps.get_tensor_model_parallel_group(), ps.get_expert_tensor_parallel_group()
    ep_rank = ps.get_expert_model_parallel_rank()
    out = {}
    for chunk in chunks:
        for name, p in _named_tensors(chunk):
            full = p.detach()
            if getattr(p, "tensor_model_parallel", False):
                group = etp_group if getattr(p, "allreduce", True) is False else tp_group
                full = _gather(full, group, p.partition_dim, getattr(p, "partition_stride", 1))
            out[_global_name(chunk, name, ep_rank)] = full
    return out


def perturb_replicated(chunks, step: int = 0) -> None:
    """Give replicated tensors (norms, router, expert bias) values that depend on their global
    name only (Megatron initialises norms to ones and the bias to zeros: too easy to pass)."""
    from megatron.core import parallel_state as ps
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            for name, p in _named_tensors(chunk):
                if getattr(p, "tensor_model_parallel", False):
                    p.add_(0.01 * step)
                    continue
                g = torch.Generator().manual_seed(zlib.crc32(_global_name(chunk, name, ep_rank).encode()) + step)
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))


def clone_module(module: torch.nn.Module, add: float | None = None) -> torch.nn.Module:
    """A new module object like ``module`` (what a LoRA merge or a re-wrap puts in its place): a deep
    copy sharing the process groups, every parameter ``+ add`` (``None``: zeros)."""
    import copy
    copy._deepcopy_dispatch[dist.ProcessGroup] = lambda pg, memo: pg     # groups are shared, not copied
    new = copy.deepcopy(module)
    with torch.no_grad():
        for (_, old), (_, p) in zip(module.named_parameters(), new.named_parameters()):
            p.__dict__.update(old.__dict__)      # Megatron's tensor_model_parallel, partition_dim, allreduce
            p.copy_(p + add) if add is not None else p.zero_()
    return new


def swapped(name: str, full: torch.Tensor, buffers: set) -> torch.Tensor:
    """The full tensor ``name`` of the source after :func:`swap_scenario`'s replacements (PP=1: local
    layer numbers are global)."""
    if name.startswith("decoder.layers.1.mlp.") and name not in buffers:
        return full + 0.5
    if name == "decoder.layers.0.mlp.linear_fc2.weight":
        return full - 0.25
    return full


def swap_scenario(src, dst, refit, is_src: bool, is_dst: bool) -> dict:
    """After refit 1, modules are replaced on both sides: the source's ``decoder.layers[1].mlp`` by
    one with new values (LoRA merged into a new module), its layer-0 ``linear_fc2.weight`` by a new
    parameter object, the destination's ``decoder.layers[1].mlp`` by a zeroed copy (an engine that
    swapped a layer); refit 2 must follow them all (bit-exact into the new destination module, the
    old one untouched).  Then the source's ``decoder.layers[2].self_attention.linear_proj`` gets a
    module with an extra (LoRA) parameter: refit 3 is refused on every rank naming it, nothing moves."""
    out = {}
    t0 = time.perf_counter()       # what every refit adds when nothing changed: one walk per side
    for ident in refit.identities:
        assert ident.check() == ([], {})
    out["check_s"] = time.perf_counter() - t0
    old_dst_mlp = [c.decoder.layers[1].mlp for c in dst] if is_dst else []
    old_bytes = [{n: p.detach().clone() for n, p in m.named_parameters()} for m in old_dst_mlp]
    if is_src:
        for c in src:
            c.decoder.layers[1].mlp = clone_module(c.decoder.layers[1].mlp, add=0.5)
            fc2 = c.decoder.layers[0].mlp.linear_fc2
            new_w = torch.nn.Parameter(fc2.weight.detach() - 0.25, requires_grad=fc2.weight.requires_grad)
            new_w.__dict__.update(fc2.weight.__dict__)
            fc2.weight = new_w
    if is_dst:
        for c in dst:
            c.decoder.layers[1].mlp = clone_module(c.decoder.layers[1].mlp)
    out["second"] = refit.refit()["version"]
    out["old_dst_untouched"] = all(torch.equal(b[n], p) for m, b in zip(old_dst_mlp, old_bytes) for n, p in m.named_parameters())
    before = {n: p.detach().clone() for c in dst for n, p in c.named_parameters()} if is_dst else {}
    if is_src:
        lp = src[0].decoder.layers[2].self_attention.linear_proj
        lora = clone_module(lp, add=0.0)
        lora.lora_A = torch.nn.Parameter(torch.zeros(4, lp.weight.shape[1]))
        src[0].decoder.layers[2].self_attention.linear_proj = lora
    try:
        refit.refit()
        out["lora"] = {"type": None, "error": None}
    except Exception as e:  # noqa: BLE001 - the test judges the type
        out["lora"] = {"type": type(e).__name__, "error": str(e)[:3000]}
    out["lora_untouched"] = all(torch.equal(before[n], p) for c in dst for n, p in c.named_parameters())
    if is_src:
        src[0].decoder.layers[2].self_attention.linear_proj = lp      # put back: the digests below are refit 2's
    return out


def _build(kind: str, sizes: dict, dtype: torch.dtype, kw: dict, order: str = "tp-cp-ep-dp-pp"):
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()   # keep the previous model's groups alive: it still uses them
    mcore_cpu.init_megatron(sizes.get("tp", 1), sizes.get("pp", 1), ep=sizes.get("ep", 1), etp=sizes.get("etp"),
                            vpp=sizes.get("vpp"), cp=sizes.get("cp", 1), order=order)
    extra = {k: sizes[k] for k in ("first_stage_layers", "last_stage_layers") if k in sizes}
    return getattr(mcore_cpu, BUILDERS[kind])(dtype=dtype, **kw, **extra)


def refit_scenarios(rank: int, world: int, cases: list) -> list:
    """Each case: {"model", "src", "dst", "dtype", "kw", "disaggregated"}.

    Colocated: both models on every rank.  Disaggregated: the first half of the ranks train (the
    source model is built with dp slowest, so ranks [0, world/2) hold one whole replica), the
    second half infer; each rank hands the refit only its own side's chunks, so every byte
    crosses between disjoint rank sets.  Reports come from the side that took part."""
    from mcore_reshard.refit import MegatronRefit
    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    results = []
    for case in cases:
        dtype = getattr(torch, case.get("dtype", "float32"))
        kw = case.get("kw", {})
        disagg = case.get("disaggregated", False)
        is_src = not disagg or rank < world // 2
        is_dst = not disagg or rank >= world // 2
        src = _build(case["model"], case["src"], dtype, kw, "tp-cp-ep-pp-dp" if disagg else "tp-cp-ep-dp-pp")
        perturb_replicated(src)
        # the local DotProductAttention has no context-parallel forward: no logits with CP > 1
        # (nor after param.data is rebound: the CPU model's forward keeps views of the old storage)
        with_logits = (case["src"].get("cp", 1) == 1 and case["dst"].get("cp", 1) == 1 and not case.get("rebind")
                       and not case.get("swap"))
        src_logits = mcore_cpu.forward_logits(src, tokens) if with_logits else None
        src_ref = reference_digests(src)
        if case.get("rebind") or case.get("swap"):    # under the source's parallel state (building dst replaces it)
            from megatron.core import parallel_state as ps
            src_full = reference_full(src)
            src_buffers = {_global_name(c, n, ps.get_expert_model_parallel_rank()) for c in src
                           for n, _ in c.named_buffers()}
        dst = _build(case["model"], case["dst"], dtype, kw)
        ptrs = {n: p.data_ptr() for c in dst for n, p in c.named_parameters()}
        t0 = time.perf_counter()
        refit = MegatronRefit(src if is_src else [], dst if is_dst else [])
        setup_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        sent = refit.refit()
        refit_s = time.perf_counter() - t0
        if case.get("rebind"):
            # after binding, an optimizer / user code / an engine moves every parameter to new
            # storage (param.data = ...), the source with new values: the next refit must follow
            with torch.no_grad():
                for c in src:
                    for t in c.parameters():
                        t.data = t.data.clone() + 0.25
                for c in dst:
                    for t in c.parameters():
                        t.data = t.data.clone()
            ptrs = {n: p.data_ptr() for c in dst for n, p in c.named_parameters()}
            src_ref = {n: [list(t.shape), str(t.dtype), _digest(t if n in src_buffers else t + 0.25)]
                       for n, t in src_full.items()}
            sent = refit.refit()
        swap = None
        if case.get("swap"):
            swap = swap_scenario(src, dst, refit, is_src, is_dst)
            src_ref = {n: [list(t.shape), str(t.dtype), _digest(swapped(n, t, src_buffers))] for n, t in src_full.items()}
        dst_ref = reference_digests(dst)
        dst_logits = mcore_cpu.forward_logits(dst, tokens) if with_logits else None
        stats = refit.plan.stats
        results.append({
            "src": src_ref if is_src else {}, "dst": dst_ref if is_dst else {},
            "logits_max_diff": float((src_logits - dst_logits).abs().max()) if with_logits and is_dst else 0.0,
            "logits_scale": float(src_logits.abs().max()) if with_logits else None,
            "same_storage": all(p.data_ptr() == ptrs[n] for c in dst for n, p in c.named_parameters()),
            "network_bytes": stats["network_bytes"], "lower_bound_bytes": stats["lower_bound_bytes"], "local_bytes": stats["local_bytes"],
            "messages_sent": sent["messages_sent"], "plan_messages_from_me": sum(1 for m in refit.plan.messages if m.src == rank),
            "tensors": len(refit.plan.tensors), "setup_s": setup_s, "refit_s": refit_s, "swap": swap,
        })
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return results


def dtensor_export(rank: int, world: int, cases: list) -> list:
    """Export DTensors and check ``full_tensor()`` against the independent reference digests."""
    from mcore_reshard.sources.megatron_dtensor import export_dtensors
    mcore_cpu.install_cpu_shims()
    out = []
    for case in cases:
        chunks = _build(case["model"], case["src"], torch.float32, case.get("kw", {}))
        perturb_replicated(chunks)
        ref = reference_digests(chunks)
        dts, inexpressible = export_dtensors(chunks)
        checked, placements = 0, {}
        for key, dt in sorted(dts.items()):
            full = dt.full_tensor()
            name = key.replace(".transformer_layer.", ".mtp_model_layer.")   # MTP's key vs its parameter name
            placements[key] = [str(p) for p in dt.placements]
            if ".experts.experts." in key:   # [E, ...] stacked: compare expert by expert
                for e in range(full.shape[0]):
                    assert _digest(full[e]) == ref[name.replace(".experts.experts.", f".experts.{e}.")][2], (key, e)
                    checked += 1
            else:
                assert _digest(full) == ref[name][2], key
                checked += 1
        out.append({"checked": checked, "dtensors": len(dts), "inexpressible": inexpressible, "placements": placements})
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return out


def hf_dims(chunks) -> dict:
    """The HF-named dims of a live tiny model (what megatron_spec.megatron_layout takes)."""
    cfg = chunks[0].config
    out = {"hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "vocab_size": chunks[0].vocab_size, "intermediate_size": cfg.ffn_hidden_size,
           "tie_word_embeddings": chunks[0].share_embeddings_and_output_weights}
    if getattr(cfg, "multi_latent_attention", False):
        out.update(q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_head_dim,
                   qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
                   num_nextn_predict_layers=cfg.mtp_num_layers or 0, n_shared_experts=1, first_k_dense_replace=1)
    else:
        out.update(num_key_value_heads=cfg.num_query_groups, head_dim=cfg.kv_channels)
    if cfg.num_moe_experts:
        out.update(n_routed_experts=cfg.num_moe_experts, moe_intermediate_size=cfg.moe_ffn_hidden_size)
    return out


def spec_vs_live(rank: int, world: int, cases: list) -> list:
    """This rank's canonical layout read from a live model vs built from dims and sizes."""
    from mcore_reshard.mapper.family import canonicalize, load_family
    from mcore_reshard.sources.megatron_model import family_for, model_config, read_layout
    from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
    mcore_cpu.install_cpu_shims()
    out = []
    for case in cases:
        chunks = _build(case["model"], case["src"], torch.float32, case.get("kw", {}))
        config = model_config(chunks)
        family = family_for(config)
        live = canonicalize(read_layout(chunks, rank)[0], load_family(family), config)
        s = case["src"]
        sizes = ParallelSizes(tp=s.get("tp", 1), pp=s.get("pp", 1), ep=s.get("ep", 1), etp=s.get("etp"),
                              vpp=s.get("vpp", 1), dp=world // (s.get("tp", 1) * s.get("pp", 1)),
                              first_stage_layers=s.get("first_stage_layers"))
        spec = megatron_layout(hf_dims(chunks), sizes, family)
        a = live.to_json()["buffers"].get(str(rank), [])
        b = spec.to_json()["buffers"].get(str(rank), [])
        diff = sorted({x["name"] for x in a if x not in b} | {x["name"] for x in b if x not in a})
        live_t, spec_t = live.to_json()["tensors"], spec.to_json()["tensors"]
        out.append({"buffers": len(a), "diff": diff[:10], "live_tensors": sorted(live_t),
                    "spec_tensors": sorted(spec_t), "metas_agree": all(spec_t.get(n) == m for n, m in live_t.items())})
        mcore_cpu.destroy_megatron()
    return out
