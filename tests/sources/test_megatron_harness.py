"""Checks of the CPU Megatron-Core harness (mcore_reshard.testing.megatron_cpu) and of mcore_reshard.core.mesh against
Megatron-Core's own parallel_state on real gloo process groups.

Each test is one multi-process launch that runs many layouts in turn (init -> build -> forward ->
destroy), because a launch costs seconds while a layout costs a fraction of one.
"""
from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch

from mcore_reshard.testing import megatron_cpu as mc

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

if importlib.util.find_spec("megatron") is None:  # cheap check: importing megatron.core costs ~5 s
    pytest.skip("megatron-core is not installed (needs Python >= 3.12)", allow_module_level=True)

B, S = 2, 16


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(20240601)
    return torch.randint(0, mc.VOCAB, (B, S), generator=g)


# ---------------------------------------------------------------------------------------------
# expected local layouts: docs' megatron_layouts.md, Appendix A (rows are name: shape, partition
# dim, partition stride, extra attributes). None = replicated (no tensor_model_parallel attribute).
# ---------------------------------------------------------------------------------------------

def _mla_layer(i: int, tp: int, moe: bool, ep_local_rows: int = 64) -> dict:
    p = f"decoder.layers.{i}."
    rows = {
        p + "input_layernorm.weight": ([64], None, None, {}),
        p + "self_attention.linear_proj.weight": ([64, 64 // tp], 1, 1, {"allreduce": True}),
        p + "self_attention.linear_q_down_proj.weight": ([32 // tp, 64], 0, 1, {"allreduce": True}),
        p + "self_attention.linear_q_up_proj.weight": ([96 // tp, 32], 0, 1, {"allreduce": True}),
        p + "self_attention.linear_kv_down_proj.weight": ([24 // tp, 64], 0, 1, {"allreduce": True}),
        p + "self_attention.linear_kv_up_proj.weight": ([128 // tp, 16], 0, 1, {"allreduce": True}),
        p + "self_attention.q_layernorm.weight": ([32], None, None, {}),
        p + "self_attention.kv_layernorm.weight": ([16], None, None, {}),
        p + "pre_mlp_layernorm.weight": ([64], None, None, {}),
    }
    if not moe:
        rows[p + "mlp.linear_fc1.weight"] = ([256 // tp, 64], 0, 2, {"allreduce": True})
        rows[p + "mlp.linear_fc2.weight"] = ([64, 128 // tp], 1, 1, {"allreduce": True})
    else:
        rows[p + "mlp.router.weight"] = ([8, 64], None, None, {"sequence_parallel": False})
        for e in (0, 1):
            q = p + f"mlp.experts.local_experts.{e}."
            rows[q + "linear_fc1.weight"] = ([ep_local_rows, 64], 0, 2, {"allreduce": False})
            rows[q + "linear_fc2.weight"] = ([64, ep_local_rows // 2], 1, 1, {"allreduce": False})
        rows[p + "mlp.shared_experts.linear_fc1.weight"] = ([64 // tp, 64], 0, 2, {"allreduce": True})
        rows[p + "mlp.shared_experts.linear_fc2.weight"] = ([64, 32 // tp], 1, 1, {"allreduce": True})
    return rows


# "TP=2 PP=2 rank0" (4-layer model, first stage = layers 0 and 1; taken with EP=1 and ETP=1, so
# the experts are whole: fc1 [64, 64]).
TABLE_TP2PP2_RANK0 = {
    "embedding.word_embeddings.weight": ([64, 64], 0, 1, {"is_embedding_or_output_parameter": True}),
    **_mla_layer(0, tp=2, moe=False),
    **_mla_layer(1, tp=2, moe=True),
}
# "EP=2 (TP=1) rank1" (2-layer model, PP=1).
TABLE_EP2_RANK1 = {
    "embedding.word_embeddings.weight": ([128, 64], 0, 1, {"is_embedding_or_output_parameter": True}),
    **_mla_layer(0, tp=1, moe=False),
    **_mla_layer(1, tp=1, moe=True),
    "decoder.final_layernorm.weight": ([64], None, None, {}),
    "output_layer.weight": ([128, 64], 0, 1, {"allreduce": True, "is_embedding_or_output_parameter": True}),
}


def _param_info(chunks) -> dict:
    """name -> (shape, partition_dim, partition_stride, attrs) for chunk 0 (prefixed 'c<v>.' for v>0)."""
    out = {}
    for v, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            tp_attr = getattr(p, "tensor_model_parallel", False)
            attrs = {a: getattr(p, a) for a in ("allreduce", "sequence_parallel", "is_embedding_or_output_parameter")
                     if hasattr(p, a)}
            out[(f"c{v}." if v else "") + name] = (
                list(p.shape), p.partition_dim if tp_attr else None, p.partition_stride if tp_attr else None, attrs)
    return out


def _check_table(info: dict, table: dict, where: str) -> None:
    for name, (shape, pdim, stride, attrs) in table.items():
        assert name in info, f"{where}: missing parameter {name}"
        got_shape, got_pdim, got_stride, got_attrs = info[name]
        assert (got_shape, got_pdim, got_stride) == (shape, pdim, stride), \
            f"{where}: {name} has {got_shape} {got_pdim}/{got_stride}, expected {shape} {pdim}/{stride}"
        for a, val in attrs.items():
            assert got_attrs.get(a) == val, f"{where}: {name}.{a} = {got_attrs.get(a)!r}, expected {val!r}"


def _moe_layers(chunks):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for c in chunks for m in c.modules() if isinstance(m, MoELayer)]


def _layer_numbers(chunk) -> list[int]:
    return [layer.layer_number for layer in chunk.decoder.layers]


# ---------------------------------------------------------------------------------------------
# world 4: models
# ---------------------------------------------------------------------------------------------

# (name, init_megatron kwargs, builder, builder kwargs)
SCENARIOS_4 = [
    ("dsv3_tp2pp2", dict(tp=2, pp=2, etp=1), "build_dsv3_tiny", dict(mtp=True)),
    ("dsv3_ep2_2layer", dict(tp=1, pp=1, ep=2), "build_dsv3_tiny", dict(num_layers=2, mtp=False)),
    ("dsv3_tp2ep2etp2", dict(tp=2, pp=1, ep=2, etp=2), "build_dsv3_tiny", dict()),
    ("dsv3_tp2ep2etp2_sp", dict(tp=2, pp=1, ep=2, etp=2), "build_dsv3_tiny", dict(sequence_parallel=True)),
    ("dsv3_tp2ep2etp2_allgather", dict(tp=2, pp=1, ep=2, etp=2), "build_dsv3_tiny", dict(dispatcher="allgather")),
    ("dsv3_tp1ep4", dict(tp=1, pp=1, ep=4), "build_dsv3_tiny", dict()),
    ("dsv3_tp2ep4etp1", dict(tp=2, pp=1, ep=4, etp=1), "build_dsv3_tiny", dict()),
    ("dsv3_pp2vpp2_ep2", dict(tp=1, pp=2, ep=2, vpp=2), "build_dsv3_tiny", dict(mtp=True)),
    ("dsv3_tp2pp2_uneven", dict(tp=2, pp=2), "build_dsv3_tiny", dict(num_layers=3, first_stage_layers=1)),
    ("gqa_tp1", dict(tp=1, pp=1), "build_gqa_dense_tiny", dict(qkv_bias=True)),
    ("gqa_tp2", dict(tp=2, pp=1), "build_gqa_dense_tiny", dict(qkv_bias=True)),
    ("gqa_tp4_2groups", dict(tp=4, pp=1), "build_gqa_dense_tiny", dict(num_query_groups=4)),
    ("gqa_tp2pp2_tied", dict(tp=2, pp=2), "build_gqa_dense_tiny", dict(tied_embeddings=True)),
    ("gqa_pp2_layout", dict(tp=1, pp=2), "build_gqa_dense_tiny", dict(pipeline_layout="Et|tttL")),
    ("gqa_pp2vpp2_tied", dict(tp=1, pp=2, vpp=2), "build_gqa_dense_tiny", dict(tied_embeddings=True)),
    ("qwen3_tp2ep2_sp", dict(tp=2, pp=1, ep=2), "build_qwen3_moe_tiny", dict(sequence_parallel=True)),
    ("qwen3_tp2ep2_allgather", dict(tp=2, pp=1, ep=2), "build_qwen3_moe_tiny", dict(dispatcher="allgather")),
    ("qwen3_tp1ep4_pp1", dict(tp=1, pp=1, ep=4), "build_qwen3_moe_tiny", dict()),
    ("qwen3_tp2pp2_uneven_last", dict(tp=2, pp=2), "build_qwen3_moe_tiny", dict(num_layers=3, last_stage_layers=1)),
]


def _run_one(name, lay, builder, kw, tokens, ps) -> dict:
    mc.init_megatron(**lay)
    chunks = getattr(mc, builder)(**kw)
    logits = mc.forward_logits(chunks, tokens)
    assert logits.shape == (B, S, mc.VOCAB), (name, logits.shape)
    assert torch.isfinite(logits).all(), name
    first, last = chunks[0], chunks[-1]
    return dict(
        logits=logits,
        params=_param_info(chunks),
        dtypes={n: p.dtype for n, p in first.named_parameters()},
        n_chunks=len(chunks),
        layer_numbers=[_layer_numbers(c) for c in chunks],
        pre=[c.pre_process for c in chunks],
        post=[c.post_process for c in chunks],
        has_mtp=[getattr(c, "mtp_process", False) for c in chunks],
        local_experts=[m.local_expert_indices for m in _moe_layers(chunks)],
        tp_rank=ps.get_tensor_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        embedding=(first.embedding.word_embeddings.weight.detach().clone() if first.pre_process else None),
        mtp_embedding=(last.embedding.word_embeddings.weight.detach().clone()
                       if getattr(last, "mtp_process", False) and not last.pre_process else None),
        output_weight=(last.output_layer.weight.detach().clone()
                       if last.post_process and last.output_layer.weight is not None else None),
    )


def _run_scenarios(rank, world, scenarios):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    tokens = _tokens()
    results = {}
    pg_counts = []
    for name, lay, builder, kw in scenarios:
        try:
            results[name] = _run_one(name, lay, builder, kw, tokens, ps)
        except Exception as e:
            raise RuntimeError(f"scenario {name} ({lay}, {builder}({kw})) failed on rank {rank}") from e
        mc.destroy_megatron()
        pg_counts.append(len(dist.distributed_c10d._world.pg_map))
    results["_pg_counts"] = pg_counts
    return results


def _resharding_gloo_checks(rank, world):
    """megatron.core.resharding's gloo path on CPU (needs the stream/synchronize/pin_memory shims):
    a ring of remote sends plus a local copy through GlooCopyService, and a same-layout
    swap_model_weights (local copies through execute_reshard_plan)."""
    import torch.distributed as dist
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService
    from megatron.core.resharding.refit import swap_model_weights

    service = GlooCopyService(group=dist.group.WORLD)
    send = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + 10 * rank
    ring_recv = torch.zeros(2, 3, dtype=torch.bfloat16)
    local_recv = torch.zeros(2, 3, dtype=torch.bfloat16)
    service.submit_send(send, (rank + 1) % world, task_id=100 + rank)
    service.submit_recv(ring_recv, (rank - 1) % world, task_id=100 + (rank - 1) % world)
    service.submit_send(send, rank, task_id=200 + rank)
    service.submit_recv(local_recv, rank, task_id=200 + rank)
    service.run()
    expected_ring = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) + 10 * ((rank - 1) % world)
    assert torch.equal(ring_recv, expected_ring) and torch.equal(local_recv, send)

    mc.init_megatron(tp=2, pp=1, ep=2)
    src = mc.build_dsv3_tiny(mtp=False)[0]
    dst = mc.build_dsv3_tiny(mtp=False)[0]
    with torch.no_grad():
        for p in dst.parameters():
            p.zero_()
    swap_model_weights(src, dst, "gloo")
    dst_params = dict(dst.named_parameters())
    differ = [n for n, p in src.named_parameters() if not torch.equal(p, dst_params[n])]
    assert not differ, f"swap_model_weights left {differ} different"
    del src, dst
    mc.destroy_megatron()


def _world4_models(rank, world):
    results = _run_scenarios(rank, world, SCENARIOS_4)
    _resharding_gloo_checks(rank, world)
    results["_resharding_ok"] = True
    return results


def _same_on_all_ranks(results, name, atol=1e-5):
    """Bit-identical within a model replica (TP gather + PP broadcast), close across DP replicas
    (MoE dispatchers sum expert outputs from other replicas in a rank-dependent order)."""
    ref = results[0][name]["logits"]
    by_dp = {}
    for r, res in enumerate(results):
        got = res[name]["logits"]
        dp_ref = by_dp.setdefault(res[name]["dp_rank"], got)
        assert torch.equal(got, dp_ref), f"{name}: rank {r} logits differ within its model replica"
        torch.testing.assert_close(got, ref, atol=atol, rtol=atol, msg=lambda m: f"{name}: rank {r}: {m}")


def _close(results, a, b, atol=2e-5, rtol=1e-5):
    torch.testing.assert_close(results[0][a]["logits"], results[0][b]["logits"], atol=atol, rtol=rtol,
                               msg=lambda m: f"{a} vs {b}: {m}")


@pytest.fixture(scope="module")
def world4_results():
    return mc.spawn(_world4_models, 4, timeout=240)


@pytest.mark.parametrize("name", [name for name, *_ in SCENARIOS_4])
def test_world4_forward(world4_results, name):
    _same_on_all_ranks(world4_results, name)


def test_world4_process_groups_do_not_leak(world4_results):
    # destroy_megatron frees Megatron's groups: the number of live groups does not grow
    counts = world4_results[0]["_pg_counts"]
    assert len(set(counts)) == 1, f"process groups leak across init/destroy cycles: {counts}"


def test_world4_megatron_resharding_gloo_runs_on_cpu(world4_results):
    assert all(r["_resharding_ok"] for r in world4_results)


def test_world4_logits_invariant_where_init_is(world4_results):
    res = world4_results
    # CPU init is TP-invariant (TP shards are slices of one master weight): TP1 == TP2 for dense
    _close(res, "gqa_tp1", "gqa_tp2")
    # sequence parallel and the token dispatcher do not change the math
    _close(res, "dsv3_tp2ep2etp2", "dsv3_tp2ep2etp2_sp")
    _close(res, "dsv3_tp2ep2etp2", "dsv3_tp2ep2etp2_allgather")
    _close(res, "qwen3_tp2ep2_sp", "qwen3_tp2ep2_allgather")


def test_world4_local_shapes_match_appendix_tables(world4_results):
    res = world4_results
    _check_table(res[0]["dsv3_tp2pp2"]["params"], TABLE_TP2PP2_RANK0, "dsv3 TP2PP2 rank0")
    _check_table(res[1]["dsv3_ep2_2layer"]["params"], TABLE_EP2_RANK1, "dsv3 EP2 rank1")
    # Appendix B: TP2 EP2 ETP2 rank 3 -> expert fc1 [32, 64], fc2 [64, 16]
    info = res[3]["dsv3_tp2ep2etp2"]["params"]
    assert info["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"][0] == [32, 64]
    assert info["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"][0] == [64, 16]
    # TP2 with ETP1: experts whole, dense TP-split
    info = res[1]["dsv3_tp2ep4etp1"]["params"]
    assert info["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"][0] == [64, 64]
    assert info["decoder.layers.0.mlp.linear_fc1.weight"][0] == [128, 64]
    assert "decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" not in info  # 8/EP4 = 2
    # GQA: qkv rows = (8 heads + 2 * groups) * 8 per TP rank; qkv bias present
    assert res[1]["gqa_tp2"]["params"]["decoder.layers.0.self_attention.linear_qkv.weight"][0] == [64, 64]
    assert res[1]["gqa_tp2"]["params"]["decoder.layers.0.self_attention.linear_qkv.bias"][0] == [64]
    assert res[3]["gqa_tp4_2groups"]["params"]["decoder.layers.0.self_attention.linear_qkv.weight"][0] == [32, 64]
    # Qwen3: q/k layernorm over the head dim, no shared expert, no expert bias
    info = res[0]["qwen3_tp1ep4_pp1"]["params"]
    assert info["decoder.layers.0.self_attention.q_layernorm.weight"][0] == [16]
    assert info["decoder.layers.0.self_attention.linear_qkv.weight"][0] == [(8 + 2 * 4) * 16, 64]
    assert not any("shared_experts" in n for n in info)
    assert "decoder.layers.0.mlp.router.weight" in info


def test_world4_expert_placement(world4_results):
    res = world4_results
    for r in range(4):
        ep = res[r]["dsv3_ep2_2layer"]["ep_rank"]
        assert res[r]["dsv3_ep2_2layer"]["local_experts"] == [list(range(4 * ep, 4 * ep + 4))]
        ep = res[r]["dsv3_tp1ep4"]["ep_rank"]
        assert ep == r and res[r]["dsv3_tp1ep4"]["local_experts"] == [[2 * r, 2 * r + 1]] * 4  # 3 MoE layers + MTP
        # TP2 EP4 ETP1: expert mesh is ep-fastest, so EP rank = global rank
        assert res[r]["dsv3_tp2ep4etp1"]["ep_rank"] == r
        assert res[r]["dsv3_tp2ep4etp1"]["etp_rank"] == 0


def test_world4_pipeline_splits(world4_results):
    res = world4_results
    for r in range(4):
        # TP2 PP2, 4 layers + MTP: stage 0 layers 1-2, stage 1 layers 3-4 + MTP (+ embedding copy)
        d = res[r]["dsv3_tp2pp2"]
        pp = d["pp_rank"]
        assert d["layer_numbers"] == ([[1, 2]] if pp == 0 else [[3, 4]])
        assert d["has_mtp"] == [pp == 1]
        assert any(n.startswith("mtp.layers.0.") for n in d["params"]) == (pp == 1)
        if pp == 1:
            assert d["params"]["mtp.layers.0.eh_proj.weight"][0] == [32, 128]
        # uneven: 3 layers with 1 on the first stage
        d = res[r]["dsv3_tp2pp2_uneven"]
        assert d["layer_numbers"] == ([[1]] if d["pp_rank"] == 0 else [[2, 3]])
        d = res[r]["qwen3_tp2pp2_uneven_last"]
        assert d["layer_numbers"] == ([[1, 2]] if d["pp_rank"] == 0 else [[3]])
        d = res[r]["gqa_pp2_layout"]
        assert d["layer_numbers"] == ([[1]] if d["pp_rank"] == 0 else [[2, 3, 4]])
        # VPP2 over PP2, 4 layers: rank pp holds virtual stages pp and pp+2, one layer each
        d = res[r]["dsv3_pp2vpp2_ep2"]
        pp = d["pp_rank"]
        assert d["n_chunks"] == 2
        assert d["layer_numbers"] == [[1 + pp], [3 + pp]]
        assert d["pre"] == [pp == 0, False] and d["post"] == [False, pp == 1]
        assert d["has_mtp"] == [False, pp == 1]
    # MTP on the last stage holds a copy of the word embeddings, synchronised at build time
    # (TP2PP2: rank 0 = (tp0, pp0), rank 2 = (tp0, pp1))
    assert torch.equal(res[0]["dsv3_tp2pp2"]["embedding"], res[2]["dsv3_tp2pp2"]["mtp_embedding"])
    assert torch.equal(res[1]["dsv3_tp2pp2"]["embedding"], res[3]["dsv3_tp2pp2"]["mtp_embedding"])
    # tied embeddings with PP: the last stage's output weight equals the first stage's embedding
    assert torch.equal(res[0]["gqa_tp2pp2_tied"]["embedding"], res[2]["gqa_tp2pp2_tied"]["output_weight"])
    # ... also with VPP (TP1 PP2 DP2: ranks 0, 1 are pp0; ranks 2, 3 pp1)
    assert [res[r]["gqa_pp2vpp2_tied"]["pp_rank"] for r in range(4)] == [0, 0, 1, 1]
    assert torch.equal(res[2]["gqa_pp2vpp2_tied"]["output_weight"], res[0]["gqa_pp2vpp2_tied"]["embedding"])


# ---------------------------------------------------------------------------------------------
# world 8: models
# ---------------------------------------------------------------------------------------------

SCENARIOS_8 = [
    ("dsv3_tp2pp2ep2", dict(tp=2, pp=2, ep=2), "build_dsv3_tiny", dict(mtp=True)),
    ("dsv3_tp2pp2ep4etp1", dict(tp=2, pp=2, ep=4, etp=1), "build_dsv3_tiny", dict(mtp=True)),
    ("qwen3_tp2pp2vpp2ep2_sp", dict(tp=2, pp=2, ep=2, vpp=2), "build_qwen3_moe_tiny", dict(sequence_parallel=True)),
    ("gqa_tp1", dict(tp=1, pp=1), "build_gqa_dense_tiny", dict(num_query_groups=2)),
    ("gqa_tp2", dict(tp=2, pp=1), "build_gqa_dense_tiny", dict(num_query_groups=2)),
    ("dsv3_bf16_tp2pp2ep2etp1_ppnotlast", dict(tp=2, pp=2, ep=2, etp=1, order="tp-cp-ep-pp-dp"),
     "build_dsv3_tiny", dict(dtype=torch.bfloat16)),
]


def _world8_models(rank, world):
    return _run_scenarios(rank, world, SCENARIOS_8)


@pytest.fixture(scope="module")
def world8_results():
    return mc.spawn(_world8_models, 8, timeout=240)


@pytest.mark.parametrize("name", [name for name, *_ in SCENARIOS_8])
def test_world8_forward(world8_results, name):
    _same_on_all_ranks(world8_results, name, atol=3e-2 if "bf16" in name else 1e-5)


def test_world8_layouts(world8_results):
    res = world8_results
    _close(res, "gqa_tp1", "gqa_tp2")
    for r in range(8):
        d = res[r]["dsv3_tp2pp2ep4etp1"]
        assert d["local_experts"] == [[2 * d["ep_rank"], 2 * d["ep_rank"] + 1]] * (1 if d["pp_rank"] == 0 else 3)  # +MTP
        d = res[r]["qwen3_tp2pp2vpp2ep2_sp"]
        assert d["layer_numbers"] == [[1 + d["pp_rank"]], [3 + d["pp_rank"]]]
        # bf16: linears bf16, norms fp32 (torch norms ignore params_dtype); order tp-cp-ep-pp-dp puts
        # PP before DP: with TP2 PP2 DP2 the pipeline peer of rank r is r + 2
        d = res[r]["dsv3_bf16_tp2pp2ep2etp1_ppnotlast"]
        assert d["pp_rank"] == (r // 2) % 2
        dtypes = {n: dt for n, dt in d["dtypes"].items()}
        assert dtypes["decoder.layers.0.self_attention.linear_proj.weight"] == torch.bfloat16
        assert dtypes["decoder.layers.0.input_layernorm.weight"] == torch.float32


# ---------------------------------------------------------------------------------------------
# mcore_reshard.core.mesh against parallel_state
# ---------------------------------------------------------------------------------------------

MESH_CONFIGS = {
    4: [
        dict(tp=2, pp=2),
        dict(tp=1, ep=4),
        dict(tp=2, ep=2, etp=1),
        dict(tp=2, ep=4, etp=1),
        dict(tp=1, ep=2, etp=2),
        dict(tp=2, cp=2, ep=2, etp=1),
        dict(tp=1, cp=2, pp=2),
        dict(tp=2, pp=2, order="tp-cp-ep-pp-dp"),
        dict(tp=1, ep=2, etp=2, order="tp-cp-ep-pp-dp"),
        dict(tp=2, pp=2, order="tp-pp-dp"),
    ],
    8: [
        dict(tp=2, cp=2, pp=2, ep=2, etp=1),
        dict(tp=2, pp=2, ep=4, etp=1),
        dict(tp=4, ep=2, etp=2),
        dict(tp=2, ep=8, etp=1),
        dict(tp=1, cp=2, ep=4, etp=2),
        dict(tp=2, pp=2, ep=2, etp=1, order="tp-cp-ep-pp-dp"),
        dict(tp=2, cp=2, ep=2, etp=2, order="tp-cp-ep-pp-dp"),
        dict(tp=2, cp=2, pp=2, ep=2, etp=2, order="tp-pp-cp-ep-dp"),
        dict(tp=2, cp=2, pp=2, ep=4, etp=1, order="pp-tp-cp-ep-dp"),
    ],
}


def _mesh_vs_parallel_state(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from mcore_reshard.core.mesh import megatron_meshes

    problems = []
    for cfg in MESH_CONFIGS[world]:
        mc.init_megatron(tp=cfg.get("tp", 1), pp=cfg.get("pp", 1), ep=cfg.get("ep", 1), etp=cfg.get("etp"),
                         cp=cfg.get("cp", 1), order=cfg.get("order", "tp-cp-ep-dp-pp"))
        m = megatron_meshes(world, **cfg)
        groups = {
            ("dense", "tp"): ps.get_tensor_model_parallel_group(),
            ("dense", "pp"): ps.get_pipeline_model_parallel_group(),
            ("dense", "dp"): ps.get_data_parallel_group(with_context_parallel=False),
            ("dense", "cp"): ps.get_context_parallel_group(),
            ("dense", ("dp", "cp")): ps.get_data_parallel_group(with_context_parallel=True),
            ("dense", ("tp", "cp")): ps.get_tensor_and_context_parallel_group(),
            ("expert", "ep"): ps.get_expert_model_parallel_group(),
            ("expert", "etp"): ps.get_expert_tensor_parallel_group(),
            ("expert", "edp"): ps.get_expert_data_parallel_group(),
            ("expert", "pp"): ps.get_pipeline_model_parallel_group(),
            ("expert", ("etp", "ep")): ps.get_expert_tensor_and_model_parallel_group(),
        }
        for (mesh_name, axes), group in groups.items():
            want = dist.get_process_group_ranks(group)
            got = getattr(m, mesh_name).group(rank, axes)
            if got != want:
                problems.append(f"{cfg} rank {rank}: {mesh_name}.group({axes!r}) = {got}, "
                                f"parallel_state = {want}")
        coords = {
            ("dense", "tp"): ps.get_tensor_model_parallel_rank(),
            ("dense", "pp"): ps.get_pipeline_model_parallel_rank(),
            ("dense", "dp"): ps.get_data_parallel_rank(with_context_parallel=False),
            ("dense", "cp"): ps.get_context_parallel_rank(),
            ("expert", "ep"): ps.get_expert_model_parallel_rank(),
            ("expert", "etp"): ps.get_expert_tensor_parallel_rank(),
            ("expert", "edp"): ps.get_expert_data_parallel_rank(),
            ("expert", "pp"): ps.get_pipeline_model_parallel_rank(),
        }
        for (mesh_name, axis), want in coords.items():
            got = getattr(m, mesh_name).coord(rank)[axis]
            if got != want:
                problems.append(f"{cfg} rank {rank}: {mesh_name}.coord()[{axis!r}] = {got}, parallel_state = {want}")
        mc.destroy_megatron()
    return problems


@pytest.mark.parametrize("world", [4, 8])
def test_mesh_matches_parallel_state(world):
    problems = [p for per_rank in mc.spawn(_mesh_vs_parallel_state, world, timeout=240) for p in per_rank]
    assert not problems, "mcore_reshard.core.mesh differs from parallel_state:\n" + "\n".join(problems)


def _sweep_rank_generator(rank, world):
    """Whole-world comparison of every group list with Megatron's RankGenerator (no groups made),
    for every order permutation Megatron accepts, with 16 size combinations (seeded sample of
    tp, cp, pp in 1-2, ep in 1-4, etp in 1-2, dp 1-2 times, worlds up to 64, rank offset 0 or 8)."""
    import random

    from megatron.core.parallel_state import RankGenerator

    from mcore_reshard.core.mesh import megatron_meshes

    if rank != 0:
        return []
    rng = random.Random(1234)
    sizes = list(itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4), (1, 2), (1, 2), (0, 8)))
    problems, checked = [], 0
    for tokens in itertools.permutations(["tp", "cp", "ep", "dp", "pp"]):
        order = "-".join(tokens)
        for tp, cp, pp, ep, etp, dp_mult, offset in rng.sample(sizes, 16):
            world_size = tp * cp * pp * dp_mult * 2
            if world_size % (etp * ep * pp):
                continue
            dp, edp = world_size // (tp * cp * pp), world_size // (etp * ep * pp)
            if not (order.endswith("pp") or pp == 1 or dp == edp):
                continue  # initialize_model_parallel rejects this config
            dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order, rank_offset=offset)
            expert = RankGenerator(tp=etp, ep=ep, dp=edp, pp=pp, cp=1, order=order, rank_offset=offset)
            if dense.get_ranks("pp") != expert.get_ranks("pp"):
                continue  # initialize_model_parallel rejects this config
            m = megatron_meshes(world_size, tp=tp, pp=pp, cp=cp, ep=ep, etp=etp, order=order, rank_offset=offset)
            pairs = [(m.dense, a, dense, t) for a, t in (("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"),
                                                         (("dp", "cp"), "dp-cp"), (("tp", "pp"), "tp-pp"))]
            pairs += [(m.expert, a, expert, t) for a, t in (("etp", "tp"), ("ep", "ep"), ("edp", "dp"),
                                                            ("pp", "pp"), (("etp", "ep"), "tp-ep"))]
            for mesh, axes, gen, token in pairs:
                checked += 1
                want = gen.get_ranks(token)
                got = mesh.groups(axes)
                if sorted(map(tuple, got)) != sorted(map(tuple, want)) or any(g != sorted(g) for g in want):
                    problems.append(f"order={order} tp={tp} cp={cp} pp={pp} ep={ep} etp={etp} world={world_size} "
                                    f"offset={offset} {axes}: mesh {got} vs RankGenerator {want}")
    assert checked > 5000, checked
    return problems[:20]


def test_mesh_matches_rank_generator_sweep():
    problems = mc.spawn(_sweep_rank_generator, 1, timeout=120)[0]
    assert not problems, "\n".join(problems)
