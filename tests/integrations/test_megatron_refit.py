"""Megatron-Core -> Megatron-Core refits between parallel configs, on real 0.19 models (CPU, gloo).

One launch of 4 ranks runs every scenario (imports cost ~15 s per launch).  For each scenario:
every parameter and the router's expert-bias buffer must be bit-identical between source and
destination (full tensors rebuilt by the independent path in ``megatron_refit_worker``), network
bytes must equal the plan's lower bound, each rank must send exactly the messages the plan gives
it, destination storage must not move, and the destination's logits must match the source's.
"""
from __future__ import annotations

import megatron_refit_worker
import pytest

from mcore_reshard.testing.megatron_cpu import spawn

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CASES = [
    ("dsv3 TP2 PP2 -> TP1 EP4", {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "dst": {"tp": 1, "ep": 4, "etp": 1}, "kw": {"mtp": True}}),
    ("dsv3 TP2 EP2 -> TP4", {"model": "dsv3", "src": {"tp": 2, "ep": 2}, "dst": {"tp": 4}, "kw": {"mtp": True}}),
    ("dsv3 TP1 EP4 ETP1 -> TP2 EP2 ETP2", {"model": "dsv3", "src": {"tp": 1, "ep": 4, "etp": 1}, "dst": {"tp": 2, "ep": 2, "etp": 2}, "kw": {"mtp": True}}),
    ("dsv3 TP2 PP2 uneven (1+3) -> TP1 PP1", {"model": "dsv3", "src": {"tp": 2, "pp": 2, "first_stage_layers": 1}, "dst": {"tp": 1}, "kw": {"mtp": True}}),
    ("dsv3 PP2 VPP2 -> PP1", {"model": "dsv3", "src": {"pp": 2, "vpp": 2}, "dst": {"tp": 1}, "kw": {"mtp": False}}),
    ("dsv3 bf16 TP2 PP2 -> TP4", {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "dst": {"tp": 4}, "dtype": "bfloat16", "kw": {"mtp": True}}),
    ("dsv3 TP2 SP DP2 -> TP4", {"model": "dsv3", "src": {"tp": 2}, "dst": {"tp": 4}, "kw": {"mtp": True, "sequence_parallel": True}}),
    ("gqa TP2 -> TP4", {"model": "gqa", "src": {"tp": 2}, "dst": {"tp": 4}, "kw": {}}),
    ("gqa tied TP4 -> TP2 PP2", {"model": "gqa", "src": {"tp": 4}, "dst": {"tp": 2, "pp": 2}, "kw": {"tied_embeddings": True}}),
    ("qwen3-moe TP2 EP2 -> TP1 EP4", {"model": "qwen3", "src": {"tp": 2, "ep": 2}, "dst": {"tp": 1, "ep": 4, "etp": 1}, "kw": {}}),
    # every parameter on both sides moved to new storage (param.data = ...) after binding,
    # the source with new values: the second refit follows both, bit-exact
    ("dsv3 TP2 EP2 -> TP4, param.data rebound after binding", {"model": "dsv3", "src": {"tp": 2, "ep": 2}, "dst": {"tp": 4}, "kw": {"mtp": False}, "rebind": True}),
    # modules replaced after binding on both sides (megatron_refit_worker.swap_scenario): the second
    # refit follows them, bit-exact; a module with an extra (LoRA) parameter is refused everywhere
    ("dsv3 TP2 EP2 -> TP4, modules replaced after binding", {"model": "dsv3", "src": {"tp": 2, "ep": 2}, "dst": {"tp": 4}, "kw": {"mtp": False}, "swap": True}),
]
SWAP = len(CASES) - 1


DISAGGREGATED = [
    ("dsv3 TP2 PP2 (ranks 0-3) -> TP4 (ranks 4-7)", {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "dst": {"tp": 4}, "kw": {"mtp": True}, "disaggregated": True}),
    ("dsv3 TP2 EP2 (ranks 0-3) -> TP1 EP4 (ranks 4-7)", {"model": "dsv3", "src": {"tp": 2, "ep": 2}, "dst": {"tp": 1, "ep": 4, "etp": 1}, "kw": {"mtp": True}, "disaggregated": True}),
]


@pytest.fixture(scope="module")
def results():
    return spawn(megatron_refit_worker.refit_scenarios, 4, [c for _, c in CASES], timeout=600)


@pytest.fixture(scope="module")
def disaggregated_results():
    return spawn(megatron_refit_worker.refit_scenarios, 8, [c for _, c in DISAGGREGATED], timeout=600)


def _merge(results, case, side):
    seen: dict[str, set] = {}
    for per_rank in results:
        for name, (shape, dtype, digest) in per_rank[case][side].items():
            seen.setdefault(name, set()).add((tuple(shape), dtype, digest))
    return seen


@pytest.mark.parametrize("case", range(len(CASES)), ids=[name for name, _ in CASES])
def test_refit_is_bit_exact_minimal_and_in_place(results, case):
    check_case(results, case, CASES[case][1])


