"""Layouts read from an engine itself: run the engine's own ``load_weights`` once on *probe* tensors.

Every element of every canonical (Hugging Face) tensor gets an integer id; the checkpoint tensors
the engine's loader expects (per-expert names, separate ``q_a_proj`` / ``kv_a_proj_with_mqa``, ...)
are cut from those ids, and fed to the engine's real ``model.load_weights``.  Afterwards every
element of every parameter holds the id of the canonical element the loader put there (or 0 where
it wrote nothing: padding), so reading the parameters back gives, exactly, which box of which
canonical tensor lands where in which parameter -- the engine's layout for this rank, with no
hand-written table::

    model = DeepseekV3ForCausalLM(vllm_config=...)           # any model the engine can build, float32
    part = probe_layout(model, hf_layout(cfg, fused_experts=False), rank=r, dtype="bfloat16")
    assert not compare_layouts(part, vllm_layout(cfg, tp=2), ranks=[r])

Ids are exact in float32 up to 2**23 per pass; larger models take more passes (base-2**23 digits,
one full ``load_weights`` each).  The model must be built in float32 (or float64), and the loader
must copy values (no arithmetic): a parameter holding a non-id value is refused by name.
Parameters no checkpoint tensor reaches are returned separately (``unwritten``), not as buffers.
Needs numpy (present wherever an engine is; not a core dependency: nothing imports this module by default).
"""
from __future__ import annotations

from math import prod
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from ..core.box import Box
from ..core.layout import Buffer, Layout, LayoutError, Piece

DIGIT = 1 << 23          # float32 holds every integer up to 2**24 exactly; ids are stored as digit + 1


def _ids(layout: Layout) -> tuple[list[str], np.ndarray]:
    names = sorted(layout.tensors)
    sizes = np.array([prod(layout.tensors[n].shape) for n in names], dtype=np.int64)
    return names, np.concatenate([[0], np.cumsum(sizes)])


