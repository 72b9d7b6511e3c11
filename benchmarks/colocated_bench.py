"""Colocated refits side by side: the library's colocated path vs the same layouts over a process
group vs what RL frameworks do on one device vs a memcpy floor, in one run (CPU, gloo; shared memory
stands in for CUDA IPC).

    python benchmarks/colocated_bench.py [--size 139M] [--case tp2] [--reps 11] [--bucket-mib 64] [--out FILE]
    python benchmarks/colocated_bench.py --table FILE...      (the BENCHMARKS.md table of saved results)

Processes: trainer ranks ``0..T-1`` and engine workers ``0..E-1`` (``T >= E``), worker ``j`` on the
device of trainer rank ``j`` (device keys ``cpu:j``; trainer ranks ``E..T-1`` have no worker on their
device: group members of every variant that has a group), launched with no process group
(``launch(..., world=False)``).  Every process holds its layout part as plain tensors (trainer:
Megatron-Core's layout of the case, engine: vLLM's), values a function of (tensor, element,
version).  Variants, each built once, warmed up once, then timed interleaved (rotating order),
``reps`` refits each, the trainer writing a new version before every round:

``colocated``  :class:`~mcore_reshard.colocate.ColocatedTrainer` on the trainer, ``accept_trainer``
               + ``Resharder`` (watched by the peer) on the worker; the group: the workers and the
               unpaired trainer ranks (:class:`~mcore_reshard.core.devices.DeviceMap`), bytes over
               it only for what crosses devices, the rest copied out of the mapped trainer storages.
``disagg``     (a) the same layouts, every process in one gloo group, no mapping: every byte an
               engine needs crosses the group.
``gather``     (b) verl / NeMo RL / vLLM ``ipc``: every paired trainer rank gathers each sharded
               tensor whole over the trainers' group (each box it lacks once, as point-to-point
               sends: the all-gather of its TP / EP group), packs them into a shared-memory bucket of
               ``bucket-mib`` (exported once), hand it to the colocated worker (one message per
               bucket, wait for "done"), which copies its shard out of each full tensor (load_weights);
               ``work_s``: the trainer's gathering / the worker's loading within a refit.
``assemble``   (b') the trainers reshard among themselves into a shared-memory copy of their
               colocated worker's shard (the library's ``Resharder``, engine layout on trainer ranks),
               hand it over; the worker copies it whole into its weights.
``floor``      (c) the worker copies its shard's bytes once from a private flat buffer.

Reported per variant: time (median over reps of the slowest process, as a ratio to the floor and to
``colocated``), memory per process from ``/proc/self/status`` (outside the library): *held* --
RssAnon and RssShmem after the variant was built and warmed up minus before (per device: the
trainer's both plus its worker's RssAnon, since a worker's shared pages are its trainer's memory,
``device_held_bytes``) -- and *peak*
-- VmHWM growth within a timed refit (max over reps); bytes over a group (sent, summed over
processes), bytes handed over / mapped.  Every refit's destination is checked against values
computed independently of the library (``ok``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("colocated", "disagg", "gather", "assemble", "floor")
SIZES = {   # DeepSeek-V3 widths scaled down: MLA, first layer dense, routed + shared experts
    "tiny": dict(hidden_size=128, num_hidden_layers=3, vocab_size=512, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=256, n_routed_experts=4, moe_intermediate_size=64, q_lora_rank=64,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
    "139M": dict(hidden_size=1024, num_hidden_layers=4, vocab_size=16384, num_attention_heads=16,
                 num_key_value_heads=16, intermediate_size=4096, n_routed_experts=16, moe_intermediate_size=512,
                 q_lora_rank=512, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
}
CASES = {"tp2": ("tp=2", "vllm:tp=2"),             # trainer layout -> engine layout (layout strings)
         "ep2": ("tp=1,ep=2", "vllm:tp=2"),        # experts by expert on the trainer, by row on the engine
         "tp2ep2": ("tp=2,ep=2", "vllm:tp=2")}     # 4 trainer ranks, 2 of them with a worker on their device
TIMEOUT = 300.0


# ----------------------------------------------------------------------------------- layouts and values

def model_config(size: str):
    from mcore_reshard.targets import dsv3_671b
    return dsv3_671b().with_(first_k_dense_replace=1, num_nextn_predict_layers=0, **SIZES[size])


def layouts(size: str, case: str):
    """(trainer layout on ranks 0..T-1, engine layout on ranks 0..E-1), bfloat16."""
    from mcore_reshard.tools.layout_strings import build, parse
    cfg = model_config(size)
    s, d = CASES[case]
    return build(parse(s), cfg, 0, "bfloat16"), build(parse(d), cfg, 0, "bfloat16")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def base_values(layout, rank: int) -> dict:
    """Buffer name -> its values at version 0: element ``i`` of tensor ``t`` is ``(7 i + salt(t)) % 201 - 100``
    (exact in bf16; version ``v`` adds ``v``); regions of no piece hold 0 (``mask`` False there)."""
    out = {}
    for name, b in layout.buffers.get(rank, {}).items():
        t = torch.zeros(b.shape, dtype=torch.float32)
        mask = torch.zeros(b.shape, dtype=torch.bool)
        for p in b.pieces:
            shape = layout.tensors[p.tensor].shape
            salt = sum(p.tensor.encode()) % 97
            strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
            idx = torch.zeros((), dtype=torch.int64)
            for d, (o, n) in enumerate(zip(p.box.offsets, p.box.sizes)):
                ax = torch.arange(o, o + n, dtype=torch.int64) * strides[d]
                idx = idx.unsqueeze(-1) + ax
            vals = ((idx * 7 + salt) % 201 - 100).to(torch.float32)
            t[p.local.slices()] = vals.reshape(p.local.sizes)
            mask[p.local.slices()] = True
        out[name] = (t.to(_dtype(b.dtype)), None if bool(mask.all()) else mask)
    return out


def write_version(tensors: dict, base: dict, v: int) -> None:
    for name, t in tensors.items():
        t.copy_(base[name][0])
        t.add_(v)


def check_version(tensors: dict, base: dict, v: int) -> bool:
    for name, t in tensors.items():
        b, mask = base[name]
        want = b + v if mask is None else torch.where(mask, b + v, b)
        if not torch.equal(t, want):
            return False
    return True


def nbytes(layout, rank: int) -> int:
    from mcore_reshard.core.layout import itemsize
    return sum(math.prod(b.shape) * itemsize(b.dtype) for b in layout.buffers.get(rank, {}).values())


# ----------------------------------------------------------------------------------- memory (outside the library)

def mem() -> dict:
    from mcore_reshard.util.memstat import status_kb
    return {"anon": status_kb("RssAnon") * 1024, "shmem": status_kb("RssShmem") * 1024}


def held_since(before: dict) -> dict:
    now = mem()
    return {k: now[k] - before[k] for k in now}


# ----------------------------------------------------------------------------------- variants

class Ctx:
    """What every variant of one process sees: its role, groups, tensors and the launch directory."""

    def __init__(self, rank: int, T: int, E: int, size: str, case: str, bucket: int):
        self.T, self.E, self.bucket = T, E, bucket
        self.trainer = rank < T
        self.i = rank if self.trainer else rank - T          # trainer rank / engine worker index
        self.dir = os.environ["MCORE_RESHARD_LAUNCH_DIR"]
        self.src, self.dst = layouts(size, case)
        self.base = base_values(self.src if self.trainer else self.dst, self.i)
        self.tensors = {n: b.clone() for n, (b, _) in self.base.items()}
        self.device = f"cpu:{self.i}"
        self.paired = not self.trainer or self.i < E       # trainer ranks E..T-1: no worker on their device

    def sock(self, what: str) -> str:
        return f"{self.dir}/{what}-{self.i}.sock"


class Variant:
    """One way to refit: ``call(v)`` runs one refit of version ``v`` on this process; ``bytes_group``
    / ``bytes_handed`` count what crossed a process group / a same-device hand-off in it."""
    name = ""

    def call(self, v: int) -> None:
        raise NotImplementedError

    def counts(self) -> dict:
        return {}


class Floor(Variant):
    name = "floor"

    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        if ctx.trainer:
            return
        total = sum(t.numel() * t.element_size() for t in ctx.tensors.values())
        self.flat = torch.empty(total, dtype=torch.uint8)
        self.views, off = [], 0
        for name, t in ctx.tensors.items():
            n = t.numel() * t.element_size()
            self.views.append((t, self.flat[off:off + n].view(t.dtype).view(t.shape)))
            off += n

    def set_version(self, v: int) -> None:
        if not self.ctx.trainer:
            for (t, src), (b, _) in zip(self.views, self.ctx.base.values()):
                src.copy_(b)
                src.add_(v)     # padding regions: expected is base there (zeros); none in these layouts

    def call(self, v: int) -> None:
        if not self.ctx.trainer:
            for t, src in self.views:
                t.copy_(src)


class Disagg(Variant):
    """(a): trainers on group ranks 0..T-1, workers on T..T+E-1, one gloo group of every process."""
    name = "disagg"

    def __init__(self, ctx: Ctx, group):
        from mcore_reshard.core.executor import Resharder
        from mcore_reshard.core.planner import make_plan
        self.plan = make_plan(ctx.src, ctx.dst.offset_ranks(ctx.T))
        src = ctx.tensors if ctx.trainer else {}
        dst = {} if ctx.trainer else ctx.tensors
        self.r = Resharder(self.plan, src, dst, group, timeout=TIMEOUT)
        self.sent = 0

    def call(self, v: int) -> None:
        res = self.r.refit(v)
        self.sent = res["staged_bytes_sent"] + res["unstaged_bytes_sent"]

    def counts(self) -> dict:
        return {"bytes_group": self.sent}


class Colocated(Variant):
    """The library's colocated path: the worker proxies its device's trainer rank."""
    name = "colocated"

    def __init__(self, ctx: Ctx, join):
        from mcore_reshard.colocate import ColocatedTrainer, accept_trainer
        from mcore_reshard.core.devices import DeviceMap
        from mcore_reshard.core.executor import Resharder
        from mcore_reshard.core.layout import Layout
        from mcore_reshard.core.planner import make_plan
        from mcore_reshard.integrations.protocol import rank_part
        self.ctx, self.sent, self.peer = ctx, 0, None
        dmap = DeviceMap([f"cpu:{i}" for i in range(ctx.T)], [f"cpu:{j}" for j in range(ctx.E)])
        self.t = None
        if ctx.trainer and ctx.paired:              # proxied by its worker: talks to it only
            self.t = ColocatedTrainer(rank_part(ctx.src, ctx.i), ctx.tensors, channel=ctx.sock("col"),
                                      device=ctx.device, rank=ctx.i, timeout=TIMEOUT)
            return
        grank = dmap.trainer_group_rank(ctx.i) if ctx.trainer else dmap.engine_group_rank(ctx.i)
        group = join("colocated", dmap.group_size, grank)
        if not ctx.trainer:
            self.peer = accept_trainer(ctx.sock("col"), device=ctx.device, rank=grank, timeout=TIMEOUT)
        on = {r: dmap.engine_group_rank(dmap.proxies[r]) if r in dmap.proxies else dmap.trainer_group_rank(r)
              for r in ctx.src.buffers}             # the trainer's layout on group ranks
        relabeled = Layout(dict(ctx.src.tensors), {on[r]: dict(b) for r, b in ctx.src.buffers.items()})
        self.plan = make_plan(relabeled, ctx.dst.offset_ranks(dmap.rank_offset))
        src, dst = (ctx.tensors, {}) if ctx.trainer else (self.peer.tensors, ctx.tensors)
        self.r = Resharder(self.plan, src, dst, group, timeout=TIMEOUT)
        if self.peer is not None:
            self.r.watch("src", self.peer.check)
        self.local = sum(c.nbytes for c in self.plan.local_copies if c.dst == grank)

    def call(self, v: int) -> None:
        if self.t is not None:
            self.t.refit(v)
            return
        res = self.peer.run(lambda: self.r.refit(v)) if self.peer is not None else self.r.refit(v)
        self.sent = res["staged_bytes_sent"] + res["unstaged_bytes_sent"]

    def counts(self) -> dict:
        if self.peer is None:
            return {"bytes_group": 0 if self.t is not None else self.sent}
        return {"bytes_group": self.sent, "bytes_mapped": self.peer.mapped_bytes, "bytes_local": self.local}


def _pair(ctx: Ctx, what: str, tensors: dict | None):
    """A same-device hand-off channel of a baseline: the trainer exports ``tensors`` once, the worker
    maps them.  Returns (channel, mapped tensors or None)."""
    from mcore_reshard.core.executor.local_channel import Listener, connect
    from mcore_reshard.core.executor.shared_storage import MappedStorages, export_tensors
    if ctx.trainer:
        ch = connect(ctx.sock(what), TIMEOUT, f"worker {ctx.i}")
        exp = export_tensors(tensors)
        ch.send({"export": exp.to_json()}, exp.fds)
        return ch, None
    lis = Listener(ctx.sock(what))
    try:
        ch = lis.accept(TIMEOUT, f"trainer {ctx.i}")
    finally:
        lis.close()
    msg, fds = ch.recv(TIMEOUT)
    return ch, MappedStorages(msg["export"], fds).tensors


def _routes(src, name: str, E: int) -> tuple[dict, list]:
    """How (b) gathers tensor ``name`` for trainer ranks ``0..E-1`` (those with a worker): (rank ->
    its [(buffer, piece)], [(holder, receiver, [(buffer, piece)])]), the same on every rank; each box a
    receiver lacks comes from one holder, the least loaded (DP replicas share the sending)."""
    own: dict = {}
    holders: dict = {}
    for r, bufs in sorted(src.buffers.items()):
        for b in bufs.values():
            for p in b.pieces:
                if p.tensor == name:
                    own.setdefault(r, []).append((b.name, p))
                    holders.setdefault(p.box, []).append((r, b.name, p))
    load: dict = {}
    pairs: dict = {}
    for d in range(E):
        mine = {p.box for _, p in own.get(d, [])}
        for box, hs in holders.items():
            if box in mine:
                continue
            r, b, p = min(hs, key=lambda h: (load.get(h[0], 0), h[0]))
            load[r] = load.get(r, 0) + box.numel
            pairs.setdefault((r, d), []).append((b, p))
    return own, [(r, d, ps) for (r, d), ps in sorted(pairs.items())]


class Gather(Variant):
    """(b): full tensors all-gathered over the trainers' group, bucketed through shared memory."""
    name = "gather"

    def __init__(self, ctx: Ctx, join):
        self.ctx, self.sent, self.handed = ctx, 0, 0
        src, dst = ctx.src, ctx.dst
        names = sorted(dst.tensors)
        sizes = {n: math.prod(src.tensors[n].shape) * _dtype(src.tensors[n].dtype).itemsize for n in names}
        self.bucket_bytes = max(ctx.bucket, max(sizes.values()))
        self.buckets, cur, used = [], [], 0        # [(name, byte offset)], the same on every process
        for n in names:
            if used + sizes[n] > self.bucket_bytes:
                self.buckets.append(cur)
                cur, used = [], 0
            cur.append((n, used))
            used += sizes[n]
        self.buckets.append(cur)
        if ctx.trainer:
            self.group = join("trainers_b", ctx.T, ctx.i)
            self.bucket = torch.empty(self.bucket_bytes, dtype=torch.uint8)
            self.ch = _pair(ctx, "gather", {"bucket": self.bucket})[0] if ctx.paired else None
            self.routes = {n: _routes(src, n, ctx.E) for n in names}
        else:
            self.ch, mapped = _pair(ctx, "gather", None)
            self.bucket = mapped["bucket"]
            self.load = {n: [] for n in names}
            for b in dst.buffers.get(ctx.i, {}).values():
                for p in b.pieces:
                    self.load[p.tensor].append((ctx.tensors[b.name], p))

    def _full(self, name: str, off: int) -> torch.Tensor:
        meta = self.ctx.src.tensors[name]
        dt = _dtype(meta.dtype)
        n = math.prod(meta.shape) * dt.itemsize
        return self.bucket[off:off + n].view(dt).view(meta.shape)

    def _gather_into(self, name: str, full: torch.Tensor | None) -> None:
        """Every paired trainer rank gets the whole tensor into ``full``: its own pieces copied, every
        other box received from one holder (the all-gather of its TP / EP group, each box once)."""
        import torch.distributed as dist
        me, (own, moves) = self.ctx.i, self.routes[name]
        tensors = self.ctx.tensors
        if full is not None:
            for buf, p in own.get(me, []):
                full[p.box.slices()].copy_(tensors[buf][p.local.slices()].reshape(p.box.sizes))
        ops, recvs = [], []
        for src, dst, pieces in moves:
            if me not in (src, dst):
                continue
            n = sum(p.box.numel for _, p in pieces)
            dt = _dtype(self.ctx.src.tensors[name].dtype)
            if src == me:
                packed = torch.cat([tensors[b][p.local.slices()].reshape(-1) for b, p in pieces])
                ops.append(dist.P2POp(dist.isend, packed, group=self.group, group_peer=dst))
                self.sent += n * dt.itemsize
            else:
                buf = torch.empty(n, dtype=dt)
                ops.append(dist.P2POp(dist.irecv, buf, group=self.group, group_peer=src))
                recvs.append((buf, pieces))
        if ops:                         # as sends: gloo's all_gather is 4-10x slower than its sends here
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for buf, pieces in recvs:
            off = 0
            for _, p in pieces:
                full[p.box.slices()].copy_(buf[off:off + p.box.numel].view(p.box.sizes))
                off += p.box.numel

    def call(self, v: int) -> None:
        self.sent = self.handed = 0
        self.work = 0.0                 # trainer: gathering into the bucket; engine: loading out of it
        for k, bucket in enumerate(self.buckets):
            if self.ctx.trainer:
                t0 = time.perf_counter()
                for name, off in bucket:
                    self._gather_into(name, self._full(name, off) if self.ctx.paired else None)
                self.work += time.perf_counter() - t0
                if self.ch is None:             # no worker on this device: it gathers for the others
                    continue
                self.ch.send({"bucket": k})
                msg, _ = self.ch.recv(TIMEOUT)
                assert msg == {"done": k}, msg
            else:
                msg, _ = self.ch.recv(TIMEOUT)
                assert msg == {"bucket": k}, msg
                t0 = time.perf_counter()
                for name, off in bucket:
                    full = self._full(name, off)
                    self.handed += full.numel() * full.element_size()
                    for t, p in self.load[name]:
                        t[p.local.slices()].copy_(full[p.box.slices()].reshape(p.local.sizes))
                self.work += time.perf_counter() - t0
                self.ch.send({"done": k})

    def counts(self) -> dict:
        return {"bytes_group": self.sent, "bytes_handed": self.handed, "work_s": self.work,
                "bucket_bytes": self.bucket_bytes if not self.ctx.trainer else 0}


