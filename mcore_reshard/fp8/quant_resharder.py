"""Executor of an FP8 plan (:mod:`mcore_reshard.fp8.quant_plan`): BF16 source shards in, block-FP8
weights and fp32 ``weight_scale_inv`` written into the target's existing tensors.

``Fp8Resharder(plan, src, dst, group)`` is collective (like :class:`~mcore_reshard.core.executor.Resharder`,
which it drives: one for the unquantized tensors, and per group one for the assembly of cut blocks
and one for the quantized results).  ``refit()`` runs, group after group::

    stage A   cut blocks -> owner (Resharder, BF16)         | rank 1 gets rows 16:20 from rank 0
    quantize  every owned region on its owner, fp32 math     | rank 0: blocks 0:16, rank 1: 16:40
    stage B   FP8 bytes + scales -> target shards (Resharder)| rank 2 gets 1280 + 24 B

Quantization of one block ``x`` (the DeepSeek-V3 checkpoint recipe)::

    amax = |x|.max()                   (fp32)
    scale_inv = amax / 448             (1.0 when amax == 0: an all-zero block stores zeros, scale 1)
    w = (x.float() / scale_inv).clamp(-448, 448).to(float8_e4m3fn)   (round to nearest even)

Temporaries (assembled blocks, FP8 results, scales) live in one uint8 arena per rank, sized for
the largest group (<= the plan's memory budget) and reused by every group; all sub-Resharders
share one staging buffer.  A target buffer too large for one group (vLLM ``w13_weight``: every
local expert of a layer) is written by several groups, each through a contiguous dim-0 view.
gloo has no float8 dtype: the staging buffer is uint8 and FP8 entries are byte views of them.
"""
from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Mapping

import torch

from ..core.executor import Resharder, ReshardError, TransferError, agree, kind_problem, staging_size, torch_dtype
from .quant_layout import DEFAULT_BLOCK, FP8_MAX
from .quant_plan import Fp8Plan

_CHUNK_ELEMS = 1 << 22      # fp32 elements of one quantization temporary (16 MiB)


