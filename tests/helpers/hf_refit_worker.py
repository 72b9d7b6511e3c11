"""Megatron-Core DeepSeek-V3-style model -> transformers DeepseekV3ForCausalLM, live (spawned ranks).

The HF model lives whole on one rank (rank 0 colocated, or the extra last rank disaggregated).
Reference for every weight: the same independent full-tensor digests as the Megatron refit tests,
mapped to HF names by hand here (not by the family table under test)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron_refit_worker import _build, _digest, perturb_replicated, reference_digests

from mcore_reshard.testing import megatron_cpu as mcore_cpu


def hf_config(cfg, vocab: int):
    from transformers import DeepseekV3Config
    return DeepseekV3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        moe_intermediate_size=cfg.moe_ffn_hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_attention_heads,
        n_shared_experts=1, n_routed_experts=cfg.num_moe_experts, routed_scaling_factor=cfg.moe_router_topk_scaling_factor,
        kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.qk_pos_emb_head_dim,
        v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_head_dim, n_group=cfg.moe_router_num_groups,
        topk_group=cfg.moe_router_group_topk, num_experts_per_tok=cfg.moe_router_topk, first_k_dense_replace=1,
        norm_topk_prob=True, rms_norm_eps=cfg.layernorm_epsilon, rope_theta=cfg.rotary_base,
        max_position_embeddings=64, tie_word_embeddings=False, rope_interleave=True, attention_bias=False)


HAND_MAP = [  # Megatron name piece -> HF name piece, written out independently of layouts/*.toml
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"), ("decoder.final_layernorm", "model.norm"),
    ("output_layer.weight", "lm_head.weight"), ("decoder.layers.", "model.layers."),
    ("self_attention.linear_q_down_proj", "self_attn.q_a_proj"), ("self_attention.q_layernorm", "self_attn.q_a_layernorm"),
    ("self_attention.linear_q_up_proj", "self_attn.q_b_proj"), ("self_attention.linear_kv_down_proj", "self_attn.kv_a_proj_with_mqa"),
    ("self_attention.kv_layernorm", "self_attn.kv_a_layernorm"), ("self_attention.linear_kv_up_proj", "self_attn.kv_b_proj"),
    ("self_attention.linear_proj", "self_attn.o_proj"), ("pre_mlp_layernorm", "post_attention_layernorm"),
    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"), ("mlp.router.weight", "mlp.gate.weight"),
    ("mlp.linear_fc2", "mlp.down_proj"), ("mlp.shared_experts.linear_fc2", "mlp.shared_experts.down_proj"),
]


def hf_digests(model) -> dict:
    """HF name -> digest, with fused tensors cut back into Megatron's pieces by hand."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rotary" in name:
            continue
        t = t.detach()
        if name.endswith("mlp.experts.gate_up_proj") or name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name}[{e}]"] = _digest(t[e])
        elif name.endswith("gate_proj.weight"):
            up = dict(model.named_parameters())[name.replace("gate_proj", "up_proj")]
            out[name.replace("gate_proj.weight", "gate_up")] = _digest(torch.cat([t, up.detach()]))
        elif not name.endswith("up_proj.weight"):
            out[name] = _digest(t)
    return out


def megatron_to_hf_digests(ref: dict) -> dict:
    out = {}
    for name, (_, _, digest) in ref.items():
        if name.startswith("mtp."):
            continue
        if ".experts." in name and ".shared_experts." not in name:
            layer, rest = name.split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            hf = layer.replace("decoder.layers.", "model.layers.") + (".mlp.experts.gate_up_proj" if "linear_fc1" in which else ".mlp.experts.down_proj")
            out[f"{hf}[{e}]"] = digest
            continue
        if name.endswith("linear_fc1.weight"):   # [gate; up] of dense / shared experts
            name = name.replace("mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.gate_up").replace("mlp.linear_fc1.weight", "mlp.gate_up")
        for a, b in HAND_MAP:
            name = name.replace(a, b)
        out[name] = digest
    return out


def hf_scenarios(rank: int, world: int, cases: list) -> list:
    from transformers import DeepseekV3ForCausalLM

    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.sources.hf_model import read_hf_layout
    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for case in cases:
        disagg = case.get("disaggregated", False)
        # disaggregated: ranks [0, world/2) train (dp slowest: one whole replica), rank world/2 infers
        hf_rank = world // 2 if disagg else 0
        dtype = getattr(torch, case.get("dtype", "float32"))
        chunks = _build("dsv3", case["src"], dtype, case.get("kw", {}), "tp-cp-ep-pp-dp" if disagg else "tp-cp-ep-dp-pp")
        perturb_replicated(chunks)
        logits = mcore_cpu.forward_logits(chunks, tokens)
        ref = reference_digests(chunks)
        is_src = not disagg or rank < world // 2
        target = None
        model = None
        if rank == hf_rank:
            torch.manual_seed(0)
            model = DeepseekV3ForCausalLM(hf_config(chunks[0].config, chunks[0].vocab_size)).to(dtype).eval()
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.data = layer.mlp.gate.e_score_correction_bias.data.float()
            target = read_hf_layout(model, rank)
        else:
            from mcore_reshard.core.layout import Layout
            target = (Layout(), {})
        refit = MegatronRefit(chunks if is_src else [], group=None, target=target, ignore_unused=True)
        refit.refit()
        if case.get("swap"):
            # the engine side replaces a module after binding (a re-wrap): a zeroed copy of layer 1's
            # attention; the next refit must follow it (the digests below are of the new module)
            if model is not None:
                import copy
                new = copy.deepcopy(model.model.layers[1].self_attn)
                with torch.no_grad():
                    for p in new.parameters():
                        p.zero_()
                model.model.layers[1].self_attn = new
            refit.refit()
        res = {"src": megatron_to_hf_digests(ref) if is_src else {}, "network_bytes": refit.plan.stats["network_bytes"],
               "lower_bound_bytes": refit.plan.stats["lower_bound_bytes"], "unused": refit.plan.stats["unused_tensors"]}
        if model is not None:
            with torch.no_grad():
                hf_logits = model(tokens).logits.float()
            res.update(dst=hf_digests(model), logits_max_diff=float((hf_logits - logits).abs().max()),
                       logits_scale=float(logits.abs().max()),
                       same_argmax=bool((hf_logits.argmax(-1) == logits.argmax(-1)).all()))
        out.append(res)
        mcore_cpu.destroy_megatron()
        dist.barrier()
    return out


