"""Live refit benchmark, CPU + gloo: this project vs ``megatron.core.resharding`` vs gather+broadcast.

Runs inside 4 local gloo processes (``mcore_reshard.testing.megatron_cpu.spawn``; needs megatron-core and a repository
checkout, because the CPU patches and the independent reference live in ``tests/``).  For every
model size and every layout pair, every rank builds both Megatron-Core models (colocated: each rank
holds a shard of the source *and* of the destination), then each method in turn:

1. zero every destination parameter and buffer (so a method that moves nothing fails the check);
   (with ``MCORE_RESHARD_BENCH_BATCHED=1`` in the environment, ``mcore_reshard_batched`` is also
   timed: the same Resharder with ``overlap=False``, i.e. the grouped batched path NCCL uses);
   ``mcore_reshard``, ``mcore_reshard_batched`` and ``floor`` are timed interleaved call by call
   (:func:`_timed_interleaved`), so their ratios are fair on a machine whose load drifts;
2. one warm-up call (plan building, caches, first-touch of staging memory), then ``reps`` timed
   calls, each between two barriers; for each timed call the peak resident memory above the
   resident memory before the call (``/proc/self/status`` VmHWM after resetting it through
   ``/proc/self/clear_refs``);
3. full destination tensors rebuilt by the independent path of ``tests/megatron_refit_worker``
   (all-gathers driven by each parameter's own TP attributes, never the layouts under test) and
   compared by sha256 with the source's: bit-exact or not, tensor by tensor.

Methods:

``mcore_reshard``
    :class:`mcore_reshard.refit.MegatronRefit` (plan once, ``refit()`` per call).
``megatron_resharding``
    ``megatron.core.resharding.refit.swap_model_weights(src, dst, service)`` with its gloo copy
    service (CPU patches from ``mcore_reshard.testing.megatron_cpu.install_cpu_shims``).  Megatron-Core 0.19.2 remaps
    local expert indices only for TE grouped-expert names (``weightK``); with SequentialMLP experts
    (``local_experts.<i>``, the only expert module without Transformer-Engine) an EP change copies
    the wrong experts.  It is run once as shipped (``megatron_resharding_unpatched``: bit-exactness
    only, not timed) and then timed with ``local_experts.<i>`` remapped to the global expert index in
    its resolved names (:func:`patch_sequential_mlp_names`).
``floor``
    :class:`TransportFloor`: the bare transport moving exactly the plan's bytes between the same
    pairs: one flat pre-allocated buffer per (sender, receiver) pair, one ``batch_isend_irecv`` of
    all of them, no packing, no local copies, nothing written into a model.  The ratio
    ``mcore_reshard / floor`` is what the executor adds on top of the wire.
``floor_local``
    Timed with ``mcore_reshard`` and ``floor`` whenever both run: the floor, then every local copy
    of the plan on each rank (``copy_`` from a source into a destination view on the same rank,
    as :meth:`~mcore_reshard.core.executor.Resharder.copy_local` runs them).  The least any
    executor does for the plan: a destination never aliases a live source, so the shards a rank
    keeps must be copied, and on a machine with fewer cores than ranks that CPU adds to the wire's.
``gather_broadcast``
    :class:`GatherBroadcast`: for every canonical tensor, the holders send their shards to one root
    (the source rank holding most of it), the root broadcasts the full tensor to every destination
    rank that needs any part of it, and every destination copies its boxes out of it.

Memory: the environment variable ``MALLOC_MMAP_THRESHOLD_`` is set (by :func:`run_live`) before the
processes start, so every allocation above 128 KiB is its own mapping and freed memory leaves the
resident set at once; without it glibc keeps freed blocks and later methods would look cheaper.
"""
from __future__ import annotations

import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ...util.memstat import peak_bytes, reset_peak, rss_bytes

