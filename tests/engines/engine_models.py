"""Tiny Hugging Face checkpoints for the real-engine tests (no torch, no engine imports at module level).

Configs are written by hand as ``config.json`` dicts (what an engine reads from disk), and the
random checkpoints use the on-disk tensor names the engines' loaders expect: per-expert
``mlp.experts.E.{gate,up,down}_proj.weight``, separate ``q_a_proj`` / ``kv_a_proj_with_mqa``.
"""
from __future__ import annotations

import json
import os

VOCAB = 200          # not a multiple of 64: vocab padding (and an uneven last shard) is exercised

YARN = {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def dsv3(q_lora: bool = True, n_group: int = 2, layers: int = 3, vocab: int = VOCAB, mtp: int = 0,
         experts: int = 8, dense: int = 1) -> dict:
    """DeepSeek-V3: MLA, layer 0 dense, the rest MoE (routed + 1 shared expert, sigmoid router with
    ``e_score_correction_bias``), yarn rope (SGLang's CPU rope needs it)."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
        "num_hidden_layers": layers, "vocab_size": vocab, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": experts, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "first_k_dense_replace": dense, "moe_layer_freq": 1, "n_group": n_group,
        "topk_group": 1 if n_group == 1 else max(1, n_group // 2), "topk_method": "noaux_tc", "scoring_func": "sigmoid",
        "norm_topk_prob": True, "routed_scaling_factor": 2.5, "q_lora_rank": 32 if q_lora else None,
        "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "num_nextn_predict_layers": mtp, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": dict(YARN), "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    }


def qwen3_moe(vocab: int = VOCAB) -> dict:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "num_hidden_layers": 2, "vocab_size": vocab, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "float32",
        "bos_token_id": 0, "eos_token_id": 1, "output_router_logits": False, "router_aux_loss_coef": 0.0,
    }


def llama(vocab: int = VOCAB, kv_heads: int = 2) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "vocab_size": vocab, "num_attention_heads": 8, "num_key_value_heads": kv_heads, "head_dim": 8,
        "intermediate_size": 128, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "rope_scaling": None, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 1,
    }


MODELS = {
    "dsv3": lambda: dsv3(),
    "dsv3_noqlora": lambda: dsv3(q_lora=False),
    "dsv3_1group": lambda: dsv3(n_group=1),
    "dsv3_mtp": lambda: dsv3(mtp=1),
    "dsv3_pp": lambda: dsv3(layers=4, dense=2),      # PP2: the first stage has no MoE layer
    "qwen3_moe": qwen3_moe,
    "llama": llama,
}


def write_config(root: str, name: str, cfg: dict | None = None) -> str:
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg or MODELS[name](), f, indent=1)
    return d


def random_checkpoint(cfg: dict, seed: int = 0):
    """(canonical tensors, on-disk checkpoint tensors) of a random model, float32, from the library's
    canonical layout (``hf_layout(fused_experts=False)`` names the on-disk tensors)."""
    import torch

    from mcore_reshard.targets import from_hf_config, hf_layout
    from mcore_reshard.tools.synthetic import materialize
    mc = from_hf_config(cfg)
    # a DeepSeek checkpoint repeats embed_tokens / lm_head inside every MTP layer (the draft loads those)
    ck = hf_layout(mc, fused_experts=False, dtype="float32", mtp_copies=bool(mc.num_nextn_predict_layers))
    g = torch.Generator().manual_seed(seed)
    full = {n: torch.randn(m.shape, generator=g) for n, m in sorted(ck.tensors.items())}
    return full, materialize(ck, 0, full)
