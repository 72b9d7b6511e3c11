"""Block-quantized FP8 target layouts (pure: no torch).

DeepSeek-V3 is served with e4m3 weights and one fp32 ``weight_scale_inv`` per 128x128 block of the
*global* tensor.  Blocks tile the last two dimensions (leading dimensions, e.g. the expert axis of
``mlp.experts.gate_up_proj [E, 2I, H]``, are batch dimensions); the scale tensor of ``T`` is
``T.shape[:-2] + [ceil(rows/B0), ceil(cols/B1)]``, fp32, named by :func:`scale_name`.

:func:`fp8_target` turns a BF16 target layout into its FP8 form: the same buffers, the quantized
tensors in ``float8_e4m3fn``, and next to every buffer holding quantized pieces a scale buffer whose
pieces are the block-grid images of the weight pieces.  Example, vLLM's ``fused_qkv_a_proj``
(DeepSeek-V3, replicated, block 128)::

    buffer                            | piece (tensor, global box)             -> local box
    fused_qkv_a_proj.weight [2112,7168]| q_a_proj.weight [0:1536, 0:7168]       -> [0:1536, 0:7168]
                                      | kv_a_proj_with_mqa.weight [0:576, ...]  -> [1536:2112, 0:7168]
    fused_qkv_a_proj.weight_scale_inv | q_a_proj.weight_scale_inv [0:12, 0:56]  -> [0:12, 0:56]
      [17, 56]                        | kv_a_proj_with_mqa.weight_scale_inv [0:5, 0:56] -> [12:17, 0:56]

Block rules (each violation is a :class:`LayoutError` naming tensor, rank, buffer, box and block):
a piece's offsets in the two block dims are multiples of the block, its ends are multiples or the
tensor's end, its local offsets in the corresponding buffer dims are multiples of the block, and a
piece ending in a partial block is the last thing along that buffer dim (vLLM: "except the last
merged part").  So vLLM ``tp=32`` without EP (64-row expert and dense shards) is refused.
"""
from __future__ import annotations

from typing import Mapping, Sequence

from ..core.box import Box
from ..core.layout import Buffer, Layout, LayoutError, Piece, TensorMeta
from ..mapper.fp8_rules import DEFAULT_BLOCK, Fp8Rules, check_block

FP8 = "float8_e4m3fn"
SCALE_DTYPE = "float32"
FP8_MAX = 448.0


def scale_name(name: str) -> str:
    """``x.weight`` -> ``x.weight_scale_inv``; vLLM ``w13_weight`` -> ``w13_weight_scale_inv``;
    anything else (``mlp.experts.gate_up_proj``) -> ``name + "_scale_inv"``."""
    return name + "_scale_inv"


def scale_shape(shape: Sequence[int], block: Sequence[int]) -> tuple[int, ...]:
    if len(shape) < 2:
        raise LayoutError(f"cannot block-quantize a tensor of shape {tuple(shape)}: needs >= 2 dims")
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def _dim_map(p: Piece) -> dict[int, int]:
    """tensor dim -> buffer dim of a piece (same correspondence as :meth:`Piece.local_of`)."""
    if p.box.sizes == p.local.sizes:
        return {d: d for d in range(p.box.ndim)}
    gdims = [d for d, s in enumerate(p.box.sizes) if s != 1]
    ldims = [d for d, s in enumerate(p.local.sizes) if s != 1]
    return dict(zip(gdims, ldims))