# Model sizes: DeepSeek-V3 shapes scaled down (MLA, first layer dense, routed + one shared expert,
# expert bias), experts dominate the parameter count as in the real model.  Parameters counted on
# the canonical tensors (no MTP).
SIZES = {
    "tiny": dict(hidden=128, heads=4, q_lora=64, kv_lora=32, nope=32, rope=16, v=32, ffn=512, experts=8, moe_ffn=64,
                 layers=4, vocab=512),
    "20M": dict(hidden=512, heads=8, q_lora=256, kv_lora=128, nope=64, rope=32, v=64, ffn=2048, experts=8, moe_ffn=256,
                layers=4, vocab=4096),
    "100M": dict(hidden=1024, heads=16, q_lora=512, kv_lora=256, nope=64, rope=32, v=64, ffn=4096, experts=16,
                 moe_ffn=256, layers=4, vocab=16384),
    "300M": dict(hidden=1536, heads=16, q_lora=768, kv_lora=384, nope=96, rope=32, v=96, ffn=6144, experts=16,
                 moe_ffn=640, layers=4, vocab=32768),
    "1B": dict(hidden=2048, heads=16, q_lora=1024, kv_lora=512, nope=128, rope=64, v=128, ffn=8192, experts=32,
               moe_ffn=1280, layers=4, vocab=32768),
}

# colocated on 4 ranks: (source sizes, destination sizes)
CASES = {
    "TP2 PP2 -> TP4": ({"tp": 2, "pp": 2}, {"tp": 4}),
    "TP2 EP2 -> TP1 EP4": ({"tp": 2, "ep": 2}, {"tp": 1, "ep": 4, "etp": 1}),
    "TP2 EP2 -> TP1": ({"tp": 2, "ep": 2}, {"tp": 1}),
}

METHODS = ("mcore_reshard", "megatron_resharding", "gather_broadcast", "floor")


def hf_dims(d: dict) -> dict:
    """The size preset in Hugging Face field names (for megatron_spec / parameter counts)."""
    return {"hidden_size": d["hidden"], "num_hidden_layers": d["layers"], "num_attention_heads": d["heads"],
            "vocab_size": d["vocab"], "intermediate_size": d["ffn"], "q_lora_rank": d["q_lora"],
            "kv_lora_rank": d["kv_lora"], "qk_nope_head_dim": d["nope"], "qk_rope_head_dim": d["rope"],
            "v_head_dim": d["v"], "n_routed_experts": d["experts"], "moe_intermediate_size": d["moe_ffn"],
            "n_shared_experts": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 0}


def param_count(size: str) -> int:
    from ...sources.megatron_spec import ParallelSizes, megatron_layout
    lay = megatron_layout(hf_dims(SIZES[size]), ParallelSizes(), "deepseek_v3", dtype="bfloat16")
    return sum(int(torch.Size(m.shape).numel()) for m in lay.tensors.values())


# ----------------------------------------------------------------------------------- helpers

def tests_dir() -> Path:
    return Path(__file__).resolve().parents[3] / "tests" / "helpers"


def import_test_helpers():
    """:mod:`mcore_reshard.testing.megatron_cpu` (CPU patches) and ``megatron_refit_worker`` from the
    repository's tests/ (the independent reference); a clear error outside a checkout."""
    from ...testing import megatron_cpu as mcore_cpu
    d = tests_dir()
    if not (d / "megatron_refit_worker.py").exists():
        raise RuntimeError(f"the live benchmark needs a repository checkout: {d / 'megatron_refit_worker.py'} not found")
    if str(d) not in sys.path:
        sys.path.insert(0, str(d))
    import megatron_refit_worker
    return mcore_cpu, megatron_refit_worker


