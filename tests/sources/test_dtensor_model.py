"""A DTensor-sharded transformers model as a source (``sources.dtensor_model.read_dtensor_layout``):
Qwen3-MoE tiny under ``parallelize_module`` TP + FSDP2 ``fully_shard`` on a 2-D gloo mesh, refit into
a whole Hugging Face model, a vLLM tp=2 layout, an SGLang tp=2 ep=2 layout and (the parameters passed to ``reshard`` as they are)
``Shard(-1)`` DTensors over all 4 ranks, bit for bit against the model's own state dict."""
from __future__ import annotations

import pytest

from mcore_reshard.tools.launch import spawn

pytest.importorskip("transformers")
import dtensor_model_worker  # noqa: E402

pytestmark = pytest.mark.multiproc


def test_fsdp2_and_tp_model_refits_into_hf_vllm_and_sglang_bit_exact():
    out = spawn(dtensor_model_worker.fsdp_tp_to_hf_and_vllm, 4, timeout=400, pg_timeout=180)
    for rank, r in enumerate(out):
        assert r["torch_ok"], rank                      # torch's own full_tensor() agrees with the reference
        assert r["dtensor_params"] == r["params"] > 0   # every parameter is a DTensor (FSDP2 shards all)
        assert r["vllm_bad"] == [], (rank, r["vllm_bad"])
        assert r["sglang_bad"] == [], (rank, r["sglang_bad"])
        assert r["network"] == r["lower_bound"]
    assert out[0]["hf_mismatch"] == []                 # every tensor of the HF model equals the original
    assert [r["vllm_buffers"] > 0 for r in out] == [False, False, True, True]
    assert [r["sglang_buffers"] > 0 for r in out] == [True, True, False, False]
    # FSDP2 over TP-sharded rows composes into a strided shard: the case the reader must get right
    assert out[0]["placements"]["model.layers.0.self_attn.q_proj.weight"] == ["_S(0, 2)", "S(0)"]
    assert out[0]["placements"]["model.layers.0.self_attn.o_proj.weight"] == ["S(0)", "S(1)"]


def test_fsdp2_and_tp_parameters_reshard_as_dtensors():
    """``reshard`` takes the sharded model's parameters as they are: those TP leaves whole live on each
    rank's own dp sub-mesh ([0, 2] or [1, 3]), read as replicas of one tensor over two disjoint meshes."""
    out = spawn(dtensor_model_worker.fsdp_tp_params_to_dtensors, 4, timeout=400, pg_timeout=180)
    for r in out:
        assert r["bad"] == [], r["bad"]
        assert r["tensors"] == out[0]["tensors"] > 0
        assert r["network"] == r["lower_bound"]
    assert out[0]["submeshes"] == sorted(["[0, 2]", "[[0, 1], [2, 3]]"])
