"""The real-engine cases (one launch of 4 ranks per engine and mode runs them all)."""

VLLM_LAYOUTS = [
    {"id": "dsv3-tp1", "model": "dsv3", "par": {"tp": 1}},
    {"id": "dsv3-tp2", "model": "dsv3", "par": {"tp": 2}},
    {"id": "dsv3-noqlora-tp2", "model": "dsv3_noqlora", "par": {"tp": 2}},
    {"id": "dsv3-tp4", "model": "dsv3", "par": {"tp": 4}},
    {"id": "dsv3-tp2-ep", "model": "dsv3", "par": {"tp": 2, "ep": True}},
    {"id": "dsv3-tp2-ep-roundrobin", "model": "dsv3", "par": {"tp": 2, "ep": True, "placement": "round_robin"}},
    {"id": "dsv3-1group-tp2-ep-roundrobin", "model": "dsv3_1group",
     "par": {"tp": 2, "ep": True, "placement": "round_robin"}},
    {"id": "dsv3-dp2-tp2-ep", "model": "dsv3", "par": {"tp": 2, "dp": 2, "ep": True}},
    {"id": "dsv3-dp2-tp2-ep-roundrobin", "model": "dsv3",
     "par": {"tp": 2, "dp": 2, "ep": True, "placement": "round_robin"}},
    {"id": "dsv3-dp2-tp1-ep", "model": "dsv3_noqlora", "par": {"tp": 1, "dp": 2, "ep": True}},
    {"id": "dsv3-tp2-pp2", "model": "dsv3_pp", "par": {"tp": 2, "pp": 2}},
    {"id": "dsv3-mtp-tp2", "model": "dsv3_mtp", "par": {"tp": 2}, "mtp": True},
    {"id": "qwen3moe-tp2", "model": "qwen3_moe", "par": {"tp": 2}},
    {"id": "qwen3moe-tp4", "model": "qwen3_moe", "par": {"tp": 4}},
    {"id": "qwen3moe-tp2-ep-roundrobin", "model": "qwen3_moe", "par": {"tp": 2, "ep": True, "placement": "round_robin"}},
    {"id": "qwen3moe-dp2-tp2-ep", "model": "qwen3_moe", "par": {"tp": 2, "dp": 2, "ep": True}},
    {"id": "llama-tp1", "model": "llama", "par": {"tp": 1}},
    {"id": "llama-tp2", "model": "llama", "par": {"tp": 2}},
    {"id": "llama-tp4", "model": "llama", "par": {"tp": 4}},
]
for c in VLLM_LAYOUTS:
    c.setdefault("probe", True)

SGLANG_LAYOUTS = [
    {"id": "dsv3-tp1", "model": "dsv3", "par": {"tp": 1}},
    {"id": "dsv3-tp2", "model": "dsv3", "par": {"tp": 2}},
    {"id": "dsv3-noqlora-tp2", "model": "dsv3_noqlora", "par": {"tp": 2}},
    {"id": "dsv3-tp4", "model": "dsv3", "par": {"tp": 4}},
    {"id": "dsv3-tp2-ep2", "model": "dsv3", "par": {"tp": 2, "ep": 2}},
    {"id": "dsv3-tp4-ep4", "model": "dsv3", "par": {"tp": 4, "ep": 4}},
    {"id": "dsv3-tp4-ep2", "model": "dsv3", "par": {"tp": 4, "ep": 2}},
    {"id": "dsv3-tp4-dp2-dpattn", "model": "dsv3", "par": {"tp": 4, "dp": 2, "dp_attention": True}},
    {"id": "qwen3moe-tp2", "model": "qwen3_moe", "par": {"tp": 2}},
    {"id": "qwen3moe-tp2-ep2", "model": "qwen3_moe", "par": {"tp": 2, "ep": 2}},
    {"id": "qwen3moe-tp4", "model": "qwen3_moe", "par": {"tp": 4}},
    {"id": "qwen3moe-tp4-dp2-dpattn", "model": "qwen3_moe", "par": {"tp": 4, "dp": 2, "dp_attention": True}},
    {"id": "llama-tp4-dp2-dpattn", "model": "llama", "par": {"tp": 4, "dp": 2, "dp_attention": True}},
    {"id": "llama-tp1", "model": "llama", "par": {"tp": 1}},
    {"id": "llama-tp2", "model": "llama", "par": {"tp": 2}},
    {"id": "llama-tp4", "model": "llama", "par": {"tp": 4}},
]
for c in SGLANG_LAYOUTS:
    c.setdefault("probe", True)

REFITS = [
    {"id": "megatron-tp2ep2-to-tp2", "kind": "megatron"},
    {"id": "hf-export-on-trainer-rank0", "kind": "hf_rank0"},
]
VLLM_REFITS = REFITS + [{"id": "weight-transfer-backend", "kind": "backend"}]
SGLANG_REFITS = list(REFITS)