class Assemble(Variant):
    """(b'): the trainers reshard into a shared-memory copy of their worker's shard, handed over whole."""
    name = "assemble"

    def __init__(self, ctx: Ctx, join):
        self.ctx, self.sent = ctx, 0
        if ctx.trainer:
            from mcore_reshard.core.executor import Resharder
            from mcore_reshard.core.planner import make_plan
            group = join("trainers_bp", ctx.T, ctx.i)
            self.shard = {n: torch.zeros(b.shape, dtype=_dtype(b.dtype))
                          for n, b in ctx.dst.buffers.get(ctx.i, {}).items()}
            self.ch = _pair(ctx, "assemble", self.shard)[0] if ctx.paired else None
            self.r = Resharder(make_plan(ctx.src, ctx.dst), ctx.tensors, self.shard, group, timeout=TIMEOUT)
        else:
            self.ch, self.shard = _pair(ctx, "assemble", None)

    def call(self, v: int) -> None:
        if self.ctx.trainer:
            res = self.r.refit(v)
            self.sent = res["staged_bytes_sent"] + res["unstaged_bytes_sent"]
            if self.ch is None:
                return
            self.ch.send({"ready": v})
            msg, _ = self.ch.recv(TIMEOUT)
            assert msg == {"done": v}, msg
            return
        msg, _ = self.ch.recv(TIMEOUT)
        assert msg == {"ready": v}, msg
        for n, t in self.ctx.tensors.items():
            t.copy_(self.shard[n])
        self.ch.send({"done": v})

    def counts(self) -> dict:
        if self.ctx.trainer:
            return {"bytes_group": self.sent}
        return {"bytes_handed": sum(t.numel() * t.element_size() for t in self.shard.values())}