def build_dsv3_scaled(mcore_cpu, d: dict, dtype: torch.dtype) -> list:
    """``testing.tiny_models.build_dsv3_tiny`` with the widths of a size preset (same spec and options)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from ...testing import tiny_models
    kw = tiny_models.base_config_kwargs(dtype, False, None, None, None, None)
    L = d["layers"]
    config = MLATransformerConfig(
        num_layers=L, hidden_size=d["hidden"], num_attention_heads=d["heads"], ffn_hidden_size=d["ffn"],
        q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"], qk_head_dim=d["nope"], qk_pos_emb_head_dim=d["rope"],
        v_head_dim=d["v"], kv_channels=d["v"], rope_type="rope", qk_layernorm=True, layernorm_epsilon=1e-6,
        num_moe_experts=d["experts"], moe_router_topk=2, moe_ffn_hidden_size=d["moe_ffn"],
        moe_shared_expert_intermediate_size=d["moe_ffn"], moe_layer_freq=[0] + [1] * (L - 1),
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_pre_softmax=True, mtp_num_layers=None,
        **tiny_models.moe_kwargs("alltoall", "seq_aux_loss"), **kw)
    return tiny_models.build_chunks(config, d["vocab"], share_embeddings=False, mtp=False)


def _build(mcore_cpu, d: dict, sizes: dict, dtype: torch.dtype) -> list:
    from megatron.core import parallel_state as ps
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()   # keep the previous model's groups alive: it still uses them
    mcore_cpu.init_megatron(sizes.get("tp", 1), sizes.get("pp", 1), ep=sizes.get("ep", 1), etp=sizes.get("etp"))
    return build_dsv3_scaled(mcore_cpu, d, dtype)


def _zero(chunks) -> None:
    with torch.no_grad():
        for c in chunks:
            for p in c.parameters():
                p.zero_()
            for n, b in c.named_buffers():
                if n.endswith("expert_bias"):
                    b.zero_()


def _all_ranks(ref: dict) -> dict:
    """Union of every rank's {global name: [shape, dtype, digest]} (a rank only sees its stage)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, ref)
    out: dict = {}
    for p in parts:
        for n, v in p.items():
            if out.setdefault(n, v) != v:
                out[n] = None   # replicas disagree: never equal to a destination digest
    return out


def _exactness(worker_mod, dst, src_ref: dict) -> dict:
    """Compare the destination's full tensors with the source's (collective)."""
    dst_ref = _all_ranks(worker_mod.reference_digests(dst))
    names = set(src_ref) | set(dst_ref)
    return {"tensors": len(names), "differ": sorted(n for n in names if src_ref.get(n) != dst_ref.get(n))}


# ----------------------------------------------------------------------------------- megatron.core.resharding

_PATCHED = False


def patch_sequential_mlp_names(enable: bool = True) -> None:
    """Make ``megatron.core.resharding`` resolve SequentialMLP expert names to global expert
    indices (``...local_experts.<i>.`` -> ``...local_experts.<ep_rank * n_local + i>.``), as it
    does for TE's ``weightK``.  ``enable=False`` restores the shipped function."""
    global _PATCHED
    from megatron.core.resharding import utils as mru
    if not hasattr(mru, "_mcore_reshard_orig_assign"):
        mru._mcore_reshard_orig_assign = mru.assign_ep_resolved_name_inplace
    orig = mru._mcore_reshard_orig_assign
    if not enable:
        mru.assign_ep_resolved_name_inplace = orig
        _PATCHED = False
        return

    def assign(meta, *, base_name=None):
        orig(meta, base_name=base_name)
        if not meta.is_ep or meta.global_expert_index is not None:
            return
        m = re.search(r"(^|\.)local_experts\.(\d+)\.", meta.resolved_name)
        if m is None:
            return
        ep = meta.expert_parallel_group_ranks
        n_local = meta.num_experts // len(ep)
        g = ep.index(meta.owner_rank) * n_local + int(m.group(2))
        meta.resolved_name = meta.resolved_name[:m.start(2)] + str(g) + meta.resolved_name[m.end(2):]
        meta.global_expert_index = g

    mru.assign_ep_resolved_name_inplace = assign
    _PATCHED = True


