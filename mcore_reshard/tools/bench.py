"""``mcore-reshard bench``: full-size plans (metadata only), a cost model, pictures, live runs.

Three parts, each reproducible from the command line (``BENCHMARKS.md`` has the results)::

    mcore-reshard bench --full-size                      # DeepSeek-V3 671B plans, 128-1024 ranks
    mcore-reshard bench --live --sizes 20M,100M,300M     # 4 CPU processes, three methods side by side
    mcore-reshard bench --smoke                          # a small version of both (seconds)

(``python -m mcore_reshard.tools.bench ...`` takes the same options.)

Full size: every configuration builds the source layout with
:func:`mcore_reshard.sources.megatron_spec.megatron_layout` and the target with the vLLM / SGLang / Megatron
layout builders, then calls :func:`mcore_reshard.core.planner.make_plan` once (whole plan, default
256 MiB staging budget), each configuration in its own process (``--timeout`` per configuration).
Reported: bytes moved against the lower bound and against a gather + broadcast baseline computed
from the same layouts (:func:`gather_broadcast`), max / mean bytes per sending and per receiving
rank, messages, rounds, plan time and plan memory, and the :mod:`mcore_reshard.tools.costmodel`
predictions next to the published figures.

Gather + broadcast baseline, precisely: the unit is one tensor of the Hugging Face checkpoint
(:func:`checkpoint_units`: a canonical tensor, except that stacked experts count per expert and per
gate / up / down projection, as the checkpoint stores them).  For every unit, the source rank
holding the most of it is the *root*; every distinct source box the root lacks is sent to it once
(by the least-loaded holder); then the root sends the whole unit to every destination rank that
needs any part of it (other than itself).  Bytes = gathered bytes + unit bytes x receivers.
(Megatron-Bridge's export all-gathers every TP shard to every TP rank before the broadcast, so it
moves more than this; NeMo RL's broadcast path sends every tensor to every inference worker.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import costmodel
from ..core.layout import Layout, itemsize
from .memstat import peak_bytes, reset_peak, rss_bytes

DEFAULT_OUT = "benchmarks"
NODE = 8    # GPUs per node for the pictures' aggregation

PUBLISHED = {
    "nemo_rl": [("NeMo RL refit, DeepSeek-V3 BF16, H100 (PP16xEP16 -> TP32xDP8)", "2.39-2.83 s"),
                ("NeMo RL broadcast baseline, same setup", "14.2-15.5 s"),
                ("NeMo RL on GB200", "1.93-2.59 s")],
    "nccl_m2n": [("nccl_m2n Reshard, DeepSeek-V3 on 256 GB200, hierarchical", "1.447 s"),
                 ("nccl_m2n Reshard, same, direct P2P", "3.838 s")],
}


# ----------------------------------------------------------------------------------- configurations

@dataclass
class FullSizeConfig:
    name: str
    title: str
    src: str                    # description
    dst: str
    colocated: bool
    topology: str               # cost-model preset
    build: Callable             # (cfg) -> (src Layout, dst Layout)
    note: str = ""
    tags: list = field(default_factory=list)


def replicate(layout: Layout, copies: int, stride: int) -> Layout:
    """``copies`` instances of ``layout``, instance i on ranks shifted by ``i * stride``."""
    out = Layout(dict(layout.tensors), {})
    for i in range(copies):
        for r, bufs in layout.buffers.items():
            out.buffers[r + i * stride] = dict(bufs)
    return out


def _megatron(cfg, **kw) -> Layout:
    from ..sources.megatron_spec import ParallelSizes, megatron_layout
    off = kw.pop("rank_offset", 0)
    return megatron_layout(cfg, ParallelSizes(**kw), "deepseek_v3", dtype="bfloat16", rank_offset=off)


def _nemo_rl(ep: bool):
    def build(cfg):
        from ..targets import vllm_layout
        src = _megatron(cfg, tp=1, pp=16, ep=16, etp=1, dp=16, first_stage_layers=3, last_stage_layers=2)
        dst = vllm_layout(cfg, tp=32, dp=8, enable_expert_parallel=ep, rank_offset=256)
        return src, dst
    return build


def _nccl_m2n(cfg):
    from ..targets import vllm_layout
    src = _megatron(cfg, tp=1, pp=4, ep=16, etp=1, dp=32, first_stage_layers=16, last_stage_layers=15)
    dst = vllm_layout(cfg, tp=8, dp=16, enable_expert_parallel=True, rank_offset=128)
    return src, dst


def _colocated_sglang(cfg):
    from ..targets import sglang_layout
    src = _megatron(cfg, tp=2, pp=8, ep=32, etp=1, dp=32, first_stage_layers=7, last_stage_layers=6)
    engine = sglang_layout(cfg, tp=8, dp=8, ep=8, enable_dp_attention=True)
    return src, replicate(engine, 64, 8)


def _colocated_sglang_ep32(cfg):
    from ..targets import sglang_layout
    src = _megatron(cfg, tp=2, pp=8, ep=32, etp=1, dp=32, first_stage_layers=7, last_stage_layers=6)
    engine = sglang_layout(cfg, tp=32, dp=8, ep=32, enable_dp_attention=True)
    return src, replicate(engine, 16, 32)


def _train1024(cfg):
    from ..targets import vllm_layout
    src = _megatron(cfg, tp=2, pp=16, ep=64, etp=1, dp=32, first_stage_layers=3, last_stage_layers=2)
    engine = vllm_layout(cfg, tp=8, dp=32, enable_expert_parallel=True)
    return src, replicate(engine, 4, 256)


def kimi_k2_1t():
    """A Kimi-K2-like model: DeepSeek-V3's architecture at 1 T parameters (384 experts of 2048, 61
    layers, the first dense, 64 heads, vocabulary 163840; ``moonshotai/Kimi-K2-Instruct``'s config.json)."""
    from ..targets import dsv3_671b
    return dsv3_671b().with_(n_routed_experts=384, num_attention_heads=64, num_key_value_heads=64,
                             first_k_dense_replace=1, vocab_size=163840, num_nextn_predict_layers=0)


