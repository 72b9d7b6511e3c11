"""export_hf scenarios, run inside spawned gloo processes (tests/test_hf_export.py).

Every rank builds the Megatron model of a case, computes Megatron's own logits and, for the
reference, the digest of every tensor the Hugging Face checkpoint must hold, under the checkpoint's
names, written out by hand from the full tensors that ``megatron_refit_worker.reference_full``
gathers from the parameters' own TP attributes (independent of ``layouts/*.toml``, the planner and
``sharded_state_dict``).  Then all ranks call ``export_hf``; the test loads the directory with
``from_pretrained`` in its own process.
"""
from __future__ import annotations

import os

import torch

import mcore_cpu
from megatron_refit_worker import _build, _digest, perturb_replicated, reference_full

RENAMES = [  # Megatron name piece -> HF checkpoint name piece, by hand
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"), ("decoder.final_layernorm", "model.norm"),
    ("output_layer.weight", "lm_head.weight"), ("decoder.layers.", "model.layers."),
    ("self_attention.linear_q_down_proj", "self_attn.q_a_proj"), ("self_attention.q_layernorm", "self_attn.q_a_layernorm"),
    ("self_attention.linear_q_up_proj", "self_attn.q_b_proj"),
    ("self_attention.linear_kv_down_proj", "self_attn.kv_a_proj_with_mqa"),
    ("self_attention.kv_layernorm", "self_attn.kv_a_layernorm"), ("self_attention.linear_kv_up_proj", "self_attn.kv_b_proj"),
    ("self_attention.linear_proj", "self_attn.o_proj"), ("pre_mlp_layernorm", "post_attention_layernorm"),
    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"), ("mlp.router.weight", "mlp.gate.weight"),
    ("mlp.linear_fc2", "mlp.down_proj"), ("mlp.shared_experts.linear_fc2", "mlp.shared_experts.down_proj"),
]
GQA_RENAMES = [("self_attention.q_layernorm", "self_attn.q_norm"), ("self_attention.k_layernorm", "self_attn.k_norm")]


def _mtp_name(name: str, num_layers: int) -> str:
    """``mtp.layers.0.enorm.weight`` -> ``decoder.layers.{num_layers}.enorm.weight`` (the checkpoint's layer)."""
    k, rest = name[len("mtp.layers."):].split(".", 1)
    layer = num_layers + int(k)
    rest = rest.replace("mtp_model_layer.", "").replace("final_layernorm", "shared_head.norm")
    return f"decoder.layers.{layer}.{rest}"


def checkpoint_expected(full: dict, cfg, kind: str) -> dict:
    """HF checkpoint name -> digest of every tensor export_hf must write, from Megatron's full tensors."""
    out = {}
    for name, t in full.items():
        if name.startswith("mtp."):
            name = _mtp_name(name, cfg.num_layers)
        for a, b in (GQA_RENAMES if kind != "dsv3" else []) + RENAMES:
            name = name.replace(a, b)
        if ".mlp.experts.experts." in name:
            layer, rest = name.split(".mlp.experts.experts.")
            e, which = rest.split(".", 1)
            base = f"{layer}.mlp.experts.{e}."
            if "linear_fc1" in which:
                gate, up = t.chunk(2, dim=0)
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = _digest(gate), _digest(up)
            else:
                out[base + "down_proj.weight"] = _digest(t)
        elif name.endswith("linear_fc1.weight"):      # dense MLP or shared expert: [gate; up]
            gate, up = t.chunk(2, dim=0)
            base = name[:-len("linear_fc1.weight")]
            out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = _digest(gate), _digest(up)
        elif name.endswith("self_attention.linear_qkv.weight"):
            from hf_refit_worker import _split_qkv
            q, k, v = _split_qkv(t, cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels)
            base = name[:-len("self_attention.linear_qkv.weight")] + "self_attn."
            out.update({base + "q_proj.weight": _digest(q), base + "k_proj.weight": _digest(k),
                        base + "v_proj.weight": _digest(v)})
        else:
            out[name] = _digest(t)
    for k in range(getattr(cfg, "mtp_num_layers", None) or 0):   # DeepSeek's checkpoint copies them per MTP layer
        layer = f"model.layers.{cfg.num_layers + k}."
        if "embedding.word_embeddings.weight" in full:
            out[layer + "embed_tokens.weight"] = _digest(full["embedding.word_embeddings.weight"])
        if "output_layer.weight" in full:
            out[layer + "shared_head.head.weight"] = _digest(full["output_layer.weight"])
    return out


def export_scenarios(rank: int, world: int, cases: list, out_root: str) -> list:
    from mcore_reshard import export_hf
    mcore_cpu.install_cpu_shims()
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    results = []
    for case in cases:
        chunks = _build(case["model"], case["src"], torch.float32, case.get("kw", {}))
        perturb_replicated(chunks)
        res = {"expected": checkpoint_expected(reference_full(chunks), chunks[0].config, case["model"])}
        out_dir = os.path.join(out_root, case["id"])
        try:
            res["stats"] = export_hf(chunks, out_dir, on_rank=case.get("on_rank", 0),
                                     memory_bytes=case.get("memory_bytes", 1 << 30), timeout=120)
        except Exception as e:  # noqa: BLE001 - the refusal cases report what every rank raised
            if not case.get("refused"):
                raise
            res["error"] = f"{type(e).__name__}: {e}"
        if not case.get("refused"):
            res["logits"] = mcore_cpu.forward_logits(chunks, tokens)   # Megatron's own, on every rank
            res["tokens"] = tokens
        results.append(res)
        mcore_cpu.destroy_megatron()
    return results