def _counting_service():
    from megatron.core.resharding.copy_services.gloo_copy_service import GlooCopyService

    class CountingGlooCopyService(GlooCopyService):
        """The shipped gloo service, counting remote sends (bytes and messages) of this rank."""
        sent_bytes = 0
        sent_msgs = 0

        def submit_send(self, src_tensor, dest_rank, task_id=None):
            if dest_rank != self.rank:
                self.sent_bytes += src_tensor.numel() * src_tensor.element_size()
                self.sent_msgs += 1
            super().submit_send(src_tensor, dest_rank, task_id)

    return CountingGlooCopyService(group=dist.group.WORLD)


# ----------------------------------------------------------------------------------- gather + broadcast

class GatherBroadcast:
    """The baseline: one checkpoint tensor at a time (:func:`mcore_reshard.tools.bench.baselines.checkpoint_units`:
    canonical tensors, stacked experts split per expert and gate/up/down), gather it whole on one
    source rank, broadcast it to every destination rank that needs any of it, copy the needed boxes
    out (collective).

    Root: the source rank holding the most of the unit (ties: lowest rank).  Every other distinct
    source box is sent to the root by its least-loaded holder.  The broadcast runs on a process
    group of the root and the receivers (one group per distinct rank set, created here).
    """

    def __init__(self, src_layout, dst_layout, src_tensors: dict, dst_tensors: dict, group=None):
        from ...core.executor import torch_dtype
        from .baselines import checkpoint_units
        self.rank = me = dist.get_rank(group)
        self.src_t, self.dst_t = src_tensors, dst_tensors
        self.items = []
        load: dict[int, int] = {}
        groups: dict[tuple, object] = {}
        src_by_tensor: dict[str, dict] = {}
        for r, buf, p in src_layout.iter_pieces():
            src_by_tensor.setdefault(p.tensor, {}).setdefault(p.box, []).append((r, buf.name, p))
        dst_by_tensor: dict[str, list] = {}
        for r, buf, p in dst_layout.iter_pieces():
            dst_by_tensor.setdefault(p.tensor, []).append((r, buf.name, p))
        self.gather_bytes = self.bcast_bytes = self.messages = 0
        for name in sorted(dst_layout.tensors):
            meta = src_layout.tensors[name]
            dtype = torch_dtype(meta.dtype)
            isz = torch.empty((), dtype=dtype).element_size()
            for unit in checkpoint_units(name, meta.shape):
                parts = [(x, holders) for box, holders in sorted(src_by_tensor[name].items())
                         if (x := box.intersect(unit)) is not None]
                held: dict[int, int] = {}
                for x, holders in parts:
                    for r in {h[0] for h in holders}:
                        held[r] = held.get(r, 0) + x.numel
                root = min(held, key=lambda r: (-held[r], r))
                gather, root_parts = [], []     # (holder rank, buffer, piece, box inside the unit)
                for x, holders in parts:
                    mine = [h for h in holders if h[0] == root]
                    if mine:
                        root_parts.append((*mine[0], x))
                        continue
                    best = min(holders, key=lambda h: (load.get(h[0], 0), h[0]))
                    load[best[0]] = load.get(best[0], 0) + x.numel
                    gather.append((*best, x))
                dsts = [(r, b, p, x) for r, b, p in dst_by_tensor.get(name, ())
                        if (x := p.box.intersect(unit)) is not None]
                receivers = sorted({r for r, _, _, _ in dsts} - {root})
                members = tuple(sorted({root, *receivers}))
                if len(members) > 1 and members not in groups:
                    groups[members] = dist.new_group(list(members))   # every rank calls, same order
                self.gather_bytes += sum(x.numel for *_, x in gather) * isz
                self.bcast_bytes += len(receivers) * unit.numel * isz
                self.messages += len(gather) + len(receivers)
                if me not in members and all(h[0] != me for h in gather):
                    continue    # nothing to do here for this unit
                self.items.append({"unit": unit, "dtype": dtype, "root": root, "root_parts": root_parts,
                                   "gather": gather, "members": members, "group": groups.get(members),
                                   "mine": [(b, p, x) for r, b, p, x in dsts if r == me]})
        self.padding = []
        for b in dst_layout.buffers.get(me, {}).values():
            for box in b.padding():
                self.padding.append((b.name, box))

    def run(self) -> None:
        me = self.rank
        for name, box in self.padding:
            self.dst_t[name][box.slices()].zero_()
        for it in self.items:
            unit = it["unit"]
            in_group = me in it["members"] and it["group"] is not None
            full = torch.empty(unit.sizes, dtype=it["dtype"]) if me == it["root"] or in_group else None
            ops, pending = [], []
            for holder, buf, p, x in it["gather"]:
                if me == holder:
                    t = self.src_t[buf][p.local_of(x).slices()].contiguous()
                    ops.append(dist.P2POp(dist.isend, t, it["root"]))
                    pending.append((None, t))
                elif me == it["root"]:
                    t = torch.empty(x.sizes, dtype=it["dtype"])
                    ops.append(dist.P2POp(dist.irecv, t, holder))
                    pending.append((x, t))
            if me == it["root"]:
                for _, buf, p, x in it["root_parts"]:
                    full[x.relative_to(unit).slices()].copy_(self.src_t[buf][p.local_of(x).slices()].reshape(x.sizes))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
            if me == it["root"]:
                for x, t in pending:
                    full[x.relative_to(unit).slices()].copy_(t.reshape(x.sizes))
            pending.clear()
            if in_group:
                dist.broadcast(full, src=it["root"], group=it["group"])
            for buf, p, x in it["mine"]:
                loc = p.local_of(x)
                self.dst_t[buf][loc.slices()].copy_(full[x.relative_to(unit).slices()].reshape(loc.sizes))
            del full