def _kimi_k2_2048(cfg):
    """2048 ranks, colocated: Megatron tp=2 pp=16 ep=64 (edp=2) -> 16 vLLM replicas tp=8 dp=16 EP
    (ep=128, 3 experts per rank).  Ignores ``cfg``: the model is :func:`kimi_k2_1t`."""
    from ..targets import vllm_layout
    cfg = kimi_k2_1t()
    src = _megatron(cfg, tp=2, pp=16, ep=64, etp=1, dp=64, first_stage_layers=3, last_stage_layers=2)
    engine = vllm_layout(cfg, tp=8, dp=16, enable_expert_parallel=True)
    return src, replicate(engine, 16, 128)


def _small(cfg_name: str):
    """Scaled-down DeepSeek-V3 (the smoke test): same code paths, seconds."""
    def build(cfg):
        from ..targets import vllm_layout
        src = _megatron(cfg, tp=1, pp=4, ep=4, etp=1, dp=4, first_stage_layers=1, last_stage_layers=1)
        dst = vllm_layout(cfg, tp=4, dp=4, enable_expert_parallel=True, rank_offset=16)
        return src, dst
    return build


CONFIGS = {c.name: c for c in [
    FullSizeConfig("nccl_m2n", "nccl_m2n's DeepSeek-V3 setup, 128 -> 128 ranks (disaggregated)",
                   "Megatron tp=1 pp=4 ep=16 etp=1 dp=32 (edp=2), stages 16/15/15/15 layers, ranks 0-127",
                   "vLLM tp=8 dp=16 enable_expert_parallel (ep=128, 2 experts/rank), ranks 128-255",
                   False, "gb200_nvl72", _nccl_m2n,
                   note="nccl_m2n's published run uses 256 GB200 (128 training + 128 inference)"),
    FullSizeConfig("nemo_rl_ep", "NeMo RL's DeepSeek-V3 setup with vLLM expert parallelism, 256 -> 256 ranks",
                   "Megatron tp=1 pp=16 ep=16 etp=1 dp=16 (edp=1), stages 3/4x14/2 layers, ranks 0-255",
                   "vLLM tp=32 dp=8 enable_expert_parallel (ep=256, 1 expert/rank), ranks 256-511",
                   False, "dgx_h100", _nemo_rl(True)),
    FullSizeConfig("nemo_rl", "NeMo RL's DeepSeek-V3 setup as published (vLLM TP32 x DP8, no EP), 256 -> 256 ranks",
                   "Megatron tp=1 pp=16 ep=16 etp=1 dp=16 (edp=1), stages 3/4x14/2 layers, ranks 0-255",
                   "vLLM tp=32 dp=8, no expert parallelism: every expert TP-sharded 256 ways (I/256 = 8 rows), "
                   "ranks 256-511", False, "dgx_h100", _nemo_rl(False),
                   note="NeMo RL's grpo_dapomath17k_dsv3_megatron.yaml: vLLM tensor_parallel_size 32, no EP; "
                        "11.4M copies (every expert split 256 ways)"),
    FullSizeConfig("colocated_sglang", "Colocated: training TP2 PP8 EP32 on 512 ranks -> 64 SGLang engines on the same ranks",
                   "Megatron tp=2 pp=8 ep=32 etp=1 dp=32 (edp=2), stages 7/8x6/6 layers, ranks 0-511",
                   "64 x SGLang tp=8 dp=8 ep=8 --enable-dp-attention (one engine per 8-GPU node, ranks 8i..8i+7)",
                   True, "dgx_h100", _colocated_sglang,
                   note="in BF16 every GPU would hold 188 GB of weights (1/8 of the experts + replicated attention): "
                        "this engine shape serves DeepSeek-V3 in FP8 on larger GPUs; planned in BF16 as given"),
    FullSizeConfig("colocated_sglang_ep32", "Colocated, an SGLang shape that fits BF16 on 80 GB: training TP2 PP8 EP32 "
                   "-> 16 SGLang engines of 32 ranks on the same 512 ranks",
                   "Megatron tp=2 pp=8 ep=32 etp=1 dp=32 (edp=2), stages 7/8x6/6 layers, ranks 0-511",
                   "16 x SGLang tp=32 dp=8 ep=32 --enable-dp-attention (attention TP 4; engine k on ranks 32k..32k+31)",
                   True, "dgx_h100", _colocated_sglang_ep32,
                   note="~52 GB of BF16 weights per GPU (TP8 EP8 engines would need 188 GB per GPU)"),
    FullSizeConfig("train1024", "1024-rank training -> 4 vLLM wide-EP replicas on the same ranks",
                   "Megatron tp=2 pp=16 ep=64 etp=1 dp=32 (edp=1), stages 3/4x14/2 layers, ranks 0-1023",
                   "4 x vLLM tp=8 dp=32 enable_expert_parallel (ep=256), replica k on ranks 256k..256k+255",
                   True, "dgx_h100", _train1024),
    FullSizeConfig("kimi_k2", "Kimi-K2-like 1 T model (384 experts, 61 layers) on 2048 ranks, colocated: "
                   "training -> 16 vLLM replicas", "Megatron tp=2 pp=16 ep=64 etp=1 dp=64 (edp=2), stages 3/4x14/2 "
                   "layers, ranks 0-2047", "16 x vLLM tp=8 dp=16 enable_expert_parallel (ep=128, 3 experts/rank), "
                   "replica k on ranks 128k..128k+127", True, "dgx_h100", _kimi_k2_2048,
                   note="model: bench.kimi_k2_1t() (DeepSeek-V3 architecture, Kimi-K2's sizes); planned metadata-only"),
    FullSizeConfig("small", "Smoke: DeepSeek-V3 shapes scaled down, 16 -> 16 ranks",
                   "Megatron tp=1 pp=4 ep=4 etp=1 dp=4, ranks 0-15", "vLLM tp=4 dp=4 EP, ranks 16-31",
                   False, "dgx_h100", _small("small")),
]}
FULL_SIZE_DEFAULT = ["nccl_m2n", "nemo_rl_ep", "train1024", "colocated_sglang", "colocated_sglang_ep32", "nemo_rl"]


