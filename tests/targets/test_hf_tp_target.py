"""Megatron-Core -> transformers models sharded by transformers' own tensor-parallel plan, live on CPU.

transformers 5.23 shards Llama, Qwen3-MoE and DeepSeek-V3 with the plans their configs declare
(``base_model_tp_plan`` / ``base_model_ep_plan``) over gloo: every sharded parameter is a DTensor,
``read_hf_layout`` takes each box from the DTensor's placements.  Checked: every local shard
bit-identical to torch's own slice of the independently gathered Megatron reference, and the
sharded HF model's logits equal Megatron's (max |diff| <= 1e-4, same argmax), as in test_hf_target.
"""
from __future__ import annotations

import importlib.util

import hf_tp_refit_worker
import pytest

from mcore_reshard.testing.megatron_cpu import spawn

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CASES = [
    {"model": "gqa", "src": {"tp": 2, "pp": 2}},                        # -> Llama TP4
    {"model": "qwen3", "src": {"tp": 2, "ep": 2}},                      # -> Qwen3-MoE TP4 (packed_colwise experts)
    {"model": "dsv3", "src": {"tp": 2, "pp": 2, "ep": 2, "etp": 1},     # -> DeepSeek-V3 TP4 + EP4 (grouped_gemm)
     "kw": {"mtp": True, "topk": 4}, "hf_ep": 4},
    {"model": "gqa", "src": {"tp": 2}, "src_ranks": 2},               # source on ranks 0-1 only -> Llama TP4
]
STYLES = {
    "gqa": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"},
    "qwen3": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "packed_colwise",
              "replicated_with_grad_allreduce"},
    "dsv3": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "grouped_gemm"},
}


@pytest.fixture(scope="module")
def tp_results():
    """One 4-rank launch for every case: per rank, per case, what the worker checked."""
    return spawn(hf_tp_refit_worker.hf_tp_scenarios, 4, CASES, timeout=400)


@pytest.mark.parametrize("i", range(len(CASES)),
                         ids=[f"{c['model']}-" + ",".join(f"{k}{v}" for k, v in c["src"].items())
                              + (f"-ranks0-{c['src_ranks'] - 1}" if c.get("src_ranks") else "") for c in CASES])
def test_megatron_to_transformers_tensor_parallel(tp_results, i):
    case, results = CASES[i], tp_results
    for rank, r in enumerate(results):
        res = r[i]
        assert res["bad"] == [], (case["model"], rank, res["bad"][:5])
        assert res["bad_after_second_refit"] == [], (case["model"], rank, res["bad_after_second_refit"][:5])
        assert set(res["styles"]) == STYLES[case["model"]], res["styles"]
        assert len(res["sharded"]) > 10, res["sharded"]
        assert res["logits_max_diff"] <= 1e-4 and res["same_argmax"], (case["model"], rank, res["logits_max_diff"])
        assert res["network_bytes"] == res["lower_bound_bytes"] > 0
        assert all(n.startswith("model.layers.4.") for n in res["unused"])   # DeepSeek-V3's MTP layer only
    if case.get("src_ranks"):   # ranks 2-3 hold no source: all their shards came over the network
        assert all(results[r][i]["received"] > 0 for r in (2, 3))
    if case["model"] == "qwen3":
        assert "model.layers.0.mlp.experts.gate_up_proj" in results[0][i]["sharded"]


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="from_pretrained(distributed_config=...) needs accelerate")
def test_from_pretrained_gives_the_same_layout():
    cases = [{"model": "qwen3", "src": {}}, {"model": "dsv3", "src": {}, "kw": {"mtp": False}, "hf_ep": 2}]
    for res in spawn(hf_tp_refit_worker.pretrained_layouts, 2, cases, timeout=300):
        for r in res:
            assert r["same_layout"] and r["logits_max_diff"] <= 1e-5, r


def _tiny_llama_with_tp_config(plan_override: dict | None = None):
    import transformers
    from transformers.distributed import DistributedConfig
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=128, tie_word_embeddings=False))
    model.config.distributed_config = DistributedConfig(tp_size=2)   # declared, never applied: plain tensors
    if plan_override:
        model._tp_plan = {**model.tp_plan, **plan_override}
    return model


def test_plain_parameter_under_a_sharding_style_is_an_error():
    from mcore_reshard.core.layout import LayoutError
    from mcore_reshard.sources.hf_model import parallel_styles, read_hf_layout
    model = _tiny_llama_with_tp_config()
    styles = parallel_styles(model)   # transformers' declared plan, resolved per parameter
    assert styles["model.layers.0.self_attn.q_proj.weight"] == "colwise"
    assert styles["model.layers.0.self_attn.o_proj.weight"] == "rowwise"
    assert styles["model.embed_tokens.weight"] == "embedding_rowwise"
    assert styles["lm_head.weight"] == "colwise_gather_output"
    assert "model.norm.weight" not in styles
    with pytest.raises(LayoutError, match=r"rank 3: lm_head.weight \(shape \(128, 64\)\) has style 'colwise_gather_output'.*not a DTensor"):
        read_hf_layout(model, 3)


def test_unknown_parallel_style_names_the_parameter():
    from mcore_reshard.core.layout import LayoutError
    from mcore_reshard.sources.hf_model import read_hf_layout
    model = _tiny_llama_with_tp_config({"model.layers.*.mlp.gate_proj": "my_fused_colwise"})
    with pytest.raises(LayoutError, match=r"rank 0: model.layers.0.mlp.gate_proj.weight has transformers parallel style 'my_fused_colwise'"):
        read_hf_layout(model, 0)


def test_layout_boxes_follow_the_declared_plans():
    """No Megatron: transformers shards tiny models with the plans their config classes declare; every box
    read_hf_layout reports equals the one written out by hand for the parameter's style, on every rank."""
    import re

    import hf_tp_layout_worker
    for rank, res in enumerate(spawn(hf_tp_layout_worker.layout_boxes, 2, timeout=300)):
        for r in res:
            assert r["bad"] == [], (r["kind"], r["ep"], rank, r["bad"][:3])
            generic = {re.sub(r"\.\d+\.", ".*.", n) for n in r["sharded"]}
            assert {"model.embed_tokens.weight", "lm_head.weight"} <= generic
            for key in r["declared"]:   # every rule of config.base_model_tp_plan that names weights shards them
                if key.endswith("mlp.experts") or "_norm" in key:
                    continue   # module hooks (moe_tp_experts) and replicated norms
                hits = [g for g in generic if g.startswith("model." + key)]
                assert hits or (r["kind"] == "qwen3" and key.split(".")[-1] in ("gate_proj", "up_proj", "down_proj")), (r["kind"], key)