# ----------------------------------------------------------------------------------- transport floor

class TransportFloor:
    """The plan's per-pair byte matrix moved bare: one flat buffer per (sender, receiver) pair
    (allocated once, outside the timed call), one grouped ``batch_isend_irecv`` (collective).

    Example, a plan with messages 0->2 (3 entries, 8 KiB), 0->2 (next round, 4 KiB), 1->3 (6 KiB):
    rank 0 sends one 12 KiB buffer to 2, rank 1 one 6 KiB buffer to 3; ranks 2 and 3 receive them.
    """

    def __init__(self, plan, group=None):
        self.group = group
        me = dist.get_rank(group)
        pairs: dict[tuple[int, int], int] = {}
        for m in plan.messages:
            if me in (m.src, m.dst):
                pairs[(m.src, m.dst)] = pairs.get((m.src, m.dst), 0) + sum(c.nbytes for c in m.entries)
        self.sends = [(dst, torch.empty(n, dtype=torch.uint8)) for (src, dst), n in sorted(pairs.items()) if src == me]
        self.recvs = [(src, torch.empty(n, dtype=torch.uint8)) for (src, dst), n in sorted(pairs.items()) if dst == me]
        self.sent_bytes = sum(b.numel() for _, b in self.sends)
        self.messages = len(self.sends)

    def run(self) -> None:
        ops = [dist.P2POp(dist.irecv, b, self._global(src)) for src, b in self.recvs]
        ops += [dist.P2POp(dist.isend, b, self._global(dst)) for dst, b in self.sends]
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)


# ----------------------------------------------------------------------------------- the worker

_CPU = [0.0]    # process CPU seconds (every thread: gloo's included) of the last timed call


def _call(fn, can_peak: bool) -> tuple[float, int]:
    """One timed call between barriers: (seconds, resident memory it added at its peak; -1 when the
    peak cannot be reset)."""
    dist.barrier()
    before = rss_bytes()
    reset_peak()
    t = time.perf_counter()
    c = time.process_time()
    fn()
    _CPU[0] = time.process_time() - c
    dist.barrier()
    return time.perf_counter() - t, (max(0, peak_bytes() - before) if can_peak else -1)


