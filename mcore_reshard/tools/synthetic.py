"""A synthetic transformer-shaped tensor set, laid out Megatron-style, for the demo and the tests.

It has every kind of layout the real adapters produce: vocab-parallel embedding and head with
padding rows, GQA-interleaved fused ``qkv`` (pieces of ``q_proj``/``k_proj``/``v_proj``),
``[gate; up]`` fused ``fc1`` per TP rank, row-parallel projections, replicated norms, stacked
experts (EP over the expert dim, expert-TP inside), an uneven tensor split over every rank, and
pipeline stages.  Tensor names are Hugging-Face-like.

``parse_parallel("tp=2,pp=2,ep=2")`` gives the sizes; ``synthetic_layout(sizes)`` the layout.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Mapping

import torch

from ..core.box import Box, split_range
from ..core.layout import Buffer, Layout, Piece, shard_box, stacked
from ..core.mesh import Mesh, megatron_meshes

PARALLEL_KEYS = ("tp", "pp", "cp", "ep", "etp", "dp")


def parse_parallel(text: str) -> dict[str, int]:
    """``"tp=2,pp=2,ep=4"`` -> sizes (missing ones are 1; etp defaults to tp, dp to 1).

    The grammar is :func:`mcore_reshard.tools.layout_strings.parse`'s (Megatron strings only)."""
    from .layout_strings import parse
    spec = parse(text)
    bad = sorted(set(spec.sizes) - set(PARALLEL_KEYS))
    if spec.engine != "megatron" or bad:
        raise ValueError(f"bad parallel sizes {text!r}: the synthetic model takes Megatron keys {PARALLEL_KEYS} only"
                         + (f", not {bad}" if bad else ""))
    sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1, "dp": 1, **spec.sizes}
    sizes.setdefault("etp", sizes["tp"])
    return sizes


def world_size_of(sizes: Mapping[str, int]) -> int:
    return sizes["tp"] * sizes["pp"] * sizes["cp"] * sizes["dp"]


@dataclass(frozen=True)
class SyntheticModel:
    hidden: int = 32
    heads: int = 8
    groups: int = 4
    head_dim: int = 8
    ffn: int = 48
    vocab: int = 1001          # padded per layout, as Megatron does
    experts: int = 8
    moe_ffn: int = 16
    layers: int = 2
    odd_rows: int = 0          # 0: 3 * world + 1

    def scaled(self, factor: int) -> "SyntheticModel":
        """A bigger model with the same structure (for timing)."""
        return SyntheticModel(self.hidden * factor, self.heads, self.groups, self.head_dim * factor,
                              self.ffn * factor, self.vocab * factor, self.experts, self.moe_ffn * factor, self.layers,
                              self.odd_rows)


