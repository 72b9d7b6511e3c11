"""FP8 in transit (issue #7): block-FP8 target layouts, the quantization plan, and a live gloo refit
against an independent per-block reference quantizer (tests/helpers/fp8_workers.py).  No megatron-core:
the Megatron-Core live tests are in test_fp8_megatron.py."""
from __future__ import annotations

import json
from math import prod

import fp8_workers
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mcore_reshard.core.box import Box
from mcore_reshard.core.layout import Buffer, Layout, LayoutError, Piece, TensorMeta
from mcore_reshard.fp8.quant_layout import Fp8Rules, fp8_target, scale_shape
from mcore_reshard.fp8.quant_plan import Fp8Plan, make_fp8_plan, quantized_tensors
from mcore_reshard.fp8.quant_resharder import quantize_into
from mcore_reshard.mapper.family import load_family
from mcore_reshard.sources.megatron_spec import ParallelSizes, megatron_layout
from mcore_reshard.targets import canonical_tensors, dsv3_671b, sglang_layout, vllm_layout
from mcore_reshard.targets.vllm import experts_w13

L3 = "model.layers.3."


def _scales(layout, rank, prefix=L3):
    return {n[len(prefix):]: b.shape for n, b in layout.buffers[rank].items()
            if n.startswith(prefix) and n.endswith("_scale_inv")}


def _fp8(layout, block=(128, 128)):
    return fp8_target(layout, quantized_tensors(layout, "deepseek_v3", block), block)


# ----------------------------------------------------------------------------------- layouts

def test_family_table_says_what_is_quantized():
    q = load_family("deepseek_v3").fp8_rules().quantized(canonical_tensors(dsv3_671b()))
    assert "model.layers.3.mlp.experts.gate_up_proj" in q and "model.layers.0.mlp.gate_proj.weight" in q
    assert "model.layers.61.self_attn.kv_a_proj_with_mqa.weight" in q
    for n in ("model.layers.3.mlp.gate.weight", "model.embed_tokens.weight", "lm_head.weight",
              "model.layers.61.eh_proj.weight", "model.layers.3.input_layernorm.weight",
              "model.layers.3.mlp.gate.e_score_correction_bias"):
        assert n not in q
    assert len(q) == 3 * 8 + 59 * 10  # dense: 5 attn + 3 mlp; MoE: 5 attn + 2 experts + 3 shared
    with pytest.raises(LayoutError, match=r"gate_up_proj.*must be a multiple of the 16-row"):
        Fp8Rules(halves=(r"gate_up_proj$",)).quantized([TensorMeta("x.mlp.experts.gate_up_proj", (4, 40, 32), "bfloat16")], (16, 16))


