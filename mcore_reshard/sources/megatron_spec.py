"""Megatron-Core layouts from a model config and parallel sizes, without building the model.

For planning at full size (DeepSeek-V3 671B on 256-1024 ranks, metadata only) and for the CLI.
The result equals what :func:`megatron_model.read_layout` + :func:`family.canonicalize` read from
a live model with the local spec and SequentialMLP experts (tested against live tiny models):
buffers are named like Megatron's parameters (``decoder.layers.{local}.…``, ``vpp{c}.`` prefixes
with virtual pipelining), pieces are boxes of canonical (Hugging Face) tensors.

``config`` is any object or dict with Hugging Face field names: hidden_size, num_hidden_layers,
num_attention_heads, vocab_size, intermediate_size, and for MLA q_lora_rank, kv_lora_rank,
qk_nope_head_dim, qk_rope_head_dim, v_head_dim; for GQA num_key_value_heads, head_dim; for MoE
n_routed_experts (or num_experts), moe_intermediate_size, n_shared_experts, first_k_dense_replace,
num_nextn_predict_layers; tie_word_embeddings.

Example, DSV3 tiny at tp=2 pp=2 (4 ranks)::

    rank | stage | holds
    0, 1 | 0     | embedding rows [64t, 64t+64), layers 0-1 (tp shard t)
    2, 3 | 1     | layers 2-3, final norm, output layer rows [64t, 64t+64), MTP layer 4,
         |       | and a copy of the embedding (MTP's input embedding)
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Mapping

from ..core.box import Box, split_range
from ..core.gcpause import paused_gc
from ..core.layout import Buffer, Layout, Piece
from ..core.mesh import megatron_meshes


def _get(cfg: Any, name: str, default=None):
    if isinstance(cfg, Mapping):
        v = cfg.get(name, default)
    else:
        v = getattr(cfg, name, default)
    return default if v is None else v


@dataclass(frozen=True)
class ParallelSizes:
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    dp: int = 1
    vpp: int = 1
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    order: str = "tp-cp-ep-dp-pp"

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


def stage_layers(num_layers: int, sizes: ParallelSizes) -> list[list[int]]:
    """Global layer numbers per (virtual stage v * pp + pipeline rank), Megatron's split."""
    pp, vpp = sizes.pp, sizes.vpp
    counts = [0] * pp
    first, last = sizes.first_stage_layers, sizes.last_stage_layers
    if (first or last) and vpp > 1:
        raise ValueError("uneven first/last pipeline stages with virtual pipelining are not supported here")
    if first or last:
        rest, middle = num_layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if middle < 0 or rest < 0 or (middle and rest % middle) or (not middle and rest):
            raise ValueError(f"{num_layers} layers cannot be split as first={first} last={last} over pp={pp}")
        counts = [rest // middle if middle else 0] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        bounds, start = [], 0
        for c in counts:
            bounds.append(list(range(start, start + c)))
            start += c
        return bounds
    if num_layers % (pp * vpp):
        raise ValueError(f"{num_layers} layers do not divide over pp={pp} x vpp={vpp}")
    per = num_layers // (pp * vpp)
    return [list(range(s * per, (s + 1) * per)) for s in range(pp * vpp)]


class _Builder:
    """Adds the buffers of a layout rank by rank; a buffer is made once per distinct set of what it
    depends on (name, tensor, split, block, dtype) and the same object shared by every rank that
    holds it (data-parallel replicas), checked once."""

    def __init__(self, cfg, sizes: ParallelSizes, dtype: str, norm_dtype: str, bias_dtype: str, rank_offset: int):
        self.cfg, self.sizes = cfg, sizes
        self.dtype, self.norm_dtype, self.bias_dtype = dtype, norm_dtype, bias_dtype
        self.m = megatron_meshes(sizes.world, sizes.tp, sizes.pp, sizes.cp, sizes.ep, sizes.etp, sizes.order, rank_offset)
        self.lay = Layout()
        self.made: dict[tuple, Buffer] = {}
        self.parts: dict[tuple, tuple[Buffer, ...]] = {}
        self.pending: list[Buffer] | None = None

    def tensor(self, name, shape, dtype):
        old = self.lay.tensors.get(name)
        if old is None or old.shape != tuple(shape) or old.dtype != dtype:
            self.lay.add_tensor(name, shape, dtype)

    def add(self, rank, key: tuple, make) -> None:
        """The buffer ``make()`` makes, made once per ``key`` (all it depends on), on ``rank`` (or
        into the part :meth:`part` is collecting)."""
        buf = self.made.get(key)
        if buf is None:
            buf = self.made[key] = make()
        self.put(rank, buf)

    def put(self, rank, buf: Buffer) -> None:
        """``buf`` on ``rank``, or into the part :meth:`part` is collecting."""
        if self.pending is not None:
            self.pending.append(buf)
        else:
            self.lay.add_buffer(rank, buf)

    def part(self, rank, key: tuple, fill) -> None:
        """The buffers ``fill()`` adds, collected once per ``key`` (all they depend on) into one tuple
        that every rank with that key gets (:meth:`Layout.add_buffers`: checked once)."""
        got = self.parts.get(key)
        if got is None:
            self.pending = []
            try:
                fill()
                got = self.parts[key] = tuple(self.pending)
            finally:
                self.pending = None
        self.lay.add_buffers(rank, got)

    def whole(self, rank, buf, name, shape, dtype):
        self.tensor(name, shape, dtype)
        self.add(rank, ("whole", buf, name, tuple(shape), dtype),
                 lambda: Buffer(buf, tuple(shape), dtype, (Piece(name, Box.full(shape), Box.full(shape)),)))

    def rows(self, rank, buf, name, shape, parts, index, dim=0):
        """A tensor split in ``parts`` along ``dim``; this rank holds block ``index``."""
        self.tensor(name, shape, self.dtype)

        def make():
            off, n = split_range(shape[dim], parts, index, "exact")
            offs = [0] * len(shape)
            offs[dim] = off
            sizes = list(shape)
            sizes[dim] = n
            box = Box(tuple(offs), tuple(sizes))
            return Buffer(buf, box.sizes, self.dtype, (Piece(name, box, Box.full(box.sizes)),))
        self.add(rank, ("rows", buf, name, tuple(shape), parts, index, dim, self.dtype), make)

    def gate_up(self, rank, buf, gate, up, ffn, hidden, parts, index):
        """Megatron's linear_fc1: [gate_r; up_r] of two canonical [ffn, hidden] tensors."""
        for n in (gate, up):
            self.tensor(n, (ffn, hidden), self.dtype)

        def make():
            off, n = split_range(ffn, parts, index, "exact")
            pieces = (Piece(gate, Box((off, 0), (n, hidden)), Box((0, 0), (n, hidden))),
                      Piece(up, Box((off, 0), (n, hidden)), Box((n, 0), (n, hidden))))
            return Buffer(buf, (2 * n, hidden), self.dtype, pieces)
        self.add(rank, ("gate_up", buf, gate, up, ffn, hidden, parts, index, self.dtype), make)


@paused_gc()
def megatron_layout(cfg: Any, sizes: ParallelSizes, family: str = "deepseek_v3", dtype: str = "float32",
                    norm_dtype: str | None = None, rank_offset: int = 0) -> Layout:
    """The canonical layout of a Megatron-Core model with these dims on these parallel sizes."""
    b = _Builder(cfg, sizes, dtype, norm_dtype or dtype, "float32", rank_offset)
    H = _get(cfg, "hidden_size")
    L = _get(cfg, "num_hidden_layers")
    V = _get(cfg, "vocab_size")
    mtp = _get(cfg, "num_nextn_predict_layers", 0) if family == "deepseek_v3" else 0
    tied = bool(_get(cfg, "tie_word_embeddings", False))
    stages = stage_layers(L, sizes)
    tp = sizes.tp
    heads = _get(cfg, "num_attention_heads")
    if heads % tp:      # Megatron-Core's own check: attention is split over tp by whole heads
        raise ValueError(f"{heads} attention heads are not divisible by tp={tp}")
    for r in b.m.dense.ranks:
        c = b.m.dense.coord(r)
        t, p = c["tp"], c["pp"]
        for v in range(sizes.vpp):
            prefix = f"vpp{v}." if sizes.vpp > 1 else ""
            first = p == 0 and v == 0
            last = p == sizes.pp - 1 and v == sizes.vpp - 1
            if first or (last and mtp):   # the last stage keeps its own embedding copy for MTP
                b.rows(r, prefix + "embedding.word_embeddings.weight", "model.embed_tokens.weight", (V, H), tp, t)
            for local, layer in enumerate(stages[v * sizes.pp + p]):
                _layer(b, r, c, f"{prefix}decoder.layers.{local}.", f"model.layers.{layer}.", layer, family)
            if last:
                b.whole(r, prefix + "decoder.final_layernorm.weight", "model.norm.weight", (H,), b.norm_dtype)
                if not tied:
                    b.rows(r, prefix + "output_layer.weight", "lm_head.weight", (V, H), tp, t)
                elif sizes.pp > 1:
                    b.rows(r, prefix + "output_layer.weight", "model.embed_tokens.weight", (V, H), tp, t)
                for k in range(mtp):
                    mp, hp = f"{prefix}mtp.layers.{k}.", f"model.layers.{L + k}."
                    for n in ("enorm", "hnorm"):
                        b.whole(r, f"{mp}{n}.weight", f"{hp}{n}.weight", (H,), b.norm_dtype)
                    b.rows(r, f"{mp}eh_proj.weight", f"{hp}eh_proj.weight", (H, 2 * H), tp, t)
                    _layer(b, r, c, f"{mp}mtp_model_layer.", hp, L + k, family)
                    b.whole(r, f"{mp}final_layernorm.weight", f"{hp}shared_head.norm.weight", (H,), b.norm_dtype)
    return b.lay


def _is_moe(cfg, layer: int, family: str) -> bool:
    if family == "llama":
        return False
    if family == "qwen3_moe":
        return True
    return layer >= _get(cfg, "first_k_dense_replace", 0)


@lru_cache(maxsize=1 << 14)
def _expert_boxes(e: int, i_off: int, i_n: int, inter: int, hidden: int) -> tuple[Box, ...]:
    """Expert ``e``'s boxes in its fused ``[E, 2I, H]`` gate_up / ``[E, H, I]`` down tensors and in its
    local ``linear_fc1`` / ``linear_fc2`` (gate, local, up, local, down, local): the same in every
    layer, made once (boxes are immutable)."""
    return (Box((e, i_off, 0), (1, i_n, hidden)), Box((0, 0), (i_n, hidden)),
            Box((e, inter + i_off, 0), (1, i_n, hidden)), Box((i_n, 0), (i_n, hidden)),
            Box((e, 0, i_off), (1, hidden, i_n)), Box((0, 0), (hidden, i_n)))


def _layer(b: _Builder, r: int, c: dict, mp: str, hp: str, layer: int, family: str) -> None:
    """Layer ``layer``'s buffers on rank ``r`` in three parts, each made once per what it depends on:
    attention, norms, router and dense MLP (the TP coordinate), routed experts (the expert
    coordinates), shared experts (the TP coordinate)."""
    t = c["tp"]
    b.part(r, ("layer", mp, hp, layer, family, t), lambda: _attention_and_dense(b, r, t, mp, hp, layer, family))
    if not _is_moe(b.cfg, layer, family):
        return
    ec = b.m.expert.coord(r)
    b.part(r, ("experts", mp, hp, ec["ep"], ec["etp"]), lambda: _experts(b, r, ec, mp + "mlp.", hp))
    if _get(b.cfg, "n_shared_experts", 0):
        b.part(r, ("shared", mp, hp, t), lambda: _shared_experts(b, r, t, mp + "mlp.", hp))


def _attention_and_dense(b: _Builder, r: int, t: int, mp: str, hp: str, layer: int, family: str) -> None:
    cfg, tp = b.cfg, b.sizes.tp
    H = _get(cfg, "hidden_size")
    heads = _get(cfg, "num_attention_heads")
    b.whole(r, mp + "input_layernorm.weight", hp + "input_layernorm.weight", (H,), b.norm_dtype)
    a = mp + "self_attention."
    if family == "deepseek_v3":
        ql, kl = _get(cfg, "q_lora_rank"), _get(cfg, "kv_lora_rank")
        nope, rope, vd = _get(cfg, "qk_nope_head_dim"), _get(cfg, "qk_rope_head_dim"), _get(cfg, "v_head_dim")
        b.rows(r, a + "linear_q_down_proj.weight", hp + "self_attn.q_a_proj.weight", (ql, H), tp, t)
        b.rows(r, a + "linear_q_up_proj.weight", hp + "self_attn.q_b_proj.weight", (heads * (nope + rope), ql), tp, t)
        b.rows(r, a + "linear_kv_down_proj.weight", hp + "self_attn.kv_a_proj_with_mqa.weight", (kl + rope, H), tp, t)
        b.rows(r, a + "linear_kv_up_proj.weight", hp + "self_attn.kv_b_proj.weight", (heads * (nope + vd), kl), tp, t)
        b.whole(r, a + "q_layernorm.weight", hp + "self_attn.q_a_layernorm.weight", (ql,), b.norm_dtype)
        b.whole(r, a + "kv_layernorm.weight", hp + "self_attn.kv_a_layernorm.weight", (kl,), b.norm_dtype)
        b.rows(r, a + "linear_proj.weight", hp + "self_attn.o_proj.weight", (H, heads * vd), tp, t, dim=1)
    else:
        groups = _get(cfg, "num_key_value_heads", heads)
        hd = _get(cfg, "head_dim", H // heads)
        qpg = heads // groups
        names = [hp + f"self_attn.{x}_proj.weight" for x in "qkv"]
        for n, rows in zip(names, (heads * hd, groups * hd, groups * hd)):
            b.tensor(n, (rows, H), b.dtype)
        g_off, g_n = split_range(groups, tp, t, "exact")
        pieces, pos = [], 0
        for g in range(g_off, g_off + g_n):
            for n, start, rows in ((names[0], g * qpg * hd, qpg * hd), (names[1], g * hd, hd), (names[2], g * hd, hd)):
                pieces.append(Piece(n, Box((start, 0), (rows, H)), Box((pos, 0), (rows, H))))
                pos += rows
        b.add(r, ("qkv", a, tuple(pieces), pos, H, b.dtype),
              lambda: Buffer(a + "linear_qkv.weight", (pos, H), b.dtype, tuple(pieces)))
        if family == "qwen3_moe":
            b.whole(r, a + "q_layernorm.weight", hp + "self_attn.q_norm.weight", (hd,), b.norm_dtype)
            b.whole(r, a + "k_layernorm.weight", hp + "self_attn.k_norm.weight", (hd,), b.norm_dtype)
        b.rows(r, a + "linear_proj.weight", hp + "self_attn.o_proj.weight", (H, heads * hd), tp, t, dim=1)
    b.whole(r, mp + "pre_mlp_layernorm.weight", hp + "post_attention_layernorm.weight", (H,), b.norm_dtype)
    m = mp + "mlp."
    if not _is_moe(cfg, layer, family):
        F = _get(cfg, "intermediate_size")
        b.gate_up(r, m + "linear_fc1.weight", hp + "mlp.gate_proj.weight", hp + "mlp.up_proj.weight", F, H, tp, t)
        b.rows(r, m + "linear_fc2.weight", hp + "mlp.down_proj.weight", (H, F), tp, t, dim=1)
        return
    E = _get(cfg, "n_routed_experts", _get(cfg, "num_experts"))
    b.whole(r, m + "router.weight", hp + "mlp.gate.weight", (E, H), b.dtype)
    if family == "deepseek_v3":
        b.whole(r, m + "router.expert_bias", hp + "mlp.gate.e_score_correction_bias", (E,), b.bias_dtype)


def _experts(b: _Builder, r: int, ec: dict, m: str, hp: str) -> None:
    cfg = b.cfg
    H = _get(cfg, "hidden_size")
    E = _get(cfg, "n_routed_experts", _get(cfg, "num_experts"))
    I = _get(cfg, "moe_intermediate_size")
    ep, etp = b.m.expert.axis_size("ep"), b.m.expert.axis_size("etp")
    e_off, e_n = split_range(E, ep, ec["ep"], "exact")
    i_off, i_n = split_range(I, etp, ec["etp"], "exact")
    gu, dn = hp + "mlp.experts.gate_up_proj", hp + "mlp.experts.down_proj"
    b.tensor(gu, (E, 2 * I, H), b.dtype)
    b.tensor(dn, (E, H, I), b.dtype)
    # made straight away: the part (this layer, these expert coordinates) is made once, and no other
    # part holds these experts' buffers
    for j in range(e_n):
        x = f"{m}experts.local_experts.{j}."
        gate, gate_loc, up, up_loc, down, down_loc = _expert_boxes(e_off + j, i_off, i_n, I, H)
        b.put(r, Buffer(x + "linear_fc1.weight", (2 * i_n, H), b.dtype, (Piece(gu, gate, gate_loc), Piece(gu, up, up_loc))))
        b.put(r, Buffer(x + "linear_fc2.weight", (H, i_n), b.dtype, (Piece(dn, down, down_loc),)))


def _shared_experts(b: _Builder, r: int, t: int, m: str, hp: str) -> None:
    cfg, tp = b.cfg, b.sizes.tp
    H = _get(cfg, "hidden_size")
    shared, I = _get(cfg, "n_shared_experts", 0), _get(cfg, "moe_intermediate_size")
    if shared:
        S = I * shared
        b.gate_up(r, m + "shared_experts.linear_fc1.weight", hp + "mlp.shared_experts.gate_proj.weight",
                  hp + "mlp.shared_experts.up_proj.weight", S, H, tp, t)
        b.rows(r, m + "shared_experts.linear_fc2.weight", hp + "mlp.shared_experts.down_proj.weight", (H, S), tp, t, dim=1)
