"""Layouts read from a loader by probing (``integrations.probe``), and vLLM's placement / sequence-parallel
MoE rules, without an engine (the real engines: ``tests/engines/test_engines.py``)."""
from __future__ import annotations

import pytest
import torch

from mcore_reshard.core.layout import LayoutError
from mcore_reshard.integrations.probe import compare_layouts, probe_layout
from mcore_reshard.targets import dsv3_tiny, gqa_tiny, hf_layout, qwen3_moe_tiny, sglang_layout, vllm_layout
from mcore_reshard.targets.vllm import effective_expert_placement, sequence_parallel_moe
from mcore_reshard.tools.synthetic import materialize


def layout_loader(layout, rank, checkpoint, scale: float = 1.0):
    """Parameters of ``layout``'s rank and a loader that fills them from checkpoint tensors as the layout says."""
    params = {n: torch.zeros(b.shape) for n, b in layout.buffers[rank].items()}

    def load(items):
        items = dict(items)
        full = {n: torch.zeros(m.shape) for n, m in checkpoint.tensors.items()}
        for bn, b in checkpoint.buffers[0].items():
            for p in b.pieces:
                full[p.tensor][p.box.slices()] = items[bn][p.local.slices()].reshape(p.box.sizes)
        for n, t in materialize(layout, rank, full, dtype=torch.float32).items():
            params[n].copy_(t * scale)
    return params, load


CASES = [
    (dsv3_tiny(), dict(tp=2, dp=2, enable_expert_parallel=True), "vllm"),
    (dsv3_tiny(), dict(tp=4, enable_expert_parallel=True, expert_placement="round_robin"), "vllm"),
    (qwen3_moe_tiny(), dict(tp=2), "vllm"),
    (gqa_tiny(num_key_value_heads=2, vocab_size=100), dict(tp=4), "sglang"),
    (dsv3_tiny(), dict(tp=2, fuse_shared_expert=True), "sglang"),
]


@pytest.mark.parametrize("cfg,kw,engine", CASES, ids=[f"{e}-{c.model_type}-{k}" for c, k, e in CASES])
def test_probe_recovers_the_layout(cfg, kw, engine):
    lay = (vllm_layout if engine == "vllm" else sglang_layout)(cfg, dtype="bfloat16", **kw)
    ck = hf_layout(cfg, fused_experts=False, dtype="bfloat16")
    for r in lay.buffers:
        params, load = layout_loader(lay, r, ck)
        got, unwritten = probe_layout(params, ck, r, load_weights=load, dtype="bfloat16")
        assert not unwritten
        assert not compare_layouts(got, lay, [r])


def test_probe_multi_pass_and_refusals(monkeypatch):
    import mcore_reshard.integrations.probe as probe
    cfg = gqa_tiny()
    lay, ck = vllm_layout(cfg, tp=2, dtype="float32"), hf_layout(cfg, fused_experts=False, dtype="float32")
    monkeypatch.setattr(probe, "DIGIT", 1 << 9)            # ids need several base-512 digits: several passes
    params, load = layout_loader(lay, 1, ck)
    got, _ = probe_layout(params, ck, 1, load_weights=load)
    assert not compare_layouts(got, lay, [1])
    monkeypatch.undo()
    params, load = layout_loader(lay, 0, ck, scale=0.5)     # not a pure copy
    with pytest.raises(LayoutError, match="not a pure copy"):
        probe_layout(params, ck, 0, load_weights=load)
    with pytest.raises(LayoutError, match="float32"):
        probe_layout({"w": torch.zeros(2, dtype=torch.bfloat16)}, ck, 0, load_weights=load)


def test_compare_layouts_sees_a_different_box():
    cfg = dsv3_tiny()
    a = vllm_layout(cfg, tp=2, enable_expert_parallel=True)
    b = vllm_layout(cfg, tp=2, enable_expert_parallel=True, expert_placement="round_robin")
    diff = compare_layouts(a, b)
    assert diff and all("w13_weight" in d or "w2_weight" in d for d in diff)


def test_vllm_placement_and_sequence_parallel_moe_rules():
    grouped, flat = dsv3_tiny().with_(n_group=4), dsv3_tiny().with_(n_group=1)
    assert effective_expert_placement(grouped, "round_robin", tp=2, dp=1, enable_expert_parallel=True) == "round_robin"
    assert effective_expert_placement(flat, "round_robin", tp=2, dp=1, enable_expert_parallel=True) == "linear"
    assert effective_expert_placement(grouped, "round_robin", tp=2, dp=2, enable_expert_parallel=True) == "linear"
    assert effective_expert_placement(grouped, "round_robin", 2, 2, True, all2all_backend="deepep_low_latency") \
        == "round_robin"
    assert effective_expert_placement(qwen3_moe_tiny(), "round_robin", 2, 1, True) == "linear"
    assert sequence_parallel_moe(2, 2, True) and not sequence_parallel_moe(2, 1, True)
    assert not sequence_parallel_moe(1, 2, True) and not sequence_parallel_moe(2, 2, True, "naive")
    # the docs' own vllm:tp=2,dp=2,ep: shared experts whole on every rank, experts linear
    lay = vllm_layout(grouped, tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin")
    assert lay.buffers[3]["model.layers.1.mlp.shared_experts.gate_up_proj.weight"].shape == (64, 64)
    assert lay.buffers[1]["model.layers.1.mlp.experts.routed_experts.w13_weight"].pieces[0].box.offsets[0] == 2