def synthetic_layout(sizes: Mapping[str, int], model: SyntheticModel = SyntheticModel(), dtype: str = "float32",
                     rank_offset: int = 0) -> Layout:
    world = world_size_of(sizes)
    meshes = megatron_meshes(world, sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"], sizes.get("etp"), rank_offset=rank_offset)
    dense, expert = meshes.dense, meshes.expert
    tp, pp, etp = sizes["tp"], sizes["pp"], expert.axis_size("etp")
    m = model
    lay = Layout()
    pad_to = 8 * tp
    padded_vocab = -(-m.vocab // pad_to) * pad_to
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        lay.add_tensor(name, (m.vocab, m.hidden), dtype)
    lay.add_tensor("model.norm.weight", (m.hidden,), dtype)
    odd = m.odd_rows or 3 * world + 1
    everyone = Mesh.of({"all": world}, rank_offset)
    lay.add_sharded("odd.weight", (odd, 5), dtype, everyone, [("all", 0)], mode="even")

    def stage_of(layer: int) -> int:
        return layer * pp // m.layers

    for r in dense.ranks:
        c = dense.coord(r)
        t, stage = c["tp"], c["pp"]
        rows = padded_vocab // tp
        for name, where in (("model.embed_tokens.weight", 0), ("lm_head.weight", pp - 1)):
            if stage != where:
                continue
            lo = t * rows
            hi = min(lo + rows, m.vocab)
            pieces = () if hi <= lo else (Piece(name, Box((lo, 0), (hi - lo, m.hidden)), Box((0, 0), (hi - lo, m.hidden))),)
            lay.add_buffer(r, Buffer(name, (rows, m.hidden), dtype, pieces))
        if stage == pp - 1:
            lay.add_buffer(r, Buffer("model.norm.weight", (m.hidden,), dtype,
                                     (Piece("model.norm.weight", Box.full((m.hidden,)), Box.full((m.hidden,))),)))

    qpg = m.heads // m.groups
    for layer in range(m.layers):
        p = f"model.layers.{layer}."
        shapes = {
            "input_layernorm.weight": (m.hidden,),
            "self_attn.q_proj.weight": (m.heads * m.head_dim, m.hidden),
            "self_attn.k_proj.weight": (m.groups * m.head_dim, m.hidden),
            "self_attn.v_proj.weight": (m.groups * m.head_dim, m.hidden),
            "self_attn.o_proj.weight": (m.hidden, m.heads * m.head_dim),
            "mlp.gate_proj.weight": (m.ffn, m.hidden),
            "mlp.up_proj.weight": (m.ffn, m.hidden),
            "mlp.down_proj.weight": (m.hidden, m.ffn),
            "mlp.experts.gate_up_proj": (m.experts, 2 * m.moe_ffn, m.hidden),
            "mlp.experts.down_proj": (m.experts, m.hidden, m.moe_ffn),
        }
        for n, s in shapes.items():
            lay.add_tensor(p + n, s, dtype)
        for r in dense.ranks:
            c = dense.coord(r)
            if c["pp"] != stage_of(layer):
                continue
            t = c["tp"]
            lay.add_buffer(r, Buffer(p + "input_layernorm.weight", (m.hidden,), dtype,
                                     (Piece(p + "input_layernorm.weight", Box.full((m.hidden,)), Box.full((m.hidden,))),)))
            g_lo, g_n = split_range(m.groups, tp, t, "exact")
            parts = []
            for g in range(g_lo, g_lo + g_n):   # Megatron linear_qkv: per query group [q; k; v]
                parts.append((p + "self_attn.q_proj.weight", Box((g * qpg * m.head_dim, 0), (qpg * m.head_dim, m.hidden))))
                parts.append((p + "self_attn.k_proj.weight", Box((g * m.head_dim, 0), (m.head_dim, m.hidden))))
                parts.append((p + "self_attn.v_proj.weight", Box((g * m.head_dim, 0), (m.head_dim, m.hidden))))
            lay.add_buffer(r, stacked(p + "self_attn.qkv", dtype, parts))
            o = shard_box(shapes["self_attn.o_proj.weight"], dense, r, [("tp", 1)])
            lay.add_buffer(r, Buffer(p + "self_attn.o_proj.weight", o.sizes, dtype, (Piece(p + "self_attn.o_proj.weight", o, Box.full(o.sizes)),)))
            f_lo, f_n = split_range(m.ffn, tp, t, "exact")
            lay.add_buffer(r, stacked(p + "mlp.fc1", dtype, [(p + "mlp.gate_proj.weight", Box((f_lo, 0), (f_n, m.hidden))),
                                                             (p + "mlp.up_proj.weight", Box((f_lo, 0), (f_n, m.hidden)))]))
            d = shard_box(shapes["mlp.down_proj.weight"], dense, r, [("tp", 1)])
            lay.add_buffer(r, Buffer(p + "mlp.down_proj.weight", d.sizes, dtype, (Piece(p + "mlp.down_proj.weight", d, Box.full(d.sizes)),)))
        for r in expert.ranks:
            c = expert.coord(r)
            if c["pp"] != stage_of(layer):
                continue
            e_lo, e_n = split_range(m.experts, expert.axis_size("ep"), c["ep"], "exact")
            i_lo, i_n = split_range(m.moe_ffn, etp, c["etp"], "exact")
            for j in range(e_n):   # SequentialMLP style: one [gate_r; up_r] buffer per local expert
                e = e_lo + j
                gu = p + "mlp.experts.gate_up_proj"
                pieces = (Piece(gu, Box((e, i_lo, 0), (1, i_n, m.hidden)), Box((0, 0), (i_n, m.hidden))),
                          Piece(gu, Box((e, m.moe_ffn + i_lo, 0), (1, i_n, m.hidden)), Box((i_n, 0), (i_n, m.hidden))))
                lay.add_buffer(r, Buffer(p + f"mlp.experts.local.{j}.fc1", (2 * i_n, m.hidden), dtype, pieces))
                dn = p + "mlp.experts.down_proj"
                lay.add_buffer(r, Buffer(p + f"mlp.experts.local.{j}.fc2", (m.hidden, i_n), dtype,
                                         (Piece(dn, Box((e, 0, i_lo), (1, m.hidden, i_n)), Box((0, 0), (m.hidden, i_n))),)))
    return lay


def reference_tensor(name: str, shape, dtype: torch.dtype = torch.float32, step: int = 0) -> torch.Tensor:
    """Deterministic full tensor for ``name`` (depends on name, shape and ``step`` only)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()) + 7919 * step)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)


def materialize(layout: Layout, rank: int, full: Mapping[str, torch.Tensor], fill: float | None = 0.0,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """This rank's buffers cut directly from full tensors (the simple reference path).

    Padding is ``fill`` (None leaves it uninitialised).  ``dtype`` overrides the buffer dtype.
    """
    from ..core.executor import torch_dtype
    out = {}
    for name, buf in sorted(layout.buffers.get(rank, {}).items()):
        dt = dtype or torch_dtype(buf.dtype)
        t = torch.empty(buf.shape, dtype=dt) if fill is None else torch.full(buf.shape, fill, dtype=dt)
        for p in buf.pieces:
            t[p.local.slices()] = full[p.tensor][p.box.slices()].reshape(p.local.sizes).to(dt)
        out[name] = t
    return out