def quantize_into(x: torch.Tensor, block: tuple[int, int], q: torch.Tensor, s: torch.Tensor,
                  chunk_elems: int = _CHUNK_ELEMS) -> None:
    """Quantize ``x [..., r, c]`` per ``block`` of its last two dims into ``q`` (float8_e4m3fn,
    same shape) and ``s`` (fp32 ``[..., ceil(r/B0), ceil(c/B1)]``), vectorized over whole blocks;
    a ragged last block row / column is padded with zeros (which never change a block's amax)."""
    B0, B1 = block
    r, c = x.shape[-2:]
    nr, nc = -(-r // B0), -(-c // B1)
    step = max(1, chunk_elems // (B0 * nc * B1))
    with torch.no_grad():
        for idx in itertools.product(*(range(n) for n in x.shape[:-2])):
            xs, qs, ss = x[idx], q[idx], s[idx]
            for b0 in range(0, nr, step):
                b1 = min(nr, b0 + step)
                rows = min(b1 * B0, r) - b0 * B0
                pad = torch.zeros((b1 - b0) * B0, nc * B1, dtype=torch.float32, device=x.device)
                pad[:rows, :c] = xs[b0 * B0:b0 * B0 + rows]
                blocks = pad.view(b1 - b0, B0, nc, B1)
                amax = blocks.abs().amax(dim=(1, 3))
                scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
                w = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
                qs[b0 * B0:b0 * B0 + rows].copy_(w.view(-1, nc * B1)[:rows, :c].to(torch.float8_e4m3fn))
                ss[b0:b1].copy_(scale)


@dataclass(frozen=True)
class Fp8:
    """``MegatronRefit(..., target=(fp8_layout, tensors), quantize=Fp8(block=(128, 128)))``:
    quantize in transit.  ``memory_bytes``: per-rank bound on the FP8 temporaries (the arena;
    default: the staging budget)."""
    block: tuple[int, int] = DEFAULT_BLOCK
    memory_bytes: int | None = None


def _kind_errors(rank: int, src: Mapping, dst: Mapping) -> list[str]:
    """Tensors of a kind no refit moves in place (sparse, nested, a wrapper subclass...: ``kind_problem``)."""
    return [f"rank {rank}: {what} tensor {n} is {why}" for what, tensors in (("src", src), ("dst", dst))
            for n, t in tensors.items() if (why := kind_problem(t)) is not None]


def _stale_sources(rank: int, quantized: Mapping[str, tuple]) -> list[str]:
    """Source tensors the quantization reads (``quantized``: name -> (owner, bound storage)) whose
    owner moved to other storage since bind (``param.data = new``): the quantization jobs hold views
    of the bound storage, so such a refit is refused (bind again)."""
    return [f"rank {rank}: src tensor {n}: param.data was rebound after binding; the FP8 refit quantizes views of "
            "the storage bound and cannot follow it: bind again" for n, (owner, ptr) in quantized.items()
            if owner.data_ptr() != ptr]


def _pick(tensors: Mapping[str, torch.Tensor], plan, side: str, rank: int) -> dict:
    return {n: tensors[n] for n in plan.buffers[side].get(rank, {}) if n in tensors}


def _mismatches(tensors: Mapping[str, torch.Tensor], specs: Mapping, side: str, rank: int) -> list[str]:
    """This rank's given tensors whose shape or dtype is not the plan's buffer (``specs``: name -> (shape, dtype))."""
    from ..core.executor import dtype_name
    out = []
    for name, (shape, dtype) in specs.items():
        t = tensors.get(name)
        if t is not None and (tuple(t.shape) != tuple(shape) or dtype_name(t.dtype) != dtype):
            out.append(f"rank {rank}: {side} tensor {name} is {list(t.shape)} {dtype_name(t.dtype)}, the FP8 plan's "
                       f"buffer is {list(shape)} {dtype}")
    return sorted(set(out))


class Fp8Resharder:
    """Binds an :class:`~mcore_reshard.fp8.quant_plan.Fp8Plan` to this rank's tensors (collective).

    ``src``: this rank's source buffers (BF16 or fp32); ``dst``: its target buffers of the FP8
    layout (``float8_e4m3fn`` weights, fp32 ``*_scale_inv``, and the unquantized ones).  Options
    are :class:`~mcore_reshard.core.executor.Resharder`'s.  ``last_stats`` after a refit: seconds and
    elements this rank quantized."""

    def __init__(self, plan: Fp8Plan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                 group=None, *, timeout: float | None = None, verify: bool = False):
        import torch.distributed as dist
        if not isinstance(plan, Fp8Plan):
            raise TypeError(f"plan: expected an Fp8Plan (make_fp8_plan), not {type(plan).__name__}")
        for what, tensors in (("src", src), ("dst", dst)):
            if not isinstance(tensors, Mapping) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
                raise TypeError(f"{what}: expected a mapping of buffer name -> tensor, not {type(tensors).__name__}")
        self.plan = plan
        self.rank = rank = dist.get_rank(group)
        self.version = 0
        self.last_stats: dict = {}
        self._interrupted: dict | None = None
        errors = _kind_errors(rank, src, dst)
        if errors:      # refused first, before anything below reads such a tensor
            agree(group, plan.hash, errors, timeout=timeout)
        want_dst = set(plan.rest.buffers["dst"].get(rank, {}))
        for g in plan.groups:
            views = g.views.get(rank, {})
            want_dst |= {views[n][0] if n in views else n for n in g.stage_b.buffers["dst"].get(rank, {})}
        # a source tensor the plan never reads is left alone (a model's MTP weights when MTP is not refit)
        extra = sorted(set(dst) - want_dst)
        if extra:
            errors.append(f"rank {rank}: {len(extra)} dst tensor(s) the FP8 plan never writes: {', '.join(extra[:8])}")
        for g in plan.groups:
            for reg in g.regions:
                if reg.owner == rank and reg.kind == "shard" and reg.input not in src:
                    errors.append(f"rank {rank}: source tensor {reg.input} (to quantize {reg.tensor}{reg.box}) is missing")
                    break
        errors += _mismatches(src, plan.rest.buffers["src"].get(rank, {}), "src", rank)
        errors += _mismatches(dst, plan.rest.buffers["dst"].get(rank, {}), "dst", rank)
        for g in plan.groups:
            if g.assembly is not None:
                errors += _mismatches(src, g.assembly.buffers["src"].get(rank, {}), "src", rank)
            views = g.views.get(rank, {})
            errors += _mismatches(dst, {n: v for n, v in g.stage_b.buffers["dst"].get(rank, {}).items()
                                        if n not in views}, "dst", rank)
        agree(group, plan.hash, errors, timeout=timeout)
        tensors = list(dst.values()) + list(src.values())
        device = tensors[0].device if tensors else torch.device("cpu")
        self.arena = torch.empty(plan.arena.get(rank, 0), dtype=torch.uint8, device=device)
        plans = [plan.rest] + [p for g in plan.groups for p in (g.assembly, g.stage_b) if p is not None]
        staging = torch.empty(max(staging_size(p, rank, verify) for p in plans), dtype=torch.uint8, device=device)
        kw = dict(timeout=timeout, verify=verify, staging=staging)
        self._quantized: dict[str, tuple] = {}      # source tensors the quantization reads: owner, bound storage
        self.rest = Resharder(plan.rest, _pick(src, plan.rest, "src", rank), _pick(dst, plan.rest, "dst", rank), group, **kw)
        self.groups = []
        for g in plan.groups:
            temp = {}
            for name, (shape, dtype, off) in g.temp.get(rank, {}).items():
                dt = torch_dtype(dtype)
                n = dt.itemsize
                for s in shape:
                    n *= s
                temp[name] = self.arena[off:off + n].view(dt).view(shape)
            asm = None
            if g.assembly is not None:
                asm = Resharder(g.assembly, _pick(src, g.assembly, "src", rank), _pick(temp, g.assembly, "dst", rank),
                                group, **kw)
            jobs = []
            for reg in g.regions:
                if reg.owner != rank:
                    continue
                if reg.kind == "shard":
                    self._quantized[reg.input] = (src[reg.input], src[reg.input].data_ptr())
                    x = src[reg.input][reg.input_local.slices()].detach().reshape(reg.box.sizes)
                else:
                    x = temp[reg.input]
                q, sc = temp[reg.q_buffer], temp[reg.s_buffer]
                if reg.q_local is not None:         # a dim-0 part of a buffer shared with its neighbours
                    q, sc = q[reg.q_local.slices()], sc[reg.s_local.slices()]
                jobs.append((x, q, sc, reg.box.numel))
            # a target buffer several groups write: each group's stage B writes its own dim-0 slab,
            # a contiguous view of the buffer
            gdst = dict(dst)
            for name, (bname, a, e) in g.views.get(rank, {}).items():
                if bname in dst:
                    gdst[name] = dst[bname][a:e]
            b = Resharder(g.stage_b, _pick(temp, g.stage_b, "src", rank), _pick(gdst, g.stage_b, "dst", rank), group, **kw)
            self.groups.append((asm, jobs, b))

    def refit(self, version: int | None = None, *, refusal: list[str] | None = None) -> dict:
        """Move every byte once (collective): unquantized tensors, then each group's assembly,
        quantization and FP8 transfer.  Returns this rank's counts.  ``refusal``: this rank's
        reasons not to refit (see :meth:`Resharder.refit`): every rank refuses before a byte moves."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                    or not 0 <= version < 2 ** 63):
            raise ValueError(f"version={version!r}: must be an integer in [0, 2**63) or None")
        v = self.version + 1 if version is None else version
        out = {"version": v, "messages_sent": 0, "staged_bytes_sent": 0, "quantized_elements": 0, "quantize_s": 0.0}

        def add(st):
            out["messages_sent"] += st.get("messages_sent", 0)
            out["staged_bytes_sent"] += st.get("staged_bytes_sent", 0)
        refusal = list(refusal or []) + _stale_sources(self.rank, self._quantized)
        started = False
        try:
            add(self.rest.refit(v, refusal=refusal or None))
            started = True
            for i, (asm, jobs, b) in enumerate(self.groups):
                if asm is not None:
                    add(asm.refit(v))
                t0 = time.perf_counter()
                for x, q, s, n in jobs:
                    quantize_into(x, self.plan.block, q, s)
                    out["quantized_elements"] += n
                out["quantize_s"] += time.perf_counter() - t0
                add(b.refit(v))
        except BaseException as e:  # noqa: BLE001 - recorded, then re-raised: state() says what is half-applied
            if started or not isinstance(e, ReshardError) or isinstance(e, TransferError):
                self._interrupted = {"version": v, "error": f"{type(e).__name__}: {e}"}
            raise
        self._interrupted = None
        self.version = v
        self.last_stats = out
        return out

    def resharders(self) -> list[Resharder]:
        return [self.rest] + [r for a, _, b in self.groups for r in (a, b) if r is not None]

    def state(self) -> dict:
        """Refit version every destination buffer fully holds (see :meth:`Resharder.state`).  A
        buffer written by several groups (dim-0 slabs) holds version ``v`` only when every slab
        does; slabs of different versions (a refit interrupted between two groups) make it
        ``None`` and it is listed in ``incomplete``."""
        per: dict[str, set] = defaultdict(set)
        views = {}
        for g in self.plan.groups:
            for name, (bname, _, _) in g.views.get(self.rank, {}).items():
                views[name] = bname
        for r in [self.rest] + [b for _, _, b in self.groups]:
            for name, v in r.state()["buffers"].items():
                per[views.get(name, name)].add(v)
        buffers = {n: (next(iter(vs)) if len(vs) == 1 else None) for n, vs in sorted(per.items())}
        info = self._interrupted or {}
        return {"version": self.version, "buffers": buffers,
                "incomplete": sorted(n for n, v in buffers.items() if v is None),
                "interrupted": self._interrupted is not None or any(r.state()["interrupted"] for r in self.resharders()),
                "interrupted_version": info.get("version"), "error": info.get("error")}

    def rebind(self, group=None) -> None:
        for r in self.resharders():
            r.rebind(group)


__all__ = ["Fp8", "Fp8Resharder", "quantize_into", "ReshardError"]