# ----------------------------------------------------------------------------------- one process

def _build(name: str, ctx: Ctx, world, join) -> Variant:
    if name == "floor":
        return Floor(ctx)
    if name == "disagg":
        return Disagg(ctx, world)
    return {"colocated": Colocated, "gather": Gather, "assemble": Assemble}[name](ctx, join)


def _timed(ctx: Ctx, var: Variant, v: int, world) -> dict:
    import torch.distributed as dist

    from mcore_reshard.util.memstat import peak_bytes, reset_peak, rss_bytes
    if not ctx.trainer:
        for t in ctx.tensors.values():
            t.zero_()
    dist.barrier(group=world)
    reset_peak()
    r0 = rss_bytes()
    t0 = time.perf_counter()
    var.call(v)
    dt = time.perf_counter() - t0
    peak = peak_bytes() - r0
    ok = None if ctx.trainer else check_version(ctx.tensors, ctx.base, v)
    return {"s": dt, "peak": peak, "ok": ok, **var.counts()}


def process(rank: int, nproc: int, T: int, size: str, case: str, reps: int, bucket: int, variants: list) -> dict:
    """Process ``rank`` of a run: trainer rank ``rank`` (< T) or engine worker ``rank - T``."""
    import torch.distributed as dist

    from mcore_reshard.integrations.protocol import join_group
    ctx = Ctx(rank, T, nproc - T, size, case, bucket)

    def join(name, n, r):
        return join_group(f"file://{ctx.dir}/{name}", n, r, backend="gloo", timeout_s=TIMEOUT)
    world = join("all", nproc, rank)            # the harness's barriers, and (a)'s group
    out = {"role": "trainer" if ctx.trainer else "engine", "index": ctx.i, "held": {}, "warmup": {},
           "calls": {n: [] for n in variants}, "need": None if ctx.trainer else nbytes(ctx.dst, ctx.i)}
    built, v = {}, 0
    for name in variants:                       # built and warmed up one at a time: held memory per variant
        dist.barrier(group=world)
        before = mem()
        built[name] = _build(name, ctx, world, join)
        v += 1
        if ctx.trainer:
            write_version(ctx.tensors, ctx.base, v)
        if name == "floor":
            built[name].set_version(v)
        out["warmup"][name] = _timed(ctx, built[name], v, world)
        out["held"][name] = held_since(before)
    for k in range(reps):
        v += 1
        if ctx.trainer:
            write_version(ctx.tensors, ctx.base, v)
        if "floor" in built:
            built["floor"].set_version(v)
        for name in variants[k % len(variants):] + variants[:k % len(variants)]:
            out["calls"][name].append(_timed(ctx, built[name], v, world))
    dist.barrier(group=world)
    return out


