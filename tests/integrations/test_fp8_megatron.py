"""FP8 in transit from a live Megatron-Core tiny DeepSeek-V3 (bf16, CPU, gloo) into FP8 vLLM and
SGLang layouts (issue #7).

One launch of 4 ranks runs every case.  The source model is read by ``MegatronRefit`` (through
``sharded_state_dict``); the reference gathers the full BF16 tensors by the independent
attribute path of ``megatron_refit_worker``, maps them to Hugging Face names by hand and
quantizes them block by block in plain Python (``fp8_workers.ref_quantize``).  Every e4m3 byte,
every fp32 scale and every unquantized weight of every target rank must be bit-identical, each
block must be quantized exactly once (replicas split the work), and bytes are reported against the
plain BF16 refit of the same layouts.
"""
from __future__ import annotations

import fp8_workers
import pytest

from mcore_reshard.testing.megatron_cpu import spawn

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]

CASES = [
    # TP2 cuts kv_a_proj_with_mqa (12-row shards of 24) across 16-row blocks; target on ranks 0-1
    ("TP2 PP2 -> vLLM tp=2, block 16", {"src": {"tp": 2, "pp": 2}, "block": [16, 16],
                                        "target": ("vllm", {"tp": 2})}),
    # TP2 EP2 (dense part DP2: replicas) cuts q_a, q_b, kv_a, expert and shared-expert shards
    # across 32-blocks; vLLM DP2 x EP on ranks 2-3; a small memory budget (16 KiB of temporaries
    # per rank) forces many groups and cuts tensors by experts / block rows: target buffers such as
    # w13_weight are written slab by slab by several groups
    ("TP2 EP2 -> vLLM dp=2 EP, block 32", {"src": {"tp": 2, "ep": 2}, "block": [32, 32], "memory": 16 << 10,
                                           "target": ("vllm", {"tp": 1, "dp": 2, "enable_expert_parallel": True,
                                                               "rank_offset": 2})}),
    # disaggregated: ranks 0-1 train (TP2), ranks 2-3 serve SGLang with DP attention and the
    # shared expert fused as expert slot 8; 8 KiB of temporaries per rank: w13_weight (routed
    # experts + the shared expert's slot) is written slab by slab by several groups
    ("TP2 (0-1) -> SGLang dp-attention fused shared (2-3), block 16",
     {"src": {"tp": 2}, "block": [16, 16], "disaggregated": True, "memory": 8 << 10,
      "target": ("sglang", {"tp": 2, "dp": 2, "enable_dp_attention": True, "fuse_shared_expert": True,
                            "rank_offset": 2})}),
]


@pytest.fixture(scope="module")
def results():
    return spawn(fp8_workers.megatron_worker, 4, [c for _, c in CASES], timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)), ids=[n for n, _ in CASES])
def test_fp8_refit_bit_identical_to_reference(results, case):
    per = [r[case] for r in results]
    assert all(not r["bad"] for r in per), [r["bad"] for r in per]
    assert sum(r["checked"] for r in per) > 50
    assert len({r["hash"] for r in per}) == 1
    s = per[0]["stats"]
    work = [r["quantized_elements"] for r in per]
    assert sum(work) == per[0]["quantized_total"]                      # every block exactly once
    assert work == [int(s["quantized_elements"].get(str(q), 0)) for q in range(4)]
    assert s["fp8_weight_network_bytes"] + s["fp8_scale_network_bytes"] < s["bf16_network_bytes"]
    print(f"\n{CASES[case][0]}: assembly {s['assembly_network_bytes']} B, fp8 {s['fp8_weight_network_bytes']} B + "
          f"scales {s['fp8_scale_network_bytes']} B, rest {s['rest_network_bytes']} B, total {s['network_bytes']} B "
          f"vs BF16 {s['bf16_network_bytes']} B; groups {s['groups']}; work per rank {work}")


def test_cut_blocks_and_replicas(results):
    a, b, c = (results[0][k]["stats"] for k in range(3))
    # kv_a_proj_with_mqa [24, 64], TP2 = rows 0:12 | 12:24, block 16: block rows 0:16 are owned by
    # rank 0 (12 rows) and need rows 12:16 (4 x 64 x 2 B) from rank 1, in each of the 4 layers (the
    # targets have no MTP draft model: its layer is unused)
    assert a["assembly_network_bytes"] == 4 * 4 * 64 * 2
    assert c["assembly_network_bytes"] == 4 * 4 * 64 * 2
    assert b["assembly_network_bytes"] > a["assembly_network_bytes"]  # block 32 cuts many more shards
    assert b["groups"] > 10 and b["split_tensors"] > 0
    assert max(b["arena_bytes"].values()) <= b["memory_bytes"] == 16 << 10      # temporaries within the budget
    assert c["groups"] > 10 and c["split_tensors"] > 0 and max(c["arena_bytes"].values()) <= c["memory_bytes"] == 8 << 10
    work = [results[r][1]["quantized_elements"] for r in range(4)]
    assert min(work) > 0                                               # DP replicas share the work
