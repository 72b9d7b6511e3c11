"""The family tables' rules on their own: names (local and Transformer-Engine specs, MTP), the
GQA-interleaved linear_qkv, [gate; up] splits and vocab padding, against slicing by hand."""
from __future__ import annotations

import pytest
import torch

from mcore_reshard.core.box import Box
from mcore_reshard.core.layout import Buffer, Layout, Piece
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.mapper.family import FamilyError, canonicalize, load_family, shipped_families
from mcore_reshard.tools.synthetic import materialize

CFG = {"num_layers": 61, "num_attention_heads": 8, "num_query_groups": 2, "kv_channels": 3}


@pytest.mark.parametrize("key,hf", [
    ("decoder.layers.3.self_attention.linear_q_down_proj.weight", "model.layers.3.self_attn.q_a_proj.weight"),
    ("decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight", "model.layers.3.self_attn.q_a_layernorm.weight"),
    ("decoder.layers.3.self_attention.q_layernorm.weight", "model.layers.3.self_attn.q_a_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "model.layers.0.post_attention_layernorm.weight"),
    ("decoder.layers.5.pre_mlp_layernorm.weight", "model.layers.5.post_attention_layernorm.weight"),
    ("decoder.layers.5.mlp.router.expert_bias", "model.layers.5.mlp.gate.e_score_correction_bias"),
    ("decoder.layers.5.mlp.experts.experts.linear_fc1.weight", "model.layers.5.mlp.experts.gate_up_proj"),
    ("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight", "model.layers.61.mlp.experts.down_proj"),
    ("mtp.layers.0.final_layernorm.weight", "model.layers.61.shared_head.norm.weight"),
    ("mtp.layers.1.eh_proj.weight", "model.layers.62.eh_proj.weight"),
    ("output_layer.weight", "lm_head.weight"),
])
def test_deepseek_v3_names(key, hf):
    fam = load_family("deepseek_v3")
    assert hf in fam.match(key, CFG)[1]


def test_unknown_tensor_is_named():
    with pytest.raises(FamilyError, match="no table entry for Megatron tensor 'decoder.layers.0.mystery.weight'"):
        load_family("llama").match("decoder.layers.0.mystery.weight", CFG)
    assert shipped_families() == ["deepseek_v3", "llama", "qwen3_moe"]


def test_qkv_split_and_vocab_rules_match_hand_slicing():
    """linear_qkv (8 heads, 2 groups, head_dim 3) over tp=2, fc1 [gate; up] with stride 2, and a
    padded vocab (10 real rows of 12): canonical tensors must equal the hand-cut HF tensors."""
    H, hd, heads, groups, F = 5, 3, 8, 2, 4
    qpg = heads // groups
    q, k, v = torch.randn(heads * hd, H), torch.randn(groups * hd, H), torch.randn(groups * hd, H)
    # Megatron's fused global tensor, per group [q_g; k_g; v_g]
    qkv = torch.cat([torch.cat([q[g * qpg * hd:(g + 1) * qpg * hd], k[g * hd:(g + 1) * hd], v[g * hd:(g + 1) * hd]])
                     for g in range(groups)])
    gate, up, emb = torch.randn(F, H), torch.randn(F, H), torch.randn(10, H)
    meg = Layout()
    tp = Mesh.of({"tp": 2})
    meg.add_sharded("decoder.layers.0.self_attention.linear_qkv.weight", qkv.shape, "float32", tp, [("tp", 0)])
    meg.add_tensor("decoder.layers.0.mlp.linear_fc1.weight", (2 * F, H), "float32")
    meg.add_tensor("embedding.word_embeddings.weight", (12, H), "float32")
    for r in range(2):
        half = F // 2
        meg.add_buffer(r, Buffer("fc1", (F, H), "float32", (
            Piece("decoder.layers.0.mlp.linear_fc1.weight", Box((r * half, 0), (half, H)), Box((0, 0), (half, H))),
            Piece("decoder.layers.0.mlp.linear_fc1.weight", Box((F + r * half, 0), (half, H)), Box((half, 0), (half, H))))))
        meg.add_buffer(r, Buffer("emb", (6, H), "float32", (
            Piece("embedding.word_embeddings.weight", Box((6 * r, 0), (6, H)), Box((0, 0), (6, H))),)))
    full_meg = {"decoder.layers.0.self_attention.linear_qkv.weight": qkv, "decoder.layers.0.mlp.linear_fc1.weight": torch.cat([gate, up]),
                "embedding.word_embeddings.weight": torch.cat([emb, torch.zeros(2, H)])}
    canon = canonicalize(meg, load_family("llama"), {**CFG, "num_attention_heads": heads, "num_query_groups": groups,
                                                      "kv_channels": hd, "vocab_size": 10})
    assert canon.tensors["model.embed_tokens.weight"].shape == (10, H)
    hf = {"model.layers.0.self_attn.q_proj.weight": q, "model.layers.0.self_attn.k_proj.weight": k,
          "model.layers.0.self_attn.v_proj.weight": v, "model.layers.0.mlp.gate_proj.weight": gate,
          "model.layers.0.mlp.up_proj.weight": up, "model.embed_tokens.weight": emb}
    assert set(canon.tensors) == set(hf)
    for r in range(2):
        # the same local bytes, described twice: through Megatron keys and through HF names
        via_meg = materialize(meg, r, full_meg)
        via_hf = materialize(canon, r, hf)
        for name in via_meg:
            assert torch.equal(via_meg[name], via_hf[name]), (r, name)
    # rank 1's embedding buffer has 2 padding rows (10..11) in the canonical view
    assert canon.buffers[1]["emb"].padding() == [Box((4, 0), (2, H))]


def test_transformer_engine_spec_rules_plan_into_local_spec():
    """The TE spec names and replicates differently from the local spec: MLA down-projections are
    'duplicated' TELinear (whole on every TP rank), norms are fused into *.layer_norm_weight, and
    TEGroupedMLP keeps experts as linear_fc1.weight{i} parameters with the same global keys.
    Read as Megatron keys and canonicalized, a TE-spec TP2 source must plan into the local-spec
    TP2 layout exactly (checked by applying the plan to real tensors)."""
    from sim import apply_plan, random_full

    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
    from mcore_reshard.targets import dsv3_tiny
    cfg = dsv3_tiny(num_nextn_predict_layers=0)
    fam = load_family("deepseek_v3")
    conf = {"num_layers": 4}
    meg = Layout()
    tp = Mesh.of({"tp": 2})
    H, ql = 64, 32
    q_down = "decoder.layers.1.self_attention.linear_q_down_proj.weight"
    meg.add_sharded(q_down, (ql, H), "float32", tp, [], buffer=q_down)                       # duplicated: replicated
    meg.add_sharded("decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight", (ql,), "float32", tp, [],
                    buffer="decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight")  # fused q_a_layernorm
    key = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"                          # TEGroupedMLP weight{i}
    meg.add_tensor(key, (8, 64, H), "float32")
    for r in range(2):
        for i in range(8):   # ep=1, etp=2: every rank holds all 8 experts, rows [gate_r; up_r]
            meg.add_buffer(r, Buffer(f"decoder.layers.1.mlp.experts.linear_fc1.weight{i}", (32, H), "float32", (
                Piece(key, Box((i, 16 * r, 0), (1, 16, H)), Box((0, 0), (16, H))),
                Piece(key, Box((i, 32 + 16 * r, 0), (1, 16, H)), Box((16, 0), (16, H))))))
    src = canonicalize(meg, fam, conf)
    assert set(src.tensors) == {"model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.q_a_layernorm.weight",
                                "model.layers.1.mlp.experts.gate_up_proj"}
    local = megatron_layout(cfg, ParallelSizes(tp=2, etp=2), "deepseek_v3", rank_offset=2)
    dst = Layout()
    for n in src.tensors:
        dst.add_tensor(n, local.tensors[n].shape, "float32")
    for r in local.ranks:
        for b in local.buffers[r].values():
            if all(p.tensor in src.tensors for p in b.pieces):
                dst.add_buffer(r, b)
    plan = make_plan(src, dst)
    full = random_full(src)
    S = {r: materialize(src, r, full) for r in src.ranks}
    D = {r: materialize(dst, r, full, fill=float("nan")) for r in dst.ranks}
    apply_plan(plan, S, D)
    for r in dst.ranks:
        expect = materialize(dst, r, full)
        assert all(torch.equal(D[r][n], expect[n]) for n in expect)
    # the replicated q_a_proj: each local-spec rank needs half, and gets it from one of two replicas
    assert plan.stats["network_bytes"] == plan.stats["lower_bound_bytes"] == sum(m.nbytes for m in plan.messages)