def _boxes(mask: np.ndarray) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Greedy row-major decomposition of a boolean mask into disjoint boxes (offsets, sizes)."""
    out = []
    mask = mask.copy()
    nd = mask.ndim
    while mask.any():
        start = tuple(int(x) for x in np.argwhere(mask)[0])
        sizes = [1] * nd
        for d in reversed(range(nd)):
            while start[d] + sizes[d] < mask.shape[d]:
                sl = tuple(slice(s, s + n) if k != d else slice(s + n, s + n + 1)
                           for k, (s, n) in enumerate(zip(start, sizes)))
                if not mask[sl].all():
                    break
                sizes[d] += 1
        mask[tuple(slice(s, s + n) for s, n in zip(start, sizes))] = False
        out.append((start, tuple(sizes)))
    return out


def decode_buffer(name: str, ids: np.ndarray, tensors: Sequence[str], offsets: np.ndarray, shapes: Mapping[str, tuple],
                  dtypes: Mapping[str, str]) -> Buffer | None:
    """The buffer a parameter is, from the canonical element ids (``-1``: nothing written) it holds."""
    written = ids >= 0
    if not written.any():
        return None
    loc = np.argwhere(written)                                   # [n, nd] local indices, row-major
    flat = ids[written]
    tid = np.searchsorted(offsets, flat, side="right") - 1
    pieces = []
    for t in np.unique(tid):
        tname = tensors[int(t)]
        shape = shapes[tname]
        sel = tid == t
        extra = ids.ndim - len(shape)       # e.g. a 2-d shared expert as one slot of a 3-d w13: leading 1s
        if extra < 0:
            raise LayoutError(f"{name}: holds {tname} {tuple(shape)} in a {ids.ndim}-d parameter (not decodable)")
        glob = np.stack(np.unravel_index(flat[sel] - offsets[t], (1,) * extra + tuple(shape)), axis=1)
        lsel = loc[sel]
        delta = glob - lsel
        keys, inv = np.unique(delta, axis=0, return_inverse=True)
        for k in range(len(keys)):
            pts = lsel[inv.reshape(-1) == k]
            lo, hi = pts.min(axis=0), pts.max(axis=0) + 1
            mask = np.zeros(tuple(hi - lo), dtype=bool)
            mask[tuple((pts - lo).T)] = True
            for off, sz in _boxes(mask):
                local = tuple(int(a + b) for a, b in zip(lo, off))
                gl = tuple(int(a + b) for a, b in zip(local, keys[k]))
                if any(sz[d] != 1 for d in range(extra)):
                    raise LayoutError(f"{name}: {tname} spread over a dimension it does not have")
                pieces.append(Piece(tname, Box(gl[extra:], tuple(sz[extra:])), Box(local, tuple(sz))))
    kinds = {dtypes[p.tensor] for p in pieces}
    if len(kinds) != 1:
        raise LayoutError(f"{name}: holds tensors of several dtypes {sorted(kinds)}")
    return Buffer(name, tuple(int(s) for s in ids.shape), kinds.pop(), tuple(sorted(pieces, key=lambda p: p.local)))


@torch.no_grad()
def probe_layout(model: torch.nn.Module | Mapping[str, torch.Tensor], checkpoint: Layout, rank: int = 0, *,
                 load_weights: Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None = None,
                 dtype: str | None = None, prefix: str = "", checkpoint_rank: int = 0) -> tuple[Layout, list[str]]:
    """This rank's engine layout, read from the engine's own loader.

    ``model``: the engine's model (built in float32; its ``load_weights`` is the loader unless
    ``load_weights`` is given) or a dict of its parameters (then ``load_weights`` is required).
    ``checkpoint``: the layout of the checkpoint the loader reads -- buffers named as the loader
    expects them, holding boxes of canonical tensors (e.g. ``hf_layout(cfg, fused_experts=False)``,
    the on-disk DeepSeek / Qwen3-MoE names), on ``checkpoint_rank``.  ``dtype``: the dtype the
    returned buffers and tensors get (the engine's serving dtype; default: the canonical tensors').
    Buffers are named ``prefix + parameter name``.  Returns ``(layout, unwritten parameter names)``;
    the layout's tensors are the canonical tensors the checkpoint covers."""
    if isinstance(model, Mapping):
        params = dict(model)
        if load_weights is None:
            raise ValueError("load_weights is needed when model is a dict of parameters")
    else:
        params = {n: p.detach() for n, p in model.named_parameters()}
        load_weights = load_weights or model.load_weights
    for n, p in params.items():
        if p.dtype not in (torch.float32, torch.float64):
            raise LayoutError(f"probe needs a float32 model: {n} is {p.dtype}")
    names, offsets = _ids(checkpoint)
    total = int(offsets[-1])
    passes = 1
    while DIGIT ** passes < total:
        passes += 1
    digits = {n: np.zeros(tuple(p.shape), dtype=np.int64) for n, p in params.items()}
    seen = {n: None for n in params}
    bufs = checkpoint.buffers.get(checkpoint_rank, {})
    for k in range(passes):
        full = {}
        for i, n in enumerate(names):
            ids = torch.arange(int(offsets[i]), int(offsets[i + 1]), dtype=torch.int64)
            full[n] = ((ids // DIGIT ** k) % DIGIT + 1).to(torch.float32).reshape(checkpoint.tensors[n].shape)
        for p in params.values():
            p.zero_()
        feed = []
        for bname, b in bufs.items():
            t = torch.zeros(b.shape, dtype=torch.float32)
            for pc in b.pieces:
                t[pc.local.slices()] = full[pc.tensor][pc.box.slices()].reshape(pc.local.sizes)
            feed.append((bname, t))
        del full
        load_weights(iter(feed))
        for n, p in params.items():
            v = p.to("cpu", torch.float64).numpy()
            if not np.array_equal(v, np.round(v)) or (v < 0).any() or (v > DIGIT).any():
                raise LayoutError(f"{n}: the loader changed the values it copied (not a pure copy: "
                                  f"cannot read its layout by probing)")
            d = v.astype(np.int64)
            w = d > 0
            if seen[n] is None:
                seen[n] = w
            elif not np.array_equal(seen[n], w):
                raise LayoutError(f"{n}: the loader wrote different elements on pass {k}")
            digits[n] += np.where(w, d - 1, 0) * DIGIT ** k
    for p in params.values():
        p.zero_()
    shapes = {n: checkpoint.tensors[n].shape for n in names}
    dtypes = {n: dtype or checkpoint.tensors[n].dtype for n in names}
    # the router bias and other float32 canonical tensors keep their dtype
    dtypes.update({n: checkpoint.tensors[n].dtype for n in names if checkpoint.tensors[n].dtype == "float32"})
    out, unwritten = Layout(), []
    for n in names:
        out.add_tensor(n, shapes[n], dtypes[n])
    for n in sorted(params):
        ids = np.where(seen[n], digits[n], -1) if seen[n] is not None else np.full(digits[n].shape, -1)
        buf = decode_buffer(prefix + n, ids, names, offsets, shapes, dtypes)
        if buf is None:
            unwritten.append(prefix + n)
        else:
            out.add_buffer(rank, buf)
    used = {p.tensor for b in out.buffers.get(rank, {}).values() for p in b.pieces}
    for n in [n for n in out.tensors if n not in used]:
        del out.tensors[n]
    return out, unwritten


def _content(layout: Layout, rank: int, name: str, index: Mapping[str, int]) -> torch.Tensor:
    """A buffer filled with float64 element ids of the canonical tensors (padding -1)."""
    buf = layout.buffers[rank][name]
    t = torch.full(buf.shape, -1.0, dtype=torch.float64)
    for p in buf.pieces:
        shape = layout.tensors[p.tensor].shape
        ids = torch.arange(prod(shape), dtype=torch.float64).reshape(shape)
        t[p.local.slices()] = (ids[p.box.slices()] + index[p.tensor] * 1e9).reshape(p.local.sizes)
    return t


def compare_layouts(a: Layout, b: Layout, ranks: Iterable[int] | None = None) -> list[str]:
    """Differences between two layouts, rank by rank: buffer names, shapes, dtypes and, element by
    element, which canonical element each holds (however the pieces are cut).  Empty if equal."""
    out = []
    index = {n: i for i, n in enumerate(sorted(set(a.tensors) | set(b.tensors)))}
    ranks = sorted(set(a.buffers) | set(b.buffers)) if ranks is None else list(ranks)
    for r in ranks:
        ba, bb = a.buffers.get(r, {}), b.buffers.get(r, {})
        for n in sorted(set(ba) - set(bb)):
            out.append(f"rank {r}: {n} only in the first")
        for n in sorted(set(bb) - set(ba)):
            out.append(f"rank {r}: {n} only in the second")
        for n in sorted(set(ba) & set(bb)):
            x, y = ba[n], bb[n]
            if x.shape != y.shape or x.dtype != y.dtype:
                out.append(f"rank {r}: {n} is {x.shape} {x.dtype} vs {y.shape} {y.dtype}")
                continue
            sx = {a.tensors[p.tensor].shape for p in x.pieces} | {b.tensors[p.tensor].shape for p in y.pieces}
            if any(a.tensors[p.tensor].shape != b.tensors.get(p.tensor, a.tensors[p.tensor]).shape for p in x.pieces):
                out.append(f"rank {r}: {n} holds tensors of different shapes in the two layouts ({sorted(sx)})")
                continue
            cx, cy = _content(a, r, n, index), _content(b, r, n, index)
            if not torch.equal(cx, cy):
                bad = (cx != cy).nonzero()[0].tolist()
                out.append(f"rank {r}: {n} differs first at local index {bad}: {x.pieces} vs {y.pieces}")
    return out


__all__ = ["compare_layouts", "decode_buffer", "probe_layout"]