def test_vllm_671b_tp8_scale_shapes():
    lay = _fp8(vllm_layout(dsv3_671b(), tp=8))
    s = _scales(lay, 5)
    E = "mlp.experts.routed_experts."
    assert s[E + "w13_weight_scale_inv"] == (256, 2 * 2048 // 8 // 128, 7168 // 128) == (256, 4, 56)
    assert s[E + "w2_weight_scale_inv"] == (256, 56, 2)
    assert s["self_attn.fused_qkv_a_proj.weight_scale_inv"] == (17, 56)
    assert s["self_attn.q_b_proj.weight_scale_inv"] == (192 // 8, 12)
    assert s["self_attn.kv_b_proj.weight_scale_inv"] == (256 // 8, 4)
    assert s["self_attn.o_proj.weight_scale_inv"] == (56, 128 // 8)
    assert s["mlp.shared_experts.gate_up_proj.weight_scale_inv"] == (4, 56)
    assert _scales(lay, 0, "model.layers.0.")["mlp.gate_up_proj.weight_scale_inv"] == (288 // 8, 56)
    fused = lay.buffers[0][L3 + "self_attn.fused_qkv_a_proj.weight_scale_inv"]
    assert [(p.tensor[len(L3):], str(p.box), str(p.local)) for p in fused.pieces] == [
        ("self_attn.q_a_proj.weight_scale_inv", "[0:12, 0:56]", "[0:12, 0:56]"),
        ("self_attn.kv_a_proj_with_mqa.weight_scale_inv", "[0:5, 0:56]", "[12:17, 0:56]")]
    w13 = lay.buffers[5][L3 + E + "w13_weight_scale_inv"]   # MoE-TP rank 5: gate rows 5*256.., up rows 2048+5*256..
    assert sorted((str(p.box), str(p.local)) for p in w13.pieces) == [
        ("[0:256, 10:12, 0:56]", "[0:256, 0:2, 0:56]"), ("[0:256, 26:28, 0:56]", "[0:256, 2:4, 0:56]")]
    assert lay.tensors[L3 + E.replace("routed_experts.", "") + "gate_up_proj_scale_inv"].shape == (256, 32, 56)
    assert lay.buffers[0][L3 + "mlp.gate.weight"].dtype == "bfloat16"            # router stays bf16
    assert lay.buffers[0][L3 + E + "w13_weight"].dtype == "float8_e4m3fn"
    assert "lm_head.weight_scale_inv" not in lay.buffers[0]


def test_vllm_671b_expert_parallel_scale_shapes():
    lay = _fp8(vllm_layout(dsv3_671b(), tp=1, dp=8, enable_expert_parallel=True))
    s = _scales(lay, 3)
    assert s["mlp.experts.routed_experts.w13_weight_scale_inv"] == (32, 2 * 2048 // 128, 56)
    assert s["mlp.experts.routed_experts.w2_weight_scale_inv"] == (32, 56, 16)
    assert s["self_attn.q_b_proj.weight_scale_inv"] == (192, 12)


def test_sglang_671b_dp_attention_fused_shared_expert_scales():
    lay = _fp8(sglang_layout(dsv3_671b(), tp=8, dp=8, enable_dp_attention=True))
    s = _scales(lay, 6)
    assert s["mlp.experts.w13_weight_scale_inv"] == (257, 4, 56)     # shared expert = slot 256
    assert s["mlp.experts.w2_weight_scale_inv"] == (257, 56, 2)
    assert s["self_attn.fused_qkv_a_proj_with_mqa.weight_scale_inv"] == (17, 56)
    assert s["self_attn.q_b_proj.weight_scale_inv"] == (192, 12)    # attention TP = 1
    slot = [p for p in lay.buffers[6][L3 + "mlp.experts.w13_weight_scale_inv"].pieces if "shared" in p.tensor]
    assert sorted((p.tensor[len(L3):], str(p.box), str(p.local)) for p in slot) == [
        ("mlp.shared_experts.gate_proj.weight_scale_inv", "[12:14, 0:56]", "[256:257, 0:2, 0:56]"),
        ("mlp.shared_experts.up_proj.weight_scale_inv", "[12:14, 0:56]", "[256:257, 2:4, 0:56]")]


def test_unaligned_targets_are_refused_with_the_reason():
    with pytest.raises(LayoutError) as e:
        _fp8(vllm_layout(dsv3_671b(), tp=32))
    msg = str(e.value)
    assert "rank 0" in msg and "not a multiple of the 128 block" in msg and "576" in msg, msg
    lay = vllm_layout(dsv3_671b().with_(first_k_dense_replace=0), tp=32)    # MoE only: 64-row expert shards
    with pytest.raises(LayoutError, match=r"w13_weight.*gate_up_proj.*64-wide shard.*not a multiple of the 128 block"):
        _fp8(lay)
    _fp8(vllm_layout(dsv3_671b(), tp=16))                                   # TP <= 16 is fine
    _fp8(vllm_layout(dsv3_671b(), tp=32, enable_expert_parallel=True).__class__())  # empty layout: no-op


def test_partial_block_must_end_its_buffer_and_plan_checks_the_block():
    from mcore_reshard.core.layout import stacked
    lay = Layout()
    lay.add_tensor("kv.weight", (24, 32), "bfloat16")
    lay.add_tensor("q.weight", (32, 32), "bfloat16")
    ok = stacked("f", "bfloat16", [("q.weight", Box.full((32, 32))), ("kv.weight", Box.full((24, 32)))])
    bad = stacked("g", "bfloat16", [("kv.weight", Box.full((24, 32))), ("q.weight", Box.full((32, 32)))])
    lay.add_buffer(0, ok)
    f = fp8_target(lay, {"q.weight", "kv.weight"}, (16, 16))
    assert f.buffers[0]["f_scale_inv"].shape == (2 + 2, 2)          # [q 2 block rows; kv 2 (one ragged)]
    lay.add_buffer(1, bad)
    with pytest.raises(LayoutError, match=r"rank 1 buffer g: kv.weight\[0:24, 0:32\].*partial last block at 24"):
        fp8_target(lay, {"q.weight", "kv.weight"}, (16, 16))
    src = Layout()
    for n, shape in (("q.weight", (32, 32)), ("kv.weight", (24, 32))):
        src.add_tensor(n, shape, "bfloat16")
        src.add_buffer(2, Buffer(n, shape, "bfloat16", (Piece(n, Box.full(shape), Box.full(shape)),)))
    with pytest.raises(ValueError, match=r"scale tensor kv.weight_scale_inv \[3, 4\] float32 for block \(8, 8\)"):
        make_fp8_plan(src, f, (8, 8))


# ----------------------------------------------------------------------------------- planning

def _rows_layout():
    """``[40, 32]`` bf16, tp=2 over rows on ranks 0-1; destination whole on rank 2."""
    src, dst = Layout(), Layout()
    src.add_tensor("w.weight", (40, 32), "bfloat16")
    for r in (0, 1):
        src.add_buffer(r, Buffer("w", (20, 32), "bfloat16", (Piece("w.weight", Box((20 * r, 0), (20, 32)), Box.full((20, 32))),)))
    dst.add_tensor("w.weight", (40, 32), "bfloat16")
    dst.add_buffer(2, Buffer("w", (40, 32), "bfloat16", (Piece("w.weight", Box.full((40, 32)), Box.full((40, 32))),)))
    return src, dst


def _owned_once(plan: Fp8Plan, layout: Layout):
    for name in plan.quantized:
        cells = [c for g in plan.groups for reg in g.regions if reg.tensor == name
                 for c in _cells(reg.grid)]
        assert len(cells) == len(set(cells)) == prod(scale_shape(layout.tensors[name].shape, plan.block)), name


def _cells(box: Box):
    import itertools
    return list(itertools.product(*(range(o, o + s) for o, s in zip(box.offsets, box.sizes))))


def test_cut_blocks_are_assembled_and_counted():
    src, dst = _rows_layout()
    plan = make_fp8_plan(src, fp8_target(dst, {"w.weight"}, (16, 16)), (16, 16))
    s = plan.stats
    assert s["assembly_network_bytes"] == 4 * 32 * 2             # rows 16:20 from rank 0 to owner rank 1
    assert s["assembly_local_bytes"] == 12 * 32 * 2               # rank 1's own rows 20:32
    assert s["fp8_weight_network_bytes"] == 40 * 32               # one byte per element
    assert s["fp8_scale_network_bytes"] == 3 * 2 * 4              # [3, 2] fp32
    assert s["bf16_network_bytes"] == 40 * 32 * 2 and s["bf16_local_bytes"] == 0
    assert s["network_bytes"] == 256 + 1280 + 24
    assert s["quantized_blocks"] == {"0": 2, "1": 4}
    regs = sorted((r.kind, r.owner, str(r.box)) for g in plan.groups for r in g.regions)
    assert regs == [("assembled", 1, "[16:32, 0:32]"), ("shard", 0, "[0:16, 0:32]"), ("shard", 1, "[32:40, 0:32]")]
    _owned_once(plan, src)
    again = Fp8Plan.from_json(json.loads(plan.dumps()))
    assert again.hash == plan.hash and again.stats == plan.stats


def test_replicas_split_the_work_and_memory_budget_splits_groups():
    src, dst = Layout(), Layout()
    for i in range(4):
        name = f"l{i}.weight"
        src.add_tensor(name, (64, 32), "bfloat16")
        dst.add_tensor(name, (64, 32), "bfloat16")
        for r in (0, 1, 2):          # three replicas (DP=3)
            src.add_buffer(r, Buffer(name, (64, 32), "bfloat16", (Piece(name, Box.full((64, 32)), Box.full((64, 32))),)))
        dst.add_buffer(3, Buffer(name, (64, 32), "bfloat16", (Piece(name, Box.full((64, 32)), Box.full((64, 32))),)))
    names = set(src.tensors)
    plan = make_fp8_plan(src, fp8_target(dst, names, (16, 16)), (16, 16), memory_bytes=1024)
    _owned_once(plan, src)
    assert plan.stats["assembly_network_bytes"] == 0
    assert sum(plan.stats["quantized_elements"].values()) == 4 * 64 * 32
    # 4 block rows (512 elements each) per tensor over 3 replicas: 2 + 1 + 1, the larger share
    # going to the least-loaded replica: 16 block rows end up 6 / 5 / 5
    assert sorted(plan.stats["quantized_elements"].values()) == [5 * 512, 5 * 512, 6 * 512]
    # one tensor's temporaries (2 block rows of e4m3 + their [2, 2] scales on one rank: 1040 B) are
    # over the 1 KiB budget, so every tensor is cut by block rows and written by 2 groups, each
    # group's stage B writing its own slab of the destination buffer (a view)
    assert plan.stats["groups"] == 8 and plan.stats["split_tensors"] == 4
    assert max(plan.arena.values()) == 512 + 16 <= 1024 == plan.stats["memory_bytes"]
    views = sorted(tuple(v) for g in plan.groups for v in g.views[3].values() if v[0] == "l0.weight")
    assert views == [("l0.weight", 0, 16), ("l0.weight", 16, 64)]
    with pytest.raises(ValueError, match=r"FP8 temporaries of l0.weight \(block row 0\) need 528 B on rank 0, over "
                       r"the FP8 memory budget of 500 B"):
        make_fp8_plan(src, fp8_target(dst, names, (16, 16)), (16, 16), memory_bytes=500)
    assert plan.stats["fp8_weight_network_bytes"] * 2 == plan.stats["bf16_network_bytes"]


def test_dsv3_671b_megatron_tp8_to_vllm_tp8_bytes():
    """Real DeepSeek-V3 dims (2 layers: one dense, one MoE), Megatron TP8 -> vLLM TP8 on 8 other ranks."""
    cfg = dsv3_671b().with_(num_hidden_layers=2, first_k_dense_replace=1, num_nextn_predict_layers=0)
    src = megatron_layout(cfg, ParallelSizes(tp=8), dtype="bfloat16")
    dst = _fp8(vllm_layout(cfg, tp=8, rank_offset=8))
    plan = make_fp8_plan(src, dst, (128, 128), allow_cast=True)
    s = plan.stats
    # Megatron TP8 cuts q_a (192-row shards) and kv_a (72-row shards) across 128-row blocks.  Per
    # layer: q_a has 4 cut blocks with 64 rows to move, kv_a 4 cut blocks with 56 rows to move.
    per_layer = (4 * 64 + 4 * 56) * 7168 * 2
    assert s["assembly_network_bytes"] == 2 * per_layer == 13_762_560
    weights = sum(p.box.numel for _, b, p in dst.iter_pieces() if b.dtype == "float8_e4m3fn")
    scales = sum(p.box.numel for _, b, p in dst.iter_pieces() if b.name.endswith("_scale_inv"))
    assert s["fp8_weight_network_bytes"] == weights == 12_300_845_056
    assert s["fp8_scale_network_bytes"] == 4 * scales == 3_004_928
    assert s["bf16_network_bytes"] == s["rest_network_bytes"] + 2 * weights == 28_338_413_568
    assert s["network_bytes"] == 16_054_336_000      # 0.567 of the BF16 refit
    # the BF16 comparison is counted, not planned: it matches the planner's own count
    from mcore_reshard.core.planner import make_plan
    from mcore_reshard.fp8.quant_layout import bf16_target
    bf16 = make_plan(src, bf16_target(dst, {n: "bfloat16" for n in plan.quantized}), allow_cast=True)
    assert (s["bf16_network_bytes"], s["bf16_local_bytes"]) == (bf16.stats["network_bytes"], bf16.stats["local_bytes"])


# ----------------------------------------------------------------------------------- quantizer

def test_vectorized_quantizer_matches_reference_on_ragged_blocks():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 37, 21, generator=g) * torch.logspace(-3, 3, 21)).to(torch.bfloat16)
    x[1, 16:32, 8:16] = 0
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(3, 3, 3, dtype=torch.float32)
    quantize_into(x, (16, 8), q, s, chunk_elems=300)         # several chunks per expert
    rq, rs = fp8_workers.ref_quantize(x, (16, 8))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert float(s[1, 1, 1]) == 1.0


# ----------------------------------------------------------------------------------- live (gloo)

def _synthetic_case(memory=None):
    """4 ranks.  Source: ``a`` [40, 48] tp=2 over rows x 2 replicas; ``z`` [24, 24] on ranks 0 and 1
    (with an all-zero block); experts ``e`` [3, 32, 24]: 0-1 on rank 0, expert 2 split by columns
    12 | 12 over ranks 1 and 3 (cuts 8-wide blocks); a norm.  Destination: ``a`` rows 0:24 | 24:40
    on ranks 2-3, ``e`` as vLLM w13 with MoE-TP 2 on ranks 0-1, ``z`` on 2, the norm on 3.  Block 8."""
    src, dst = Layout(), Layout()
    for lay in (src, dst):
        lay.add_tensor("a.weight", (40, 48), "bfloat16")
        lay.add_tensor("z.weight", (24, 24), "bfloat16")
        lay.add_tensor("e.gate_up_proj", (3, 32, 24), "bfloat16")
        lay.add_tensor("n.weight", (40,), "bfloat16")

    def whole(name, shape, box=None):
        box = box or Box.full(shape)
        return Buffer(name, box.sizes, "bfloat16", (Piece(name, box, Box.full(box.sizes)),))
    for r in range(4):
        src.add_buffer(r, whole("a.weight", (40, 48), Box((20 * (r % 2), 0), (20, 48))))
        src.add_buffer(r, whole("n.weight", (40,)))
    src.add_buffer(0, whole("z.weight", (24, 24)))
    src.add_buffer(1, whole("z.weight", (24, 24)))
    src.add_buffer(0, whole("e.gate_up_proj", (3, 32, 24), Box((0, 0, 0), (2, 32, 24))))
    src.add_buffer(1, whole("e.gate_up_proj", (3, 32, 24), Box((2, 0, 0), (1, 32, 12))))
    src.add_buffer(3, whole("e.gate_up_proj", (3, 32, 24), Box((2, 0, 12), (1, 32, 12))))
    dst.add_buffer(2, whole("a.weight", (40, 48), Box((0, 0), (24, 48))))
    dst.add_buffer(3, whole("a.weight", (40, 48), Box((24, 0), (16, 48))))
    dst.add_buffer(2, whole("z.weight", (24, 24)))
    dst.add_buffer(3, whole("n.weight", (40,)))
    for j in (0, 1):
        dst.add_buffer(j, experts_w13("w13_weight", "e.gate_up_proj", range(3), 16, 24, "bfloat16", 2, j))
    fp8 = fp8_target(dst, {"a.weight", "z.weight", "e.gate_up_proj"}, (8, 8))
    return {"src": src.to_json(), "dst": fp8.to_json(), "block": [8, 8], "memory": memory}


@pytest.mark.multiproc
def test_live_gloo_refit_bit_identical_to_reference():
    from mcore_reshard.tools.launch import spawn
    res = spawn(fp8_workers.synthetic_worker, 4, [_synthetic_case(), _synthetic_case(memory=1200)], timeout=300)
    for k in range(2):
        per = [r[k] for r in res]
        assert all(not r["bad"] for r in per), [r["bad"] for r in per]
        # pieces checked: a 2 x (weight + scale), z 1 + 1, norm 1, w13 2 ranks x (gate, up) x (weight + scale)
        assert sum(r["checked"] for r in per) == 4 + 2 + 1 + 8
        assert len({r["hash"] for r in per}) == 1 and all(r["src_untouched"] for r in per)
        work = [r["quantized_elements"] for r in per]
        assert sum(work) == 40 * 48 + 24 * 24 + 3 * 32 * 24 and work == [r["second"] for r in per]
        assert work == [int(per[0]["stats"]["quantized_elements"].get(str(q), 0)) for q in range(4)]
        s = per[0]["stats"]
        assert s["assembly_network_bytes"] > 0 and s["fp8_weight_network_bytes"] < s["bf16_network_bytes"]
        assert all(r["state_ok"] for r in per)            # every target buffer (slabs too) holds refit 2
    # 1200 B of temporaries per rank: ``a`` and ``e`` are cut (block rows, experts) over 4 groups;
    # their target buffers are written slab by slab, and no rank's arena exceeds the budget
    s = res[0][1]["stats"]
    assert s["groups"] == 4 and s["split_tensors"] == 2 and res[0][0]["stats"]["groups"] == 1
    assert max(r[1]["arena"] for r in res) <= 1200 < max(r[0]["arena"] for r in res)
    assert sum(r[1]["views"] for r in res) > 0


def test_memory_budget_below_one_unit_is_refused():
    from mcore_reshard.core.planner import PlanError
    case = _synthetic_case(memory=1024)
    with pytest.raises(PlanError, match=r"FP8 temporaries of a.weight \(block row 2\) need 1,184 B on rank 2, over "
                       r"the FP8 memory budget of 1,024 B"):
        make_fp8_plan(Layout.from_json(case["src"]), Layout.from_json(case["dst"]), (8, 8), memory_bytes=1024)


def test_cli_plan_fp8(capsys):
    from mcore_reshard.tools.cli import main
    assert main(["plan", "--model", "dsv3-tiny", "--src", "tp=2,pp=2", "--dst", "vllm:tp=2", "--dtype", "bfloat16",
                 "--fp8", "16"]) == 0
    out = capsys.readouterr().out
    assert "FP8 block 16x16" in out and "(BF16 refit of the same layouts:" in out, out
    assert "assembly (cut blocks)  2,048 B over network" in out, out   # kv_a 12|12 rows: 4 x 64 x 2 B in 4 layers
    # bad input: one error line and exit status 2 (no traceback)
    assert main(["plan", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "vllm:tp=2", "--dtype", "bfloat16",
                 "--fp8", "32"]) == 2
    assert "not a multiple of the 32 block" in capsys.readouterr().err


def test_state_of_a_buffer_written_by_several_groups():
    """A target buffer cut into slabs holds version v only when every slab does: a refit stopped
    between two groups leaves it incomplete (None), never reported as the old or the new version."""
    from types import SimpleNamespace

    from mcore_reshard.fp8.quant_resharder import Fp8Resharder

    def res(buffers, interrupted=False):
        return SimpleNamespace(state=lambda: {"buffers": buffers, "interrupted": interrupted})
    groups = [SimpleNamespace(views={0: {"w#0:2": ["w", 0, 2], "s#0:1": ["s", 0, 1]}}),
              SimpleNamespace(views={0: {"w#2:4": ["w", 2, 4], "s#1:2": ["s", 1, 2]}})]
    r = Fp8Resharder.__new__(Fp8Resharder)
    r.plan, r.rank, r.version, r._interrupted = SimpleNamespace(groups=groups), 0, 3, None
    r.rest = res({"norm": 3})
    r.groups = [(None, [], res({"w#0:2": 3, "s#0:1": 3})), (None, [], res({"w#2:4": 3, "s#1:2": 3}))]
    st = r.state()
    assert st["buffers"] == {"norm": 3, "s": 3, "w": 3} and st["incomplete"] == [] and not st["interrupted"]
    # refit 4 stopped in group 2: group 1's slabs hold 4, group 2's are half-written (None) or still 3
    r._interrupted = {"version": 4, "error": "TransferError: ..."}
    r.rest = res({"norm": 4})
    r.groups = [(None, [], res({"w#0:2": 4, "s#0:1": 4})), (None, [], res({"w#2:4": None, "s#1:2": 3}, True))]
    st = r.state()
    assert st["buffers"] == {"norm": 4, "s": None, "w": None} and st["incomplete"] == ["s", "w"]
    assert st["interrupted"] and st["interrupted_version"] == 4 and st["version"] == 3


# ----------------------------------------------------------------------------------- shared layers

def _layered(src_sizes: dict, target: dict, block: int, layers: int = 6):
    from mcore_reshard.targets import dsv3_tiny
    cfg = dsv3_tiny(num_nextn_predict_layers=0).with_(num_hidden_layers=layers)
    src = megatron_layout(cfg, ParallelSizes(**src_sizes), dtype="bfloat16")
    return src, _fp8(vllm_layout(cfg, **target), (block, block))


def _alone(src, dst, plan: Fp8Plan, memory: int):
    """Every layer planned on its own, from ``restrict`` of the whole layouts (not the shared
    planner's one-pass split): [(layer number, its groups)] in the plan's order."""
    from mcore_reshard.core.planner.forms import layer_number
    from mcore_reshard.fp8.groups import _make_groups
    from mcore_reshard.fp8.quant_layout import scale_name
    from mcore_reshard.fp8.regions import plan_regions, restrict
    out = []
    for _, _, k in plan.groups.instances:
        names = sorted(n for n in plan.quantized if layer_number(n) == k)
        lsrc = restrict(src, set(names))
        ldst = restrict(dst, set(names) | {scale_name(n) for n in names})
        regions = plan_regions(lsrc, names, plan.block, ldst)
        out.append((k, _make_groups(lsrc, ldst, plan.block, set(names), regions, memory, 1 << 20)))
    return out


def _check_shared(src, dst, block: int, memory: int):
    plan = make_fp8_plan(src, dst, (block, block), budget_bytes=1 << 20, memory_bytes=memory, allow_cast=True,
                         ignore_unused=True)
    alone = _alone(src, dst, plan, memory)
    got = list(plan.groups)
    want = [g for _, gs in alone for g in gs]
    assert len(got) == len(want) == plan.stats["groups"]
    for i, (g, w) in enumerate(zip(got, want)):         # entry by entry: regions, temporaries, views, sub-plans
        gj, wj = g.to_json(), w.to_json()
        for key in ("tensors", "regions", "temp", "views", "assembly", "stage_b"):
            assert json.dumps(gj[key], sort_keys=True) == json.dumps(wj[key], sort_keys=True), (i, key, g.tensors)
        assert g.stage_b.hash == w.stage_b.hash
    # totals from the templates x instances equal those of the layers planned alone
    net = plan.rest.stats["network_bytes"] + sum(
        (w.assembly.stats["network_bytes"] if w.assembly else 0) + w.stage_b.stats["network_bytes"] for w in want)
    assert plan.stats["network_bytes"] == net
    assert plan.stats["regions"] == sum(len(w.regions) for w in want)
    _owned_once(plan, src)
    again = Fp8Plan.from_json(json.loads(plan.dumps()))
    assert again.hash == plan.hash and [g.to_json() for g in again.groups] == [g.to_json() for g in got]
    return plan


def test_shared_layers_equal_layers_planned_alone():
    """6 layers (1 dense + 5 MoE), Megatron TP2 -> vLLM TP2 on other ranks: 2 templates, 6 instances,
    the 4 renamed MoE layers equal to each planned alone; a memory budget that splits tensors too."""
    src, dst = _layered({"tp": 2}, {"tp": 2, "rank_offset": 2}, 16)
    plan = _check_shared(src, dst, 16, 1 << 20)
    assert (plan.stats["templates"], plan.stats["instances"]) == (2, 6)
    assert [x[1:] for x in plan.groups.instances] == [(0, 0), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5)]
    # kv_a_proj_with_mqa [24, 64], TP2 rows 0:12 | 12:24, block 16: 4 rows x 64 x 2 B assembled per layer
    assert plan.stats["assembly_network_bytes"] == 6 * 4 * 64 * 2
    small = _check_shared(src, dst, 16, 8 << 10)
    assert small.stats["split_tensors"] > 0 and small.stats["groups"] > plan.stats["groups"]
    assert max(small.arena.values()) <= 8 << 10


_LAYOUTS = [
    ({"tp": 2}, {"tp": 2, "rank_offset": 2}, 16),
    ({"tp": 2, "pp": 2}, {"tp": 2}, 16),                           # PP: each stage's layers their own template
    ({"tp": 2, "ep": 2, "dp": 2}, {"tp": 1, "dp": 2, "enable_expert_parallel": True, "rank_offset": 2}, 32),
    ({"tp": 1, "dp": 2}, {"tp": 2, "rank_offset": 2}, 16),         # replicas split the work
]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(_LAYOUTS), memory=st.integers(16 << 10, 1 << 20), half=st.integers(1, 3))
def test_shared_layers_property(case, memory, half):
    """Any layout, memory budget and depth: the shared plan equals every layer planned alone."""
    src_sizes, target, block = case
    layers = 2 * half                       # even: the PP layout splits them over 2 stages
    src, dst = _layered(src_sizes, target, block, layers)
    plan = _check_shared(src, dst, block, memory)
    assert plan.stats["instances"] == layers and plan.stats["templates"] <= layers
    if layers > 2 and "pp" not in src_sizes:
        assert plan.stats["templates"] == 2                      # the dense layer and one MoE layer


def test_a_buffer_of_two_layers_plans_them_together_and_mixed_buffers_are_refused():
    """A destination buffer fusing the quantized tensors of two layers: no per-layer split (one
    sub-problem, planned as a whole); a buffer holding a quantized and an unquantized tensor is
    refused naming both, before anything is planned."""
    from mcore_reshard.core.planner import PlanError
    names = ["model.layers.0.w.weight", "model.layers.1.w.weight"]
    src, dst = Layout(), Layout()
    for i, n in enumerate(names):
        src.add_tensor(n, (32, 16), "bfloat16")
        dst.add_tensor(n, (32, 16), "bfloat16")
        src.add_buffer(i, Buffer(n, (32, 16), "bfloat16", (Piece(n, Box.full((32, 16)), Box.full((32, 16))),)))
    dst.add_buffer(2, Buffer("fused", (64, 16), "bfloat16",
                             tuple(Piece(n, Box.full((32, 16)), Box((32 * i, 0), (32, 16))) for i, n in enumerate(names))))
    plan = make_fp8_plan(src, fp8_target(dst, set(names), (16, 16)), (16, 16))
    assert (plan.stats["templates"], plan.stats["instances"]) == (1, 1) and plan.groups.instances == [(0, None, None)]
    _owned_once(plan, src)
    assert plan.stats["fp8_weight_network_bytes"] == 2 * 32 * 16 and plan.stats["fp8_scale_network_bytes"] == 2 * 2 * 4
    assert sorted(plan.stats["quantized_elements"].items()) == [("0", 512), ("1", 512)]
    # the same two tensors in buffers of their own: two layers of one geometry?  No: they sit on
    # different source ranks, so two templates
    dst2 = Layout(dict(dst.tensors), {})
    for n in names:
        dst2.add_buffer(2, Buffer(n, (32, 16), "bfloat16", (Piece(n, Box.full((32, 16)), Box.full((32, 16))),)))
    plan2 = make_fp8_plan(src, fp8_target(dst2, set(names), (16, 16)), (16, 16))
    assert (plan2.stats["templates"], plan2.stats["instances"]) == (2, 2)
    assert plan2.stats["network_bytes"] == plan.stats["network_bytes"]
    # a quantized and an unquantized tensor in one destination buffer
    g = "model.layers.0.g.weight"
    src.add_tensor(g, (16, 16), "bfloat16")
    src.add_buffer(0, Buffer(g, (16, 16), "bfloat16", (Piece(g, Box.full((16, 16)), Box.full((16, 16))),)))
    dst2.add_tensor(g, (16, 16), "bfloat16")
    dst2.add_buffer(2, Buffer(g, (16, 16), "bfloat16", (Piece(g, Box.full((16, 16)), Box.full((16, 16))),)))
    fp8 = fp8_target(dst2, set(names), (16, 16))          # (fp8_target itself refuses such a buffer)
    del fp8.buffers[2][names[0]], fp8.buffers[2][g]
    fp8.buffers[2]["mixed"] = Buffer("mixed", (48, 16), "float8_e4m3fn", (
        Piece(names[0], Box.full((32, 16)), Box((0, 0), (32, 16))), Piece(g, Box.full((16, 16)), Box((32, 0), (16, 16)))))
    with pytest.raises(PlanError, match=rf"rank 2 buffer mixed holds {g} and {names[0]}, planned apart"):
        make_fp8_plan(src, fp8, (16, 16))


def test_an_fp8_plan_offers_the_stored_plan_interface():
    """Fp8Plan is a StoredPlan (JSON, hash, summary, stats) whose unquantized part is a CopyPlan;
    its JSON reads back to the same hash."""
    from mcore_reshard.core.planner import CopyPlan, StoredPlan
    from mcore_reshard.fp8.quant_plan import Fp8Plan
    src, dst = _rows_layout()
    plan = make_fp8_plan(src, fp8_target(dst, {"w.weight"}, (16, 16)), (16, 16))
    assert isinstance(plan, StoredPlan) and not isinstance(plan, CopyPlan) and isinstance(plan.rest, CopyPlan)
    again = Fp8Plan.from_json(json.loads(plan.dumps()))
    assert again.hash == plan.hash and len(plan.hash) == 64 and "FP8 block 16x16" in plan.summary()