# ----------------------------------------------------------------------------------- the run and its report

def run(size: str = "139M", case: str = "tp2", reps: int = 11, bucket_mib: float = 64.0,
        variants=VARIANTS, timeout: float = 1800.0) -> dict:
    from mcore_reshard.tools.launch import launch
    src, dst = layouts(size, case)
    T, E = len(src.ranks), len(dst.ranks)
    if T < E:
        raise ValueError(f"case {case}: {T} trainer ranks, {E} engine workers: every worker is colocated with a "
                         f"trainer rank (trainer ranks 0..{E - 1})")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")   # freed memory leaves the resident set at once
    res = launch(process, T + E, T, size, case, reps, int(bucket_mib * (1 << 20)), list(variants),
                 timeout=timeout, threads=1, world=False)
    bad = {r: o.error or f"exit code {o.exitcode}" for r, o in res.items() if not o.ok}
    if bad:
        raise RuntimeError("benchmark processes failed: " + "; ".join(f"{r}: {e}" for r, e in sorted(bad.items())))
    procs = [res[r].result for r in sorted(res)]
    weights = sum(math.prod(m.shape) * _dtype(m.dtype).itemsize for m in src.tensors.values())
    return summarize(procs, {"size": size, "case": case, "layouts": CASES[case], "reps": reps,
                             "bucket_mib": bucket_mib, "weights_bytes": weights, "trainer_ranks": T,
                             "engine_workers": E}, list(variants))