def _timed(fn, reps: int) -> dict:
    """Warm-up + ``reps`` timed calls between barriers; transient peak memory per call."""
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    warm = time.perf_counter() - t0
    can_peak = reset_peak()
    runs = [(*_call(fn, can_peak), _CPU[0]) for _ in range(reps)]
    return {"warmup_s": warm, "times": [t for t, _, _ in runs], "cpu": [c for _, _, c in runs],
            "peak_added": max((p for _, p, _ in runs), default=-1)}


def _timed_interleaved(fns: dict, reps: int) -> dict:
    """Like :func:`_timed` for several methods at once, interleaved call by call (the shared
    machine's load drifts; ratios between them are only fair call by call): one warm-up each, then
    ``reps`` rounds, each calling every method once, in order and reversed alternately (A B C, C B
    A, ...).  Returns ``{name: {"warmup_s", "times", "peak_added"}}``."""
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        out[name] = {"warmup_s": time.perf_counter() - t0, "times": [], "peaks": [], "cpu": []}
    can_peak = reset_peak()
    names = list(fns)
    for k in range(reps):
        for name in (names if k % 2 == 0 else names[::-1]):
            t, peak = _call(fns[name], can_peak)
            out[name]["times"].append(t)
            out[name]["peaks"].append(peak)
            out[name]["cpu"].append(_CPU[0])
    for o in out.values():
        o["peak_added"] = max(o.pop("peaks")) if reps else -1
    return out