def _split_qkv(full, heads, groups, hd):
    """Megatron's per-group [q; k; v] rows -> (q, k, v), by hand."""
    qpg = heads // groups
    per = full.view(groups, (qpg + 2) * hd, -1)
    q = per[:, :qpg * hd].reshape(heads * hd, -1)
    k = per[:, qpg * hd:(qpg + 1) * hd].reshape(groups * hd, -1)
    v = per[:, (qpg + 1) * hd:].reshape(groups * hd, -1)
    return q, k, v


def gqa_hf_expected(full: dict, cfg) -> dict:
    """Megatron full tensors -> HF names and digests for Llama / Qwen3-MoE, written out by hand."""
    from megatron_refit_worker import reference_full  # noqa: F401  (documentation of the source)
    out = {}
    for name, t in full.items():
        n = name.replace("embedding.word_embeddings.weight", "model.embed_tokens.weight").replace(
            "decoder.final_layernorm", "model.norm").replace("output_layer.weight", "lm_head.weight").replace(
            "decoder.layers.", "model.layers.")
        if name.endswith("linear_qkv.weight"):
            q, k, v = _split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
            base = n.replace("self_attention.linear_qkv.weight", "self_attn.")
            out.update({base + "q_proj.weight": _digest(q), base + "k_proj.weight": _digest(k), base + "v_proj.weight": _digest(v)})
            continue
        if ".experts.experts." in name:
            layer, rest = n.split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            out[f"{layer}.mlp.experts.{'gate_up_proj' if 'linear_fc1' in which else 'down_proj'}[{e}]"] = _digest(t)
            continue
        for a, b in (("self_attention.linear_proj", "self_attn.o_proj"), ("self_attention.q_layernorm", "self_attn.q_norm"),
                     ("self_attention.k_layernorm", "self_attn.k_norm"), ("pre_mlp_layernorm", "post_attention_layernorm"),
                     ("mlp.router.weight", "mlp.gate.weight"), ("mlp.linear_fc2", "mlp.down_proj")):
            n = n.replace(a, b)
        if name.endswith("mlp.linear_fc1.weight"):
            n = n.replace("mlp.linear_fc1.weight", "mlp.gate_up")
        out[n] = _digest(t)
    return out


def gqa_hf_config(kind: str, cfg, vocab: int):
    """(model class, config) of the transformers Llama ("gqa") or Qwen3-MoE ("qwen3") matching a tiny Megatron config."""
    import transformers
    common = dict(vocab_size=vocab, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_query_groups,
                  head_dim=cfg.kv_channels, intermediate_size=cfg.ffn_hidden_size, rms_norm_eps=cfg.layernorm_epsilon,
                  rope_theta=getattr(cfg, "rotary_base", 10000), max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "gqa":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        num_experts=cfg.num_moe_experts, num_experts_per_tok=cfg.moe_router_topk, moe_intermediate_size=cfg.moe_ffn_hidden_size,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False, **common)


def hf_gqa_scenarios(rank: int, world: int, cases: list) -> list:
    """Llama (dense GQA) and Qwen3-MoE: Megatron -> live transformers model on rank 0."""
    from megatron_refit_worker import reference_full

    from mcore_reshard.core.layout import Layout
    from mcore_reshard.refit import MegatronRefit
    from mcore_reshard.sources.hf_model import read_hf_layout
    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = []
    for case in cases:
        chunks = _build(case["model"], case["src"], torch.float32, {})
        perturb_replicated(chunks)
        logits = mcore_cpu.forward_logits(chunks, tokens)
        cfg = chunks[0].config
        expected = gqa_hf_expected(reference_full(chunks), cfg)
        model, target = None, (Layout(), {})
        if rank == 0:
            model_cls, hf_cfg = gqa_hf_config(case["model"], cfg, chunks[0].vocab_size)
            model = model_cls(hf_cfg).eval()
            target = read_hf_layout(model, rank)
        refit = MegatronRefit(chunks, group=None, target=target)
        refit.refit()
        res = {"src": expected}
        if model is not None:
            with torch.no_grad():
                hf_logits = model(tokens).logits.float()
            res.update(dst=hf_digests(model), logits_max_diff=float((hf_logits - logits).abs().max()),
                       same_argmax=bool((hf_logits.argmax(-1) == logits.argmax(-1)).all()),
                       network_bytes=refit.plan.stats["network_bytes"], lower_bound_bytes=refit.plan.stats["lower_bound_bytes"])
        out.append(res)
        mcore_cpu.destroy_megatron()
    return out
