"""Megatron-Core -> transformers models sharded by transformers' own tensor-parallel plan, live on CPU.

transformers 5.23 shards Llama, Qwen3-MoE and DeepSeek-V3 with the plans their configs declare
(``base_model_tp_plan`` / ``base_model_ep_plan``) over gloo: every sharded parameter is a DTensor,
``read_hf_layout`` takes each box from the DTensor's placements.  Checked: every local shard
bit-identical to torch's own slice of the independently gathered Megatron reference, and the
sharded HF model's logits equal Megatron's (max |diff| <= 1e-4, same argmax), as in test_hf_target.
"""
from __future__ import annotations

import importlib.util

import pytest

from mcore_cpu import spawn

import hf_tp_refit_worker

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CASES = [
    {"model": "gqa", "src": {"tp": 2, "pp": 2}},                        # -> Llama TP4
    {"model": "qwen3", "src": {"tp": 2, "ep": 2}},                      # -> Qwen3-MoE TP4 (packed_colwise experts)
    {"model": "dsv3", "src": {"tp": 2, "pp": 2, "ep": 2, "etp": 1},     # -> DeepSeek-V3 TP4 + EP4 (grouped_gemm)
     "kw": {"mtp": True, "topk": 4}, "hf_ep": 4},
]
STYLES = {
    "gqa": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output"},
    "qwen3": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "packed_colwise",
              "replicated_with_grad_allreduce"},
    "dsv3": {"colwise", "rowwise", "embedding_rowwise", "colwise_gather_output", "grouped_gemm"},
}


def test_megatron_to_transformers_tensor_parallel():
    results = spawn(hf_tp_refit_worker.hf_tp_scenarios, 4, CASES, timeout=400)
    for i, case in enumerate(CASES):
        for rank, r in enumerate(results):
            res = r[i]
            assert res["bad"] == [], (case["model"], rank, res["bad"][:5])
            assert set(res["styles"]) == STYLES[case["model"]], res["styles"]
            assert len(res["sharded"]) > 10, res["sharded"]
            assert res["logits_max_diff"] <= 1e-4 and res["same_argmax"], (case["model"], rank, res["logits_max_diff"])
            assert res["network_bytes"] == res["lower_bound_bytes"] > 0
            assert all(n.startswith("model.layers.4.") for n in res["unused"])   # DeepSeek-V3's MTP layer only
        if case["model"] == "qwen3":
            assert "model.layers.0.mlp.experts.gate_up_proj" in results[0][i]["sharded"]


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                    reason="from_pretrained(distributed_config=...) needs accelerate")
def test_from_pretrained_gives_the_same_layout():
    cases = [{"model": "qwen3", "src": {}}, {"model": "dsv3", "src": {}, "kw": {"mtp": False}, "hf_ep": 2}]
    for res in spawn(hf_tp_refit_worker.pretrained_layouts, 2, cases, timeout=300):
        for r in res:
            assert r["same_layout"] and r["logits_max_diff"] <= 1e-5, r