def summarize(procs: list, meta: dict, variants: list) -> dict:
    """Per variant: time (median over reps of the slowest process), memory per role, bytes, checks."""
    out = {**meta, "variants": {}, "processes": procs}
    engines = [p for p in procs if p["role"] == "engine"]
    out["engine_need_bytes"] = sum(p["need"] for p in engines)
    for name in variants:
        reps = len(procs[0]["calls"][name])
        slowest = [max(p["calls"][name][k]["s"] for p in procs) for k in range(reps)]
        last = [p["calls"][name][-1] if reps else p["warmup"][name] for p in procs]
        row = {"median_s": statistics.median(slowest) if slowest else None, "times_s": slowest,
               "min_s": min(slowest, default=None),
               "ok": all(c["ok"] for p in engines for c in p["calls"][name] + [p["warmup"][name]]),
               "bytes_group": sum(c.get("bytes_group", 0) for c in last),
               "bytes_handed": sum(c.get("bytes_handed", 0) for c in last),
               "bytes_mapped": sum(c.get("bytes_mapped", 0) for c in last),
               "bytes_local": sum(c.get("bytes_local", 0) for c in last)}
        for role in ("trainer", "engine"):
            ps = [p for p in procs if p["role"] == role]
            row[f"{role}_peak_bytes"] = max(c["peak"] for p in ps for c in p["calls"][name] or [p["warmup"][name]])
            row[f"{role}_held_anon_bytes"] = max(p["held"][name]["anon"] for p in ps)
            row[f"{role}_held_shmem_bytes"] = max(p["held"][name]["shmem"] for p in ps)
        # a worker's shared pages are its trainer's (mapped weights, the bucket, the shard copy): count them once
        row["device_held_bytes"] = max(
            t["held"][name]["anon"] + t["held"][name]["shmem"] + e["held"][name]["anon"]
            for t, e in zip([p for p in procs if p["role"] == "trainer"], engines))
        out["variants"][name] = row
    base = out["variants"].get("floor", {}).get("median_s")
    col = out["variants"].get("colocated", {}).get("median_s")
    lo = out["variants"].get("floor", {}).get("min_s")
    for row in out["variants"].values():
        row["over_floor"] = row["median_s"] / base if base and row["median_s"] else None
        row["over_colocated"] = row["median_s"] / col if col and row["median_s"] else None
        row["min_over_floor"] = row["min_s"] / lo if lo and row["min_s"] else None
    return out