def small_config():
    """DeepSeek-V3 with every width divided down (4 MTP-less layers, 16 experts)."""
    from ..targets import dsv3_671b
    return dsv3_671b().with_(hidden_size=256, num_hidden_layers=4, vocab_size=1024, num_attention_heads=8,
                             num_key_value_heads=8, intermediate_size=512, n_routed_experts=16,
                             moe_intermediate_size=64, first_k_dense_replace=1, q_lora_rank=64, kv_lora_rank=32,
                             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0)


# ----------------------------------------------------------------------------------- layout analytics

def _tensor_index(lay: Layout):
    """tensor -> rank -> set of boxes (deduplicated)."""
    out: dict[str, dict[int, set]] = {}
    for r, bufs in lay.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                out.setdefault(p.tensor, {}).setdefault(r, set()).add(p.box)
    return out


def lower_bound(src: Layout, dst: Layout) -> dict:
    """Independent of the planner: bytes each destination rank needs and does not hold itself
    (source boxes of one tensor on one rank are disjoint in these layouts)."""
    sidx = _tensor_index(src)
    recv: dict[int, int] = {}
    for r, bufs in dst.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                isz = itemsize(src.tensors[p.tensor].dtype)
                have = sum(x.numel for s in sidx.get(p.tensor, {}).get(r, ()) if (x := s.intersect(p.box)) is not None)
                need = (p.box.numel - have) * isz
                if need:
                    recv[r] = recv.get(r, 0) + need
    return {"bytes": sum(recv.values()), "recv": recv}