def live_worker(rank: int, world: int, sizes: list, cases: list, reps: int, budget: int, dtype_name: str,
                methods: list) -> list:
    """One rank of the live benchmark (run through ``mcore_reshard.testing.megatron_cpu.spawn``)."""
    mcore_cpu, worker_mod = import_test_helpers()
    mcore_cpu.install_cpu_shims()
    from megatron.core.resharding.refit import clear_all_caches, swap_model_weights

    from ...refit import MegatronRefit
    dtype = getattr(torch, dtype_name)
    out = []
    from ...util.progress import bar
    work = bar(total=len(sizes) * len(cases), desc="rank 0 cases", unit="case", leave=False) if rank == 0 else None
    for size in sizes:
        d = SIZES[size]
        for case in cases:
            if work is not None:
                work.set_postfix_str(f"{size} {case}")
            src_sizes, dst_sizes = CASES[case]
            t0 = time.perf_counter()
            src = _build(mcore_cpu, d, src_sizes, dtype)
            worker_mod.perturb_replicated(src)
            src_ref = _all_ranks(worker_mod.reference_digests(src))
            dst = _build(mcore_cpu, d, dst_sizes, dtype)
            build_s = time.perf_counter() - t0
            res = {"size": size, "case": case, "rank": rank, "build_s": build_s, "methods": {},
                   "src_params_local": sum(p.numel() for c in src for p in c.parameters()),
                   "dst_params_local": sum(p.numel() for c in dst for p in c.parameters())}
            dist.barrier()
            refit = None
            if {"mcore_reshard", "gather_broadcast", "floor"} & set(methods):
                t = time.perf_counter()
                refit = MegatronRefit(src, dst, budget_bytes=budget)
                res["plan_s"] = time.perf_counter() - t
            floor = TransportFloor(refit.plan) if "floor" in methods else None
            if "mcore_reshard" in methods:
                # interleaved call by call with the floor (and, with MCORE_RESHARD_BENCH_BATCHED=1,
                # the same Resharder with overlap=False: the grouped batched path NCCL uses)
                _zero(dst)
                res_ = refit.resharder
                ab = os.environ.get("MCORE_RESHARD_BENCH_BATCHED") == "1"

                def ours(overlap):
                    res_.overlap = overlap
                    refit.refit()  # noqa: F821 - bound before the `del` at the end of the case

                fns = {"mcore_reshard": lambda: ours(None)}
                if ab:
                    fns["mcore_reshard_batched"] = lambda: ours(False)
                if floor is not None:
                    fns["floor"] = floor.run

                    def floor_local():
                        floor.run()
                        res_.copy_local()     # the floor runs its local copies as a refit does

                    fns["floor_local"] = floor_local
                timed = _timed_interleaved(fns, reps)
                res_.overlap = None
                r = timed["mcore_reshard"]
                _zero(dst)
                refit.refit()       # the default path lands the bytes checked below
                st = refit.plan.stats
                r.update(sent_bytes=int(st["sent_bytes"].get(str(rank), 0)),
                         sent_msgs=sum(1 for m in refit.plan.messages if m.src == rank),
                         rounds=refit.plan.rounds, staging_bytes=refit.resharder.staging_bytes,
                         lower_bound_bytes=st["lower_bound_bytes"], network_bytes=st["network_bytes"],
                         exact=_exactness(worker_mod, dst, src_ref))
                # what this rank copies besides the wire: local copies, staged (packed / unpacked) bytes, operations
                r.update(local_bytes=sum(c.nbytes for _, _, c in res_.local),
                         staged_bytes=sum(s.numel() * s.element_size() for rnd in res_.rounds
                                          for side in (rnd.sends, rnd.recvs) for *_, parts in side
                                          for _, pp in parts for s, _ in pp),
                         gloo_ops=sum(len(parts) for rnd in res_.rounds for side in (rnd.sends, rnd.recvs)
                                      for *_, parts in side))
                res["methods"]["mcore_reshard"] = r
                if ab:
                    b = timed["mcore_reshard_batched"]
                    b.update({k: r[k] for k in ("sent_bytes", "sent_msgs", "rounds", "staging_bytes",
                                                "lower_bound_bytes", "network_bytes")})
                    res_.overlap = False
                    _zero(dst)
                    refit.refit()
                    b["exact"] = _exactness(worker_mod, dst, src_ref)
                    res_.overlap = None
                    res["methods"]["mcore_reshard_batched"] = b
                if floor is not None:
                    for name in ("floor", "floor_local"):
                        f = timed[name]
                        f.update(sent_bytes=floor.sent_bytes, sent_msgs=floor.messages)
                        res["methods"][name] = f
                    floor = None
            if "megatron_resharding" in methods:
                # as shipped: bit-exactness only (SequentialMLP expert names are not remapped)
                clear_all_caches()
                patch_sequential_mlp_names(False)
                _zero(dst)
                try:
                    swap_model_weights(src, dst, "gloo")
                    res["methods"]["megatron_resharding_unpatched"] = {"exact": _exactness(worker_mod, dst, src_ref)}
                except Exception as e:  # noqa: BLE001 - recorded, the benchmark goes on
                    res["methods"]["megatron_resharding_unpatched"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    dist.barrier()
                clear_all_caches()
                patch_sequential_mlp_names(True)
                _zero(dst)
                service = _counting_service()
                r = _timed(lambda: swap_model_weights(src, dst, service), reps)  # noqa: F821 - before the `del` below
                r.update(sent_bytes=service.sent_bytes // (reps + 1), sent_msgs=service.sent_msgs // (reps + 1),
                         exact=_exactness(worker_mod, dst, src_ref))
                res["methods"]["megatron_resharding"] = r
                clear_all_caches()
                patch_sequential_mlp_names(False)
            if floor is not None:       # the floor alone (mcore_reshard not run)
                r = _timed(floor.run, reps)
                r.update(sent_bytes=floor.sent_bytes, sent_msgs=floor.messages)
                res["methods"]["floor"] = r
                del floor
            if "gather_broadcast" in methods:
                gb = GatherBroadcast(refit.src_layout, refit.dst_layout, refit.resharder.src, refit.resharder.dst)
                _zero(dst)
                r = _timed(gb.run, reps)
                if rank == 0:
                    r.update(total_bytes=gb.gather_bytes + gb.bcast_bytes, total_msgs=gb.messages)
                r["exact"] = _exactness(worker_mod, dst, src_ref)
                res["methods"]["gather_broadcast"] = r
                del gb
            del refit, src, dst
            mcore_cpu.destroy_megatron()
            import gc
            gc.collect()
            dist.barrier()
            out.append(res)
            if work is not None:
                work.update(1)
    if work is not None:
        work.close()
    return out


def aggregate(per_rank: list[list[dict]]) -> list[dict]:
    """Per (size, case): per method median/min/max time (slowest rank per call), bytes and
    messages summed over ranks, peak added memory (max over ranks), bit-exactness."""
    rows = []
    for k in range(len(per_rank[0])):
        parts = [r[k] for r in per_rank]
        row = {"size": parts[0]["size"], "case": parts[0]["case"], "build_s": max(p["build_s"] for p in parts),
               "plan_s": max(p.get("plan_s", 0) for p in parts), "methods": {}}
        for m in parts[0]["methods"]:
            ms = [p["methods"][m] for p in parts]
            e = {}
            if "error" in ms[0]:
                e["error"] = ms[0]["error"]
            if "exact" in ms[0]:
                differ = sorted({n for x in ms for n in x["exact"]["differ"]})
                e.update(bit_exact=not differ, tensors=max(x["exact"]["tensors"] for x in ms), differ=len(differ),
                         differ_names=differ[:6])
            if "times" in ms[0]:
                times = [max(x["times"][i] for x in ms) for i in range(len(ms[0]["times"]))]
                e.update(median_s=statistics.median(times), min_s=min(times), max_s=max(times), times=times,
                         warmup_s=max(x["warmup_s"] for x in ms), peak_added_bytes=max(x["peak_added"] for x in ms))
                if "cpu" in ms[0]:   # CPU seconds of all ranks together per call (all their threads)
                    e["cpu_s"] = [sum(x["cpu"][i] for x in ms) for i in range(len(ms[0]["cpu"]))]
            if m.startswith("mcore_reshard"):
                e.update(bytes=ms[0]["network_bytes"], lower_bound=ms[0]["lower_bound_bytes"],
                         messages=sum(x["sent_msgs"] for x in ms), rounds=ms[0]["rounds"],
                         staging_bytes=max(x["staging_bytes"] for x in ms))
                e["peak_added_bytes"] = max(x["peak_added"] + x["staging_bytes"] for x in ms)
                for k in ("local_bytes", "staged_bytes", "gloo_ops"):
                    if k in ms[0]:
                        e[k + "_per_rank"] = [x[k] for x in ms]
                e["transient_peak_bytes"] = max(x["peak_added"] for x in ms)
            elif m in ("megatron_resharding", "floor", "floor_local"):
                e.update(bytes=sum(x["sent_bytes"] for x in ms), messages=sum(x["sent_msgs"] for x in ms))
            elif m == "gather_broadcast":
                e.update(bytes=ms[0]["total_bytes"], messages=ms[0]["total_msgs"])
            row["methods"][m] = e
        rows.append(row)
    return rows


def run_live(sizes: list[str], cases: list[str] | None = None, reps: int = 5, budget: int = 256 << 20,
             dtype: str = "bfloat16", methods: list[str] | None = None, timeout: float = 3600) -> list[dict]:
    """Launch the 4 processes and return the aggregated rows (see :func:`aggregate`)."""
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(128 * 1024))
    mcore_cpu, _ = import_test_helpers()
    cases = list(cases or CASES)
    for s in sizes:
        if s not in SIZES:
            raise ValueError(f"unknown size {s!r}; known: {', '.join(SIZES)}")
    for c in cases:
        if c not in CASES:
            raise ValueError(f"unknown case {c!r}; known: {', '.join(CASES)}")
    per_rank = mcore_cpu.spawn(live_worker, 4, list(sizes), cases, int(reps), int(budget), dtype,
                               list(methods or METHODS), timeout=timeout, gloo_timeout=max(600.0, timeout / 4))
    rows = aggregate(per_rank)
    for row in rows:
        row["params"] = param_count(row["size"])
    return rows


__all__ = ["CASES", "GatherBroadcast", "TransportFloor", "METHODS", "SIZES", "aggregate", "build_dsv3_scaled", "live_worker",
           "param_count", "patch_sequential_mlp_names", "run_live"]