def table(results: list) -> str:
    """The BENCHMARKS.md table of saved results (one row per case and variant)."""
    mb = 1e6
    rows = ["| case | variant | time / floor (fastest / fastest) | time / colocated | bytes over a group MB | bytes handed over / mapped "
            "MB | held per device MB | peak per process MB (trainer, engine) | bit-exact |", "|---" * 9 + "|"]
    for res in results:
        case = f"{res['size']} {res['layouts'][0]} -> {res['layouts'][1]}"
        for name in sorted(res["variants"], key=lambda n: VARIANTS.index(n)):
            r = res["variants"][name]
            hand = (f"{r['bytes_mapped'] / mb:,.1f} mapped ({r['bytes_local'] / mb:,.1f} read)" if r["bytes_mapped"]
                    else f"{r['bytes_handed'] / mb:,.1f}")
            held = "—" if name == "floor" else f"{r['device_held_bytes'] / mb:,.1f}"   # the floor's source: a stand-in
            rows.append(f"| {case} | {name} | {r['over_floor']:.2f} ({r['min_over_floor']:.2f}) | {r['over_colocated']:.2f} | "
                        f"{r['bytes_group'] / mb:,.1f} | {hand} | {held} | {r['trainer_peak_bytes'] / mb:,.1f}, "
                        f"{r['engine_peak_bytes'] / mb:,.1f} | {r['ok']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--table"]:
        print(table([json.loads(Path(p).read_text()) for p in sys.argv[2:]]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="139M", choices=sorted(SIZES))
    ap.add_argument("--case", default="tp2", choices=sorted(CASES))
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--bucket-mib", type=float, default=64.0, help="(b)'s shared-memory bucket")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    a = ap.parse_args(argv)
    res = run(a.size, a.case, a.reps, a.bucket_mib, a.variants.split(","))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "processes"}, indent=1, sort_keys=True))
    print(table([res]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