def checkpoint_units(name: str, shape) -> list:
    """The tensors a gather + broadcast export moves one by one, as boxes of a canonical tensor: the
    Hugging Face checkpoint's tensors.  Stacked experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``) are ``experts.{e}.gate_proj`` / ``up_proj`` /
    ``down_proj``; everything else is one unit."""
    from ..core.box import Box
    if name.endswith("mlp.experts.gate_up_proj") and len(shape) == 3:
        E, I2, H = shape
        return [Box((e, k * (I2 // 2), 0), (1, I2 // 2, H)) for e in range(E) for k in (0, 1)]
    if name.endswith("mlp.experts.down_proj") and len(shape) == 3:
        E, H, I = shape
        return [Box((e, 0, 0), (1, H, I)) for e in range(E)]
    return [Box.full(shape)]


def _bins(boxes: dict, units: list) -> list[list]:
    """For each unit, the (box, ranks) entries that can touch it (by the leading index for experts)."""
    if len(units) == 1:
        return [list(boxes.items())]
    by_e: dict[int, list] = {}
    for box, ranks in boxes.items():
        for e in range(box.offsets[0], box.offsets[0] + box.sizes[0]):
            by_e.setdefault(e, []).append((box, ranks))
    return [by_e.get(u.offsets[0], []) for u in units]


def gather_broadcast(src: Layout, dst: Layout) -> dict:
    """The gather + broadcast baseline on these layouts (see the module docstring), one checkpoint
    tensor (:func:`checkpoint_units`) at a time: total bytes, per-rank sent / received bytes, and the
    per-unit items the cost model times."""
    s_boxes: dict[str, dict] = {}
    for r, bufs in src.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                s_boxes.setdefault(p.tensor, {}).setdefault(p.box, set()).add(r)
    d_boxes: dict[str, dict] = {}
    for r, bufs in dst.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                d_boxes.setdefault(p.tensor, {}).setdefault(p.box, set()).add(r)
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    load: dict[int, int] = {}
    items = []
    gathered = broadcast = 0
    for name in sorted(dst.tensors):
        meta = src.tensors[name]
        isz = itemsize(meta.dtype)
        units = checkpoint_units(name, meta.shape)
        s_bins, d_bins = _bins(s_boxes[name], units), _bins(d_boxes.get(name, {}), units)
        for unit, s_bin, d_bin in zip(units, s_bins, d_bins):
            parts = [(x, ranks) for box, ranks in s_bin if (x := box.intersect(unit)) is not None]
            held: dict[int, int] = {}
            for x, ranks in parts:
                for r in ranks:
                    held[r] = held.get(r, 0) + x.numel
            root = min(held, key=lambda r: (-held[r], r))
            gather: dict[int, int] = {}
            for x, ranks in sorted(parts, key=lambda t: t[0]):
                if root in ranks:
                    continue
                h = min(ranks, key=lambda q: (load.get(q, 0), q))
                n = x.numel * isz
                load[h] = load.get(h, 0) + n
                gather[h] = gather.get(h, 0) + n
                sent[h] = sent.get(h, 0) + n
                recv[root] = recv.get(root, 0) + n
                gathered += n
            receivers = sorted({r for box, ranks in d_bin if box.intersect(unit) is not None for r in ranks} - {root})
            nbytes = unit.numel * isz
            for r in receivers:
                recv[r] = recv.get(r, 0) + nbytes
            if receivers:
                sent[root] = sent.get(root, 0) + nbytes * len(receivers)
            broadcast += nbytes * len(receivers)
            items.append({"nbytes": nbytes, "root": root, "gather": gather, "receivers": receivers})
    return {"bytes": gathered + broadcast, "gather_bytes": gathered, "broadcast_bytes": broadcast,
            "sent": sent, "recv": recv, "items": items, "units": len(items)}


def _max_mean(d: dict) -> dict:
    vals = [v for v in d.values() if v]
    return {"max": max(vals, default=0), "mean": statistics.fmean(vals) if vals else 0, "ranks": len(vals)}


def traffic_matrix(plan, group: int) -> list[list[int]]:
    """Network bytes from sender group to receiver group (rank // group), local copies excluded."""
    n = max(plan.ranks) // group + 1
    mat = [[0] * n for _ in range(n)]
    for m in plan.messages:
        mat[m.src // group][m.dst // group] += sum(c.nbytes for c in m.entries)
    return mat


def run_full_size_config(name: str, budget: int = 256 << 20, memory: str = "rss", partial: str | None = None) -> dict:
    """Build, analyse, plan and cost one configuration in this process (JSON-able result).
    ``partial``: a file to write the pre-planning numbers to (layouts, lower bound, baseline)."""
    from ..core.planner import make_plan, plan_part
    from ..targets import dsv3_671b
    conf = CONFIGS[name]
    cfg = small_config() if name == "small" else dsv3_671b()
    out: dict = {"name": name, "title": conf.title, "src": conf.src, "dst": conf.dst, "colocated": conf.colocated,
                 "topology": conf.topology, "note": conf.note, "budget_bytes": budget}
    t0 = time.perf_counter()
    src, dst = conf.build(cfg)
    out["layout_s"] = time.perf_counter() - t0
    out["src_ranks"], out["dst_ranks"] = len(src.ranks), len(dst.ranks)
    out["ranks"] = len(set(src.ranks) | set(dst.ranks))
    out["tensors"] = len(dst.tensors)
    out["model_bytes"] = sum(src.tensors[n].nbytes for n in dst.tensors)
    out["unused_tensors"] = len(set(src.tensors) - set(dst.tensors))
    out["dst_pieces"] = sum(len(b.pieces) for bufs in dst.buffers.values() for b in bufs.values())
    out["src_pieces"] = sum(len(b.pieces) for bufs in src.buffers.values() for b in bufs.values())
    t0 = time.perf_counter()
    lb = lower_bound(src, dst)
    gb = gather_broadcast(src, dst)
    out["analytics_s"] = time.perf_counter() - t0
    out["layout_lower_bound"] = lb["bytes"]
    out["baseline"] = {"bytes": gb["bytes"], "gather_bytes": gb["gather_bytes"], "broadcast_bytes": gb["broadcast_bytes"],
                       "units": gb["units"],
                       "send": _max_mean(gb["sent"]), "recv": _max_mean(gb["recv"])}
    topo = costmodel.preset(conf.topology)
    out["baseline"]["model"] = costmodel.gather_broadcast_time(gb["items"], topo)
    out["lower_bound_per_rank"] = _max_mean(lb["recv"])
    del gb
    if partial:     # what is known before planning, in case planning does not finish
        with open(partial, "w") as f:
            json.dump(out, f)
    rss0, hwm_ok = rss_bytes(), reset_peak()
    if memory == "tracemalloc":
        tracemalloc.start()
    t0 = time.perf_counter()
    plan = make_plan(src, dst, budget_bytes=budget, ignore_unused=True)
    out["plan_s"] = time.perf_counter() - t0
    if memory == "tracemalloc":
        out["plan_tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    out["plan_rss_peak_added"] = peak_bytes() - rss0 if hwm_ok else None
    out["plan_memory_mode"] = memory
    # one rank's own part (the busiest rank's): only obtainable from the whole plan, see plan_part
    staged: dict[int, int] = {}
    for m in plan.messages:
        staged[m.src] = staged.get(m.src, 0) + m.nbytes
        staged[m.dst] = staged.get(m.dst, 0) + m.nbytes
    busiest = max(sorted(staged), key=lambda r: staged[r]) if staged else 0
    t0 = time.perf_counter()
    part = plan_part(plan, busiest)
    out["plan_part_s"] = time.perf_counter() - t0
    out["plan_part"] = {"rank": busiest, "messages": len(part.messages),
                        "copies": sum(len(m.entries) for m in part.messages) + len(part.local_copies)}
    del part
    st = plan.stats
    out["plan"] = {"network_bytes": st["network_bytes"], "lower_bound_bytes": st["lower_bound_bytes"],
                   "local_bytes": st["local_bytes"], "messages": st["messages"], "rounds": plan.rounds,
                   "copies": sum(len(m.entries) for m in plan.messages), "local_copies": len(plan.local_copies),
                   "send": _max_mean({int(r): v for r, v in st["sent_bytes"].items()}),
                   "recv": _max_mean({int(r): v for r, v in st["recv_bytes"].items()}),
                   "max_stage_send_bytes": st["max_stage_send_bytes"], "max_stage_recv_bytes": st["max_stage_recv_bytes"],
                   "max_stage_bytes": st["max_stage_bytes"],
                   # fewest rounds possible: the busiest rank's staged send + receive bytes / budget
                   "rounds_lower_bound": -(-max(staged.values(), default=0) // budget),
                   "padding_bytes": st["padding_bytes"]}
    out["cost"] = {}
    # every preset, except on plans with millions of copies (the fan-out model walks every copy)
    presets = sorted(costmodel.PRESETS) if out["plan"]["copies"] <= 2_000_000 else [conf.topology]
    for tname in presets:
        t = costmodel.preset(tname)
        p = costmodel.predict(plan, t)
        h = costmodel.hierarchical(plan, t)
        out["cost"][tname] = {"topology": t.name, "predicted_s": p["seconds"], "link_bound_s": p["link_bound_s"],
                              "local_s": p["local_s"], "nic_bytes": p["nic_bytes"], "nvlink_bytes": p["nvlink_bytes"],
                              "hier_predicted_s": h["seconds"], "hier_link_bound_s": h["link_bound_s"],
                              "hier_nic_bytes": h["nic_bytes"], "hier_nic_bytes_saved": h["nic_bytes_saved"]}
    group = 1 if out["ranks"] <= 64 else NODE
    out["matrix_group"] = group
    out["matrix"] = traffic_matrix(plan, group)
    out["per_rank"] = {"sent": [st["sent_bytes"].get(str(r), 0) for r in plan.ranks],
                       "recv": [st["recv_bytes"].get(str(r), 0) for r in plan.ranks],
                       "lower_bound_recv": None, "ranks": plan.ranks}
    out["per_rank"]["lower_bound_recv"] = [lb["recv"].get(r, 0) for r in plan.ranks]   # lower bound per rank
    out["published"] = PUBLISHED.get(name.replace("_ep", ""), [])
    return out


def _limit_memory(gib: float):
    def apply():
        import resource
        cap = int(gib * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    return apply if gib else None


def run_full_size(names: list[str], budget: int, memory: str, timeout: float, log=print,
                  max_mem_gib: float = 0, progress: str | Path | None = None) -> list[dict]:
    """Each configuration in its own process (``python -m mcore_reshard.tools.bench --in-process``), so
    that its memory is measured alone, a slow one is given up after ``timeout`` seconds and one
    that needs more than ``max_mem_gib`` of address space fails (MemoryError) instead of pushing the
    machine into swap (0: no cap).  ``progress``: a JSON file rewritten after every configuration."""
    from .progress import bar
    results = []
    for name in bar(names, desc="full-size plans", unit="config"):
        with tempfile.TemporaryDirectory(prefix="mcore-bench-") as tmp:
            path = os.path.join(tmp, "out.json")
            cmd = [sys.executable, "-m", "mcore_reshard.tools.bench", "--full-size", "--configs", name, "--in-process",
                   "--budget-mib", str(budget / (1 << 20)), "--memory", memory, "--json", path]
            log(f"[bench] {name}: planning ({' '.join(cmd[3:])}) ...")
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True,
                                      preexec_fn=_limit_memory(max_mem_gib))
            except subprocess.TimeoutExpired:
                log(f"[bench] {name}: gave up planning after {timeout:.0f} s")
                results.append(_partial(path, name, f"plan not finished in {timeout:.0f} s"))
                _progress(results, progress)
                continue
            if proc.returncode != 0 or not os.path.exists(path):
                tail = (proc.stderr or proc.stdout)[-1500:]
                log(f"[bench] {name}: failed\n{tail}")
                last = tail.strip().splitlines()[-1] if tail.strip() else f"exit status {proc.returncode}"
                results.append(_partial(path, name, last[:300]))
                _progress(results, progress)
                continue
            with open(path) as f:
                res = json.load(f)[0]
            log(f"[bench] {name}: done in {time.perf_counter() - t0:.0f} s (plan {res['plan_s']:.1f} s)")
            results.append(res)
            _progress(results, progress)
    return results


def _partial(path: str, name: str, error: str) -> dict:
    try:
        with open(path + ".partial") as f:
            res = json.load(f)
    except OSError:
        res = {"name": name, "title": CONFIGS[name].title}
    res["error"] = error
    return res


def _progress(results: list, path) -> None:
    if path:
        _save(Path(path), results)


# ----------------------------------------------------------------------------------- pictures

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_full_size(res: dict, img_dir: Path) -> list[str]:
    """Traffic heatmap (sender x receiver group) and per-rank load bars of one configuration."""
    plt = _plt()
    import numpy as np
    img_dir.mkdir(parents=True, exist_ok=True)
    files = []
    mat = np.array(res["matrix"], dtype=float) / 1e9
    g = res["matrix_group"]
    fig, ax = plt.subplots(figsize=(6.4, 5.4), dpi=110)
    from matplotlib.colors import LogNorm
    shown = np.where(mat > 0, mat, np.nan)
    pos = mat[mat > 0]
    norm = LogNorm(vmin=pos.min(), vmax=pos.max()) if pos.size and pos.max() > 10 * pos.min() else None
    im = ax.imshow(shown, cmap="viridis", interpolation="nearest", origin="upper", norm=norm)
    fig.colorbar(im, ax=ax, label="GB sent")
    unit = "rank" if g == 1 else f"node ({g} ranks)"
    ax.set_xlabel(f"receiver {unit}")
    ax.set_ylabel(f"sender {unit}")
    ax.set_title(f"{res['name']}: network bytes, {res['ranks']} ranks", fontsize=10)
    fig.tight_layout()
    p = img_dir / f"{res['name']}_traffic.png"
    fig.savefig(p)
    plt.close(fig)
    files.append(str(p))
    pr = res["per_rank"]
    ranks = pr["ranks"]
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=110)
    sent = np.array(pr["sent"], dtype=float) / 1e9
    recv = np.array(pr["recv"], dtype=float) / 1e9
    ax.bar(ranks, sent, width=1.0, color="tab:blue", label="sent (plan)")
    ax.bar(ranks, -recv, width=1.0, color="tab:orange", label="received (plan)")
    bmax = res["baseline"]["recv"]["max"] / 1e9
    if bmax:
        ax.axhline(-bmax, color="tab:red", lw=1, ls="--",
                   label=f"gather+broadcast: max received per rank ({bmax:.3g} GB)")
    ax.axhline(0, color="black", lw=0.5)
    ax.set_xlabel("rank")
    ax.set_ylabel("GB (received below 0)")
    ax.set_title(f"{res['name']}: bytes per rank", fontsize=10)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    p = img_dir / f"{res['name']}_load.png"
    fig.savefig(p)
    plt.close(fig)
    files.append(str(p))
    return files


def plot_live(rows: list[dict], img_dir: Path) -> list[str]:
    plt = _plt()
    img_dir.mkdir(parents=True, exist_ok=True)
    cases = sorted({r["case"] for r in rows})
    methods = [m for m in ("mcore_reshard", "megatron_resharding", "gather_broadcast")
               if any(m in r["methods"] for r in rows)]
    fig, axes = plt.subplots(1, len(cases), figsize=(5.2 * len(cases), 3.8), dpi=110, squeeze=False)
    colors = {"mcore_reshard": "tab:green", "megatron_resharding": "tab:blue", "gather_broadcast": "tab:red"}
    for ax, case in zip(axes[0], cases):
        sub = [r for r in rows if r["case"] == case]
        xs = range(len(sub))
        w = 0.8 / max(len(methods), 1)
        for k, m in enumerate(methods):
            med = [r["methods"].get(m, {}).get("median_s", 0) for r in sub]
            lo = [med[i] - r["methods"].get(m, {}).get("min_s", 0) for i, r in enumerate(sub)]
            hi = [r["methods"].get(m, {}).get("max_s", 0) - med[i] for i, r in enumerate(sub)]
            ax.bar([x + (k - (len(methods) - 1) / 2) * w for x in xs], med, w, yerr=[lo, hi], capsize=2,
                   color=colors[m], label=m)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['size']}\n({r['params'] / 1e6:.0f}M)" for r in sub])
        ax.set_ylabel("refit time, s (median, min-max)")
        ax.set_title(case, fontsize=10)
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = img_dir / "live_times.png"
    fig.savefig(p)
    plt.close(fig)
    return [str(p)]


# ----------------------------------------------------------------------------------- tables

def _gb(n) -> str:
    return f"{n / 1e9:,.1f}" if n >= 1e8 else f"{n / 1e9:.3f}"


def _s(x: float) -> str:
    return f"{x:.2f}" if x >= 0.1 else f"{x * 1e3:.2f} ms"


def _mib(n) -> str:
    return f"{n / 2**20:,.0f}" if n is not None else "-"


def markdown_full_size(results: list[dict]) -> str:
    lines = ["| config | ranks | model GB | plan GB (= lower bound?) | gather+bcast GB | ratio | send max / mean GB |"
             " recv max / mean GB | g+b recv max GB | messages | rounds (lower bound) | staging MiB/rank |"
             " plan s (whole / one rank's part) | plan MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            if "baseline" not in r:
                lines.append(f"| {r['name']} | | | {r['error']} | | | | | | | | | | |")
                continue
            b = r["baseline"]
            lb = r["lower_bound_per_rank"]
            lines.append(
                f"| {r['name']} | {r['src_ranks']}->{r['dst_ranks']}{' (coloc.)' if r['colocated'] else ''} | "
                f"{_gb(r['model_bytes'])} | no plan ({r['error']}); lower bound {_gb(r['layout_lower_bound'])} | "
                f"{_gb(b['bytes'])} | {b['bytes'] / max(r['layout_lower_bound'], 1):.1f}x (vs lower bound) | - | "
                f"{_gb(lb['max'])} / {_gb(lb['mean'])} (lower bound) | {_gb(b['recv']['max'])} | - | - | - | - | - |")
            continue
        p, b = r["plan"], r["baseline"]
        eq = "yes" if p["network_bytes"] == p["lower_bound_bytes"] == r["layout_lower_bound"] else "NO"
        mem = r.get("plan_tracemalloc_peak") or r.get("plan_rss_peak_added")
        lines.append(
            f"| {r['name']} | {r['src_ranks']}->{r['dst_ranks']}{' (coloc.)' if r['colocated'] else ''} | "
            f"{_gb(r['model_bytes'])} | {_gb(p['network_bytes'])} ({eq}) | {_gb(b['bytes'])} | "
            f"{b['bytes'] / max(p['network_bytes'], 1):.1f}x | {_gb(p['send']['max'])} / {_gb(p['send']['mean'])} | "
            f"{_gb(p['recv']['max'])} / {_gb(p['recv']['mean'])} | {_gb(b['recv']['max'])} | {p['messages']:,} | "
            f"{p['rounds']} ({p.get('rounds_lower_bound', '-')}) | {_mib(p.get('max_stage_bytes'))} | "
            f"{r['plan_s']:.1f} / {r['plan_s'] + r.get('plan_part_s', 0):.1f} | {_mib(mem)} |")
    lines += ["", "| config | topology | predicted s | link bound s | NVLink fan-out: predicted s | link bound s | "
              "NIC GB saved | gather+bcast model s | published |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "cost" not in r:
            continue
        c = r["cost"][r["topology"]]
        pub = "; ".join(f"{a}: {b}" for a, b in r.get("published", [])) or "-"
        lines.append(f"| {r['name']} | {c['topology']} | {_s(c['predicted_s'])} | {_s(c['link_bound_s'])} | "
                     f"{_s(c['hier_predicted_s'])} | {_s(c['hier_link_bound_s'])} | {_gb(c['hier_nic_bytes_saved'])} | "
                     f"{_s(r['baseline']['model']['seconds'])} | {pub} |")
    return "\n".join(lines)


def markdown_live(rows: list[dict]) -> str:
    lines = ["| size (params) | case | method | median s | min-max s | time / mcore_reshard | bytes sent | "
             "bytes / lower bound | messages | peak added MiB/rank | bit-exact |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ours = r["methods"].get("mcore_reshard", {}).get("median_s")
        lb = r["methods"].get("mcore_reshard", {}).get("lower_bound")
        for m, e in r["methods"].items():
            if "median_s" not in e:
                ex = "yes" if e.get("bit_exact") else f"NO ({e.get('differ')} of {e.get('tensors')} tensors differ)"
                if "error" in e:
                    ex = "error: " + e["error"][:80]
                lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['case']} | {m} (as shipped) | - | - | - | - | - "
                             f"| - | - | {ex} |")
                continue
            ratio = f"{e['median_s'] / ours:.2f}x" if ours else "-"
            ex = "yes" if e.get("bit_exact") else f"NO ({e.get('differ')} of {e.get('tensors')} differ)"
            extra = f" ({e['rounds']} round(s))" if m.startswith("mcore_reshard") else ""
            vs_lb = f"{e['bytes'] / lb:.2f}" if lb else "-"
            lines.append(f"| {r['size']} ({r['params'] / 1e6:.0f}M) | {r['case']} | {m} | {e['median_s']:.3f} | "
                         f"{e['min_s']:.3f}-{e['max_s']:.3f} | {ratio} | {e['bytes'] / 1e6:,.1f} MB | {vs_lb} | "
                         f"{e['messages']:,}{extra} | {_mib(e['peak_added_bytes'])} | {ex} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- CLI

def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on an argparse subparsers object (``mcore-reshard bench``)."""
    p = subparsers.add_parser("bench", help="benchmarks: full-size plans + cost model, live CPU runs, pictures",
                              description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_args(p)
    p.set_defaults(func=cmd_bench)
    return p


def _add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--full-size", action="store_true", help="plan DeepSeek-V3 671B configurations (metadata only)")
    p.add_argument("--configs", default=",".join(FULL_SIZE_DEFAULT),
                   help=f"full-size configurations, comma separated (default: %(default)s; also: small)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per full-size configuration, and per live model size (default: %(default)s)")
    p.add_argument("--max-mem-gib", type=float, default=16,
                   help="address-space cap per full-size configuration process, GiB (0: none; default: %(default)s)")
    p.add_argument("--memory", choices=["rss", "tracemalloc"], default="rss",
                   help="plan memory: peak resident set added while planning (rss, cheap) or tracemalloc's peak "
                        "(Python allocations only; slows planning ~5x) (default: %(default)s)")
    p.add_argument("--live", action="store_true", help="live CPU+gloo runs: mcore_reshard vs megatron.core.resharding "
                                                        "vs gather+broadcast (4 processes)")
    p.add_argument("--sizes", default="20M,100M,300M", help="live model sizes (default: %(default)s; also: tiny, 1B)")
    p.add_argument("--cases", default=None, help="live layout pairs, ';'-separated (default: all)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions after one warm-up (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="live model dtype")
    p.add_argument("--budget-mib", type=float, default=256.0, help="staging budget per rank and round (default: 256)")
    p.add_argument("--smoke", action="store_true", help="small full-size config + cost model + one tiny live rep")
    p.add_argument("--out-dir", default=DEFAULT_OUT, help="results/ and img/ go here (default: %(default)s)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG pictures")
    p.add_argument("--report", metavar="JSON", help="re-print the tables and redraw the pictures of saved results "
                                                     "(benchmarks/results/full_size.json or live.json); runs nothing")
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)


def _log(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(msg, file=sys.stderr)     # above any progress bar being drawn


def cmd_bench(args) -> int:
    budget = int(args.budget_mib * (1 << 20))
    out_dir = Path(args.out_dir)
    if args.in_process:     # one full-size configuration, called by run_full_size
        res = [run_full_size_config(n, budget, args.memory, partial=args.json + ".partial")
               for n in args.configs.split(",") if n]
        with open(args.json, "w") as f:
            json.dump(res, f)
        return 0
    if args.report:
        with open(args.report) as f:
            data = json.load(f)
        live = bool(data) and "methods" in data[0]
        if not args.no_plots:
            if live:
                plot_live(data, out_dir / "img")
            else:
                for r in data:
                    if "matrix" in r:
                        plot_full_size(r, out_dir / "img")
        print(markdown_live(data) if live else markdown_full_size(data))
        return 0
    if not (args.full_size or args.live or args.smoke):
        _log("nothing to do: pass --full-size, --live and/or --smoke")
        return 2
    status = 0
    report = []
    if args.full_size or args.smoke:
        names = ["small"] if args.smoke and not args.full_size else [n for n in args.configs.split(",") if n]
        for n in names:
            if n not in CONFIGS:
                _log(f"unknown configuration {n!r}; known: {', '.join(CONFIGS)}")
                return 2
        tag = "smoke" if args.smoke and not args.full_size else "full_size"
        results = run_full_size(names, budget, "tracemalloc" if args.smoke and not args.full_size else args.memory,
                                args.timeout, log=_log, max_mem_gib=args.max_mem_gib,
                                progress=out_dir / "results" / f"{tag}.json")
        _save(out_dir / "results" / f"{tag}.json", results)
        if not args.no_plots:
            for r in results:
                if "error" not in r:
                    plot_full_size(r, out_dir / "img")
        report.append(markdown_full_size(results))
        if any("error" in r for r in results):
            status = 1
        for r in results:
            if "error" not in r and not (r["plan"]["network_bytes"] == r["plan"]["lower_bound_bytes"] == r["layout_lower_bound"]):
                status = 1
    if args.live or args.smoke:
        from .bench_live import CASES, run_live
        sizes = ["tiny"] if args.smoke and not args.live else [s for s in args.sizes.split(",") if s]
        reps = 1 if args.smoke and not args.live else args.reps
        cases = [c for c in args.cases.split(";") if c] if args.cases else list(CASES)
        tag = "live_smoke" if args.smoke and not args.live else "live"
        rows = []
        from .progress import bar
        for size in bar(sizes, desc="live sizes", unit="size"):   # one launch per size: a size that does not fit leaves the others' results
            _log(f"[bench] live {size}: cases {cases}, {reps} rep(s) after one warm-up, 4 processes")
            t0 = time.perf_counter()
            load = os.getloadavg()[0]
            try:
                got = run_live([size], cases, reps=reps, budget=budget, dtype=args.dtype, timeout=args.timeout)
            except Exception as e:  # noqa: BLE001 - reported, the other sizes still run
                _log(f"[bench] live {size} failed: {str(e)[-2000:]}")
                status = 1
                continue
            for row in got:
                row.update(loadavg_before=load, cpus=os.cpu_count(), dtype=args.dtype, budget_bytes=budget)
            rows += got
            _log(f"[bench] live {size} done in {time.perf_counter() - t0:.0f} s")
            _save(out_dir / "results" / f"{tag}.json", rows)
        if not args.no_plots and not (args.smoke and not args.live):
            plot_live(rows, out_dir / "img")
        report.append(markdown_live(rows))
        if not all(e.get("bit_exact", True) for r in rows for m, e in r["methods"].items() if m != "megatron_resharding_unpatched"):
            status = 1
    print("\n\n".join(report))
    return status


def _save(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mcore_reshard.tools.bench", description=__doc__.split("\n\n")[0])
    _add_args(parser)
    args = parser.parse_args(argv)
    return cmd_bench(args)


if __name__ == "__main__":
    sys.exit(main())