def _grid(rank: int, buf: Buffer, p: Piece, shape: Sequence[int], block: tuple[int, int]) -> tuple[Box, Box, tuple[int, int]]:
    """(global block box, local block box, (buffer dim of rows, of cols)) of one weight piece."""
    nd = len(shape)
    dmap = _dim_map(p)
    bdims = []
    goffs, gsizes = list(p.box.offsets[:-2]), list(p.box.sizes[:-2])
    for k, d in enumerate((nd - 2, nd - 1)):
        B, o, e, n = block[k], p.box.offsets[d], p.box.ends[d], shape[d]
        what = f"rank {rank} buffer {buf.name}: {p.tensor}{p.box} of shape {list(shape)}"
        if o % B or (e % B and e != n):
            bad = o if o % B else e
            raise LayoutError(f"{what}: {'rows' if k == 0 else 'columns'} {o}:{e} (a {e - o}-wide shard) cut the "
                              f"{block[0]}x{block[1]} FP8 blocks at {bad}: not a multiple of the {B} block "
                              "(use fewer shards along that dim, e.g. a smaller TP, or expert parallelism)")
        if d not in dmap:
            raise LayoutError(f"{what}: cannot place its {block} blocks in the buffer (dim {d} has size 1 in a "
                              f"squeezed piece {p.local})")
        bd = dmap[d]
        lo, le, bn = p.local.offsets[bd], p.local.ends[bd], buf.shape[bd]
        if lo % B or (e % B and le != bn):
            raise LayoutError(f"{what}: local {p.local} in buffer {list(buf.shape)} is not block-aligned along buffer "
                              f"dim {bd} (offset {lo} not a multiple of {B}, or a partial last block at {le} "
                              f"followed by more of the buffer up to {bn})")
        bdims.append(bd)
        goffs.append(o // B)
        gsizes.append(-(-e // B) - o // B)
    gbox = Box(tuple(goffs), tuple(gsizes))
    loffs, lsizes = list(p.local.offsets), list(p.local.sizes)
    for k, bd in enumerate(bdims):
        loffs[bd] //= block[k]
        lsizes[bd] = gsizes[nd - 2 + k]
    return gbox, Box(tuple(loffs), tuple(lsizes)), (bdims[0], bdims[1])


def fp8_buffers(rank: int, buf: Buffer, tensors: Mapping[str, TensorMeta], quantized: set[str],
                block: tuple[int, int]) -> tuple[Buffer, Buffer | None]:
    """A buffer in its FP8 form and its scale buffer (None when it holds no quantized piece)."""
    q = [p for p in buf.pieces if p.tensor in quantized]
    if not q:
        return buf, None
    if len(q) != len(buf.pieces):
        other = next(p.tensor for p in buf.pieces if p.tensor not in quantized)
        raise LayoutError(f"rank {rank} buffer {buf.name} mixes quantized {q[0].tensor} and unquantized {other}")
    pieces, bdims = [], None
    for p in q:
        gbox, lbox, dims = _grid(rank, buf, p, tensors[p.tensor].shape, block)
        if bdims is not None and dims != bdims:
            raise LayoutError(f"rank {rank} buffer {buf.name}: pieces put their block dims on buffer dims {bdims} and {dims}")
        bdims = dims
        pieces.append(Piece(scale_name(p.tensor), gbox, lbox))
    shape = list(buf.shape)
    for k, bd in enumerate(bdims):
        shape[bd] = -(-shape[bd] // block[k])
    name = buf.name + "_scale_inv"
    return Buffer(buf.name, buf.shape, FP8, buf.pieces), Buffer(name, tuple(shape), SCALE_DTYPE, tuple(pieces))


def fp8_target(layout: Layout, quantized: set[str], block: Sequence[int] = DEFAULT_BLOCK) -> Layout:
    """The FP8 form of a target layout (see the module doc).  Buffers shared between ranks (the
    engine builders reuse buffer objects) are transformed once."""
    b = check_block(block)
    out = Layout()
    for name, meta in layout.tensors.items():
        if name in quantized:
            out.add_tensor(name, meta.shape, FP8)
            out.add_tensor(scale_name(name), scale_shape(meta.shape, b), SCALE_DTYPE)
        else:
            out.add_tensor(name, meta.shape, meta.dtype)
    cache: dict[int, tuple[Buffer, Buffer | None]] = {}
    for r in layout.ranks:
        bufs = out.buffers.setdefault(r, {})
        for bname, buf in sorted(layout.buffers[r].items()):
            key = id(buf)
            if key not in cache:
                cache[key] = fp8_buffers(r, buf, layout.tensors, quantized, b)
                for x in cache[key]:
                    if x is not None:
                        out._check_buffer(r, x)
            for x in cache[key]:
                if x is None:
                    continue
                if x.name in bufs:
                    raise LayoutError(f"rank {r}: scale buffer {x.name} collides with an existing buffer")
                bufs[x.name] = x
    return out


def bf16_target(fp8_layout: Layout, dtypes: Mapping[str, str]) -> Layout:
    """The BF16 layout an FP8 target layout came from: scale buffers dropped, quantized tensors in
    ``dtypes[name]`` (the source's dtype).  Used to report the BF16 refit's bytes side by side."""
    scales = {scale_name(n) for n, m in fp8_layout.tensors.items() if m.dtype == FP8}
    out = Layout()
    for n, m in fp8_layout.tensors.items():
        if n not in scales:
            out.add_tensor(n, m.shape, dtypes.get(n, m.dtype) if m.dtype == FP8 else m.dtype)
    for r in fp8_layout.ranks:
        bufs = out.buffers.setdefault(r, {})
        for bname, buf in fp8_layout.buffers[r].items():
            if buf.pieces and buf.pieces[0].tensor in scales:
                continue
            if buf.dtype == FP8:
                buf = Buffer(buf.name, buf.shape, out.tensors[buf.pieces[0].tensor].dtype, buf.pieces)
            bufs[bname] = buf
    return out


def quantized_of(layout: Layout) -> set[str]:
    """The FP8 tensors of an FP8 layout."""
    return {n for n, m in layout.tensors.items() if m.dtype == FP8}


__all__ = ["DEFAULT_BLOCK", "FP8", "FP8_MAX", "Fp8Rules", "SCALE_DTYPE", "bf16_target", "check_block", "fp8_buffers",
           "fp8_target", "quantized_of", "scale_name", "scale_shape"]