@pytest.mark.parametrize("case", range(len(DISAGGREGATED)), ids=[name for name, _ in DISAGGREGATED])
def test_disaggregated_refit(disaggregated_results, case):
    check_case(disaggregated_results, case, DISAGGREGATED[case][1])
    # nothing was local: every destination byte crossed from a training rank to an inference rank
    assert all(r[case]["network_bytes"] > 0 and r[case]["local_bytes"] == 0 for r in disaggregated_results)


def check_case(results, case, spec):
    src, dst = _merge(results, case, "src"), _merge(results, case, "dst")
    if spec["kw"].get("tied_embeddings"):
        # with tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as
        # output_layer.weight: it must receive the (source) embedding too
        for side in (src, dst):
            if "output_layer.weight" in side:
                assert side.pop("output_layer.weight") == src["embedding.word_embeddings.weight"]
    assert set(src) == set(dst), set(src) ^ set(dst)
    assert any("expert_bias" in n for n in src) == (spec["model"] == "dsv3")
    for name in src:
        assert len(src[name]) == 1, f"source replicas of {name} disagree: {src[name]}"
        assert dst[name] == src[name], f"{name}: source {src[name]} destination {dst[name]}"
    for r in results:
        res = r[case]
        assert res["network_bytes"] == res["lower_bound_bytes"] > 0
        assert res["messages_sent"] == res["plan_messages_from_me"]
        assert res["same_storage"] or spec.get("swap")     # swap: the destination has a new module, by design
        # fp32: different parallel configs only reorder reductions (observed <= 3e-7); bf16 logits
        # are rounded to bf16 (ulp 2^-8 relative), so allow 2 ulps of the largest logit.
        tol = 1e-5 if spec.get("dtype", "float32") == "float32" else 2 * 2 ** -8 * res["logits_scale"]
        if spec["src"].get("cp", 1) == 1:
            assert res["logits_max_diff"] <= tol, res["logits_max_diff"]


def test_replaced_modules_followed_or_refused_everywhere(results):
    """The trainer replaced decoder.layers[1].mlp (new values) and a parameter object of layer 0, the
    destination its decoder.layers[1].mlp (zeros): refit 2 followed all of them -- the bit-exact
    comparison of test_refit_is_bit_exact_minimal_and_in_place[...modules replaced...] is against the
    NEW source values and the NEW destination module, and the old destination module kept its bytes
    (it used to be written while the model computed with the new one: silently stale).  Then a module
    with an extra (LoRA) parameter: refused on every rank naming the module and rank 0, nothing moved."""
    for rank, r in enumerate(results):
        sw = r[SWAP]["swap"]
        assert sw["second"] == 2 and sw["old_dst_untouched"], (rank, sw)
        o = sw["lora"]
        assert o["type"] == "ReshardError", (rank, o)
        assert "rank 0: src module [0]: decoder.layers.2.self_attention.linear_proj" in o["error"], o["error"]
        assert "lora_A" in o["error"] and "refused before any byte moved" in o["error"], o["error"]
        assert sw["lora_untouched"], rank
        assert sw["check_s"] < 0.05, sw["check_s"]


DTENSOR_CASES = [{"model": "dsv3", "src": {"tp": 2, "ep": 2, "etp": 2}, "kw": {"mtp": True}},
                 {"model": "dsv3", "src": {"tp": 2, "pp": 2}, "kw": {"mtp": True}}]


@pytest.fixture(scope="module")
def dtensor_export_results():
    """One 4-rank launch for both layouts: per rank, per case, what ``dtensor_export`` checked."""
    return spawn(megatron_refit_worker.dtensor_export, 4, DTENSOR_CASES, timeout=400)


@pytest.mark.parametrize("case", range(len(DTENSOR_CASES)), ids=["dsv3 TP2 EP2 ETP2", "dsv3 TP2 PP2"])
def test_export_dtensors_over_megatron_global_tensors(dtensor_export_results, case):
    """Every non-expert tensor exports as a DTensor whose full_tensor() equals the independent
    reference; SequentialMLP experts (one local tensor per expert) are reported inexpressible."""
    results = dtensor_export_results
    for res in results:
        r = res[case]
        assert all(".experts.experts." in k for k in r["inexpressible"]), r["inexpressible"]
        assert r["checked"] == r["dtensors"] > 20


def test_export_dtensors_placements(dtensor_export_results):
    placements = dtensor_export_results[0][0]["placements"]     # TP2 EP2 ETP2, rank 0
    assert placements["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"] == ["R", "R", "_S(0, 2)"]
    assert placements["decoder.layers.1.self_attention.linear_proj.weight"] == ["R", "R", "S(1)"]


def test_export_dtensors_pp2_embedding_spans_the_whole_mesh(dtensor_export_results):
    # PP2: the embedding also lives on the last stage (MTP): one DTensor over the whole mesh
    assert dtensor_export_results[0][1]["placements"]["embedding.word_embeddings.weight"] == ["R", "R", "R", "S(0)"]
