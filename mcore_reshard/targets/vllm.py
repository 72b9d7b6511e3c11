"""vLLM runtime layouts: every rank's parameters, under vLLM's parameter names, as boxes of the
canonical (Hugging Face) tensors.  Metadata only.

The layout is what ``model.load_weights`` would leave in each parameter when fed the full HF
tensors (``stacked_params_mapping``, ``MergedColumnParallelLinear`` / ``QKVParallelLinear`` /
``RowParallelLinear`` / ``VocabParallelEmbedding`` loaders, ``FusedMoE.weight_loader``), so that
writing the planned boxes straight into the parameters (``copy_``, no ``load_weights``) gives the
same tensors.  Post-load transforms (MLA ``W_UK_T``/``W_UV`` copies, FP8, shuffles) are not
layout and must be redone by the caller (see ``/work/shared/research/target_layouts.md`` s.5).

World and ranks (``rank = rank_offset + dp_rank * pp * tp + pp_rank * tp + tp_rank``)::

    weight                          | split over (size, rank)
    attention, dense MLP, shared    | (tp, tp_rank)  -- each DP rank is a replica
    embed_tokens / lm_head          | (tp, tp_rank), rows padded to a multiple of 64 (padding
                                    |  rows are not covered: the executor zero-fills them)
    norms, router, fused_qkv_a      | replicated
    experts, enable_expert_parallel | ep = dp*tp, ep_rank = dp_rank*tp + tp_rank, MoE-TP m = 1;
                                    |  'linear' map: base = E // ep, rem = E % ep, rank r owns
                                    |  [r*base + min(r, rem), +base + (r < rem))
    experts, no EP                  | all E experts on every rank, TP-sharded by m = dp*tp at
                                    |  j = dp_rank*tp + tp_rank

Example, DeepSeek-V3 ``tp=8`` without EP: ``...mlp.experts.routed_experts.w13_weight``
``[256, 512, 7168]`` = per expert ``[gate rows j*256:(j+1)*256; up rows ...]``.

Parameter names (``names``):

* ``"current"`` (vLLM main after the FusedMoEFactory / ``RoutedExperts`` refactor; a third-party
  note places it in 0.25): experts are ``mlp.experts.routed_experts.w13_weight`` / ``w2_weight``.
* ``"legacy"`` (earlier releases): ``mlp.experts.w13_weight`` / ``w2_weight``.

Everything else is the same in both.  MTP (``mtp=True``) adds the separate ``DeepSeekMTP`` draft
model's parameters, prefixed with ``mtp_prefix`` so they do not collide with the target's:
``model.embed_tokens.weight`` (vocab-parallel), ``model.layers.{N}.{enorm,hnorm,eh_proj,
shared_head.norm}`` (replicated), ``model.layers.{N}.shared_head.head.weight`` (= ``lm_head``,
vocab-parallel) and ``model.layers.{N}.mtp_block.*`` (a normal decoder layer).

Sequence-parallel MoE (EP, TP > 1, DP > 1 with the default all-to-all backend): shared experts are
whole on every rank.  Round-robin expert placement is applied only where vLLM applies it (several
expert groups; with DP > 1 only the DeepEP low-latency / NIXL EP backends), else linear.

Not modelled: EPLB / redundant experts, ROCm
AITER shared-expert fusion, DCP q replication, quantized (FP8 scale) parameters, MTP with PP > 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Sequence

from ..core.box import Box, split_range
from ..core.gcpause import paused_gc
from ..core.layout import Buffer, Layout, LayoutError, Piece, stacked
from .config import ModelConfig, canonical_tensors, layer_tensors

VOCAB_PADDING = 64


def pad_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    return -(-vocab // pad_to) * pad_to


def _split(total: int, n: int, i: int, what: str) -> tuple[int, int]:
    if total % n:
        raise LayoutError(f"{what}: {total} is not divisible by {n}")
    return split_range(total, n, i, "exact")


# ----------------------------------------------------------------------------------- buffer primitives

def replicated(name: str, tensor: str, shape: Sequence[int], dtype: str) -> Buffer:
    full = Box.full(shape)
    return Buffer(name, tuple(shape), dtype, (Piece(tensor, full, full),))


def sharded(name: str, tensor: str, shape: Sequence[int], dtype: str, n: int, i: int, dim: int = 0) -> Buffer:
    """``ColumnParallelLinear`` (dim 0) / ``RowParallelLinear`` (dim 1) shard ``i`` of ``n``."""
    off, size = _split(shape[dim], n, i, f"{name} dim {dim}")
    offs, sizes = [0] * len(shape), list(shape)
    offs[dim], sizes[dim] = off, size
    box = Box(tuple(offs), tuple(sizes))
    return Buffer(name, box.sizes, dtype, (Piece(tensor, box, Box.full(box.sizes)),))


def merged_column(name: str, parts: Sequence[tuple[str, Sequence[int]]], dtype: str, n: int, i: int) -> Buffer:
    """``MergedColumnParallelLinear``: shard ``i`` of every part, stacked (``[gate_r; up_r]``)."""
    boxes = []
    for tensor, shape in parts:
        off, size = _split(shape[0], n, i, f"{name} part {tensor}")
        boxes.append((tensor, Box((off,) + (0,) * (len(shape) - 1), (size,) + tuple(shape[1:]))))
    return stacked(name, dtype, boxes)


def qkv_parallel(name: str, q: str, k: str, v: str, heads: int, kv_heads: int, head_dim: int, cols: tuple[int, ...],
                 dtype: str, n: int, i: int) -> Buffer:
    """``QKVParallelLinear``: ``[q_r; k_r; v_r]``; with ``n > kv_heads`` each KV head is replicated
    on ``n / kv_heads`` consecutive ranks (``k`` shard = ``i // replicas``)."""
    if heads % n:
        raise LayoutError(f"{name}: {heads} attention heads are not divisible by tp={n}")
    if n >= kv_heads:
        if n % kv_heads:
            raise LayoutError(f"{name}: tp={n} is not a multiple of {kv_heads} KV heads")
        kv_loc, kv_idx = 1, i // (n // kv_heads)
    else:
        if kv_heads % n:
            raise LayoutError(f"{name}: {kv_heads} KV heads are not divisible by tp={n}")
        kv_loc, kv_idx = kv_heads // n, i
    q_loc = heads // n
    z = (0,) * len(cols)
    return stacked(name, dtype, [(q, Box((i * q_loc * head_dim,) + z, (q_loc * head_dim,) + cols)),
                                 (k, Box((kv_idx * kv_loc * head_dim,) + z, (kv_loc * head_dim,) + cols)),
                                 (v, Box((kv_idx * kv_loc * head_dim,) + z, (kv_loc * head_dim,) + cols))])


def vocab_parallel(name: str, tensor: str, vocab: int, hidden: int, dtype: str, n: int, i: int,
                   pad_to: int = VOCAB_PADDING) -> Buffer:
    """``VocabParallelEmbedding`` / ``ParallelLMHead`` shard: rows ``[i*per, (i+1)*per)`` of the
    vocab padded to ``pad_to``; rows past the real vocab are padding (zero-filled)."""
    padded = pad_vocab(vocab, pad_to)
    if padded % n:
        raise LayoutError(f"{name}: padded vocab {padded} is not divisible by {n}")
    per = padded // n
    lo = i * per
    real = max(0, min(per, vocab - lo))
    pieces = (Piece(tensor, Box((lo, 0), (real, hidden)), Box((0, 0), (real, hidden))),) if real else ()
    return Buffer(name, (per, hidden), dtype, pieces)


@lru_cache(maxsize=4096)
def _runs(ids: tuple[int, ...]) -> tuple[tuple[int, int, int], ...]:
    """(local start, global start, length) of the consecutive runs of ``ids``."""
    out: list[tuple[int, int, int]] = []
    for loc, g in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == g:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((loc, g, 1))
    return tuple(out)


@lru_cache(maxsize=4096)
def _w13_boxes(experts: tuple[int, ...], inter: int, hidden: int, m: int, j: int) -> tuple:
    """(offset, size) of MoE-TP shard ``j`` of ``m`` of the intermediate dim and (gate box, its local
    box, up box, its local box) per run of ``experts``: the same for every layer, made once (boxes
    are immutable).  ``inter`` must divide by ``m``."""
    off, size = split_range(inter, m, j, "exact")
    return off, size, tuple((Box((g, off, 0), (n, size, hidden)), Box((loc, 0, 0), (n, size, hidden)),
                             Box((g, inter + off, 0), (n, size, hidden)), Box((loc, size, 0), (n, size, hidden)))
                            for loc, g, n in _runs(experts))


@lru_cache(maxsize=4096)
def _w2_boxes(experts: tuple[int, ...], inter: int, hidden: int, m: int, j: int) -> tuple:
    """(offset, size) and (down box, its local box) per run of ``experts`` (see :func:`_w13_boxes`)."""
    off, size = split_range(inter, m, j, "exact")
    return off, size, tuple((Box((g, 0, off), (n, hidden, size)), Box((loc, 0, 0), (n, hidden, size)))
                            for loc, g, n in _runs(experts))


def experts_w13(name: str, gate_up: str, experts: Sequence[int], inter: int, hidden: int, dtype: str, m: int, j: int,
                shared: tuple[str, str] | None = None) -> Buffer:
    """``FusedMoE`` ``w13_weight`` ``[E_loc (+1), 2*I/m, H]``: per local expert ``[gate_j; up_j]``
    (``weight_loader`` narrows w1/w3 on dim 0 by the MoE-TP rank ``j``).  ``shared`` =
    (gate_proj, up_proj) of a shared expert fused as the last slot (SGLang)."""
    if inter % m:
        _split(inter, m, j, f"{name} intermediate")          # raises, naming the buffer
    off, size, runs = _w13_boxes(tuple(experts), inter, hidden, m, j)
    pieces = []
    for gate, gate_loc, up, up_loc in runs:
        pieces.append(Piece(gate_up, gate, gate_loc))
        pieces.append(Piece(gate_up, up, up_loc))
    slots = len(experts)
    if shared is not None:
        pieces.append(Piece(shared[0], Box((off, 0), (size, hidden)), Box((slots, 0, 0), (1, size, hidden))))
        pieces.append(Piece(shared[1], Box((off, 0), (size, hidden)), Box((slots, size, 0), (1, size, hidden))))
        slots += 1
    return Buffer(name, (slots, 2 * size, hidden), dtype, tuple(pieces))


def experts_w2(name: str, down: str, experts: Sequence[int], inter: int, hidden: int, dtype: str, m: int, j: int,
               shared: str | None = None) -> Buffer:
    """``FusedMoE`` ``w2_weight`` ``[E_loc (+1), H, I/m]`` (w2 narrowed on dim 1)."""
    if inter % m:
        _split(inter, m, j, f"{name} intermediate")          # raises, naming the buffer
    off, size, runs = _w2_boxes(tuple(experts), inter, hidden, m, j)
    pieces = [Piece(down, box, loc) for box, loc in runs]
    slots = len(experts)
    if shared is not None:
        pieces.append(Piece(shared, Box((0, off), (hidden, size)), Box((slots, 0, 0), (1, hidden, size))))
        slots += 1
    return Buffer(name, (slots, hidden, size), dtype, tuple(pieces))


def linear_expert_map(num_experts: int, ep: int, ep_rank: int) -> range:
    """vLLM ``determine_expert_map`` ('linear'): remainder to the first ranks."""
    base, rem = divmod(num_experts, ep)
    start = ep_rank * base + min(ep_rank, rem)
    return range(start, start + base + (1 if ep_rank < rem else 0))


# ----------------------------------------------------------------------------- what each rank holds

@dataclass(frozen=True)
class RankShards:
    """The shards one rank holds of each kind of weight: ``(size, rank)`` splits, experts, stage."""
    attn: tuple[int, int]
    dense: tuple[int, int]
    shared: tuple[int, int]
    embed: tuple[int, int] | None          # None: no embedding on this rank
    head: tuple[int, int] | None           # None: no lm_head on this rank
    final_norm: bool
    moe_tp: tuple[int, int]                # (m, j)
    experts: tuple[int, ...]               # global ids of the local experts, in slot order
    fuse_shared: bool                      # shared expert as the last w13/w2 slot (SGLang)
    layers: tuple[int, int]                # main-model layers [start, end)


@dataclass(frozen=True)
class EngineNames:
    fused_qkv_a: str = "self_attn.fused_qkv_a_proj.weight"
    experts: str = "mlp.experts.routed_experts."


class _RankBuffers:
    """The bookkeeping of a layout built rank by rank: buffers added per rank, each distinct buffer
    object checked once and shared between ranks, unused tensors dropped at the end."""

    def __init__(self, cfg: ModelConfig, dtype: str, names: EngineNames):
        self.cfg, self.dtype, self.names = cfg, dtype, names
        self.layout = Layout()
        for m in canonical_tensors(cfg, dtype):
            self.layout.add_tensor(m.name, m.shape, m.dtype)
        self._cache: dict = {}
        self._shapes: dict[int, dict] = {}

    def shapes(self, layer: int) -> dict:
        if layer not in self._shapes:
            self._shapes[layer] = {k: s for k, (s, _) in layer_tensors(self.cfg, layer, self.dtype).items()}
        return self._shapes[layer]

    def add(self, rank: int, buffers: Iterable[Buffer]) -> None:
        add = self.layout.add_buffer        # checks each distinct buffer object once
        for b in buffers:
            add(rank, b)

    def cached(self, key, fn):
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = fn()
        return out

    def finish(self) -> Layout:
        distinct: dict[int, Buffer] = {}        # id -> buffer, each shared buffer once (no loop per rank in Python)
        for bufs in self.layout.buffers.values():
            distinct.update(zip(map(id, bufs.values()), bufs.values()))
        used = {p.tensor for b in distinct.values() for p in b.pieces}
        for name in [n for n in self.layout.tensors if n not in used]:
            del self.layout.tensors[name]
        return self.layout



class LayoutBuilder(_RankBuffers):
    """Builds an engine layout rank by rank, sharing identical buffers between ranks (a buffer is
    checked once, then reused), so that 671B x 256 ranks builds in seconds: the engine's buffers
    of a decoder layer, the vocabulary and the whole main model of one rank."""

    def layer(self, layer: int, rt: str, shards: RankShards) -> list[Buffer]:
        """Buffers of canonical layer ``layer`` under runtime prefix ``rt`` (e.g.
        ``model.layers.3.`` or ``model.layers.61.mtp_block.``): :meth:`layer_parts`, flattened."""
        return [b for part in self.layer_parts(layer, rt, shards) for b in part]

    def layer_parts(self, layer: int, rt: str, shards: RankShards, experts: bool = True) -> list:
        """The buffers of :meth:`layer` in parts cached by what they depend on (replicated, attention,
        experts, shared experts or dense MLP), so that ranks share buffer objects wherever their
        boxes agree, and the part tuples themselves (:meth:`Layout.add_buffers`: checked once).
        ``experts=False``: None in the routed experts' place."""
        cfg = self.cfg
        out = [self.cached(("rep", layer, rt), lambda: tuple(self._replicated(layer, rt))),
               self.cached(("attn", layer, rt, shards.attn), lambda: tuple(self._attn(layer, rt, *shards.attn)))]
        c = f"model.layers.{layer}."
        if cfg.is_moe_layer(layer):
            out.append(self.experts_part(layer, rt, shards) if experts else None)
            if cfg.n_shared_experts and not shards.fuse_shared:
                out.append(self.cached(("shared", layer, rt, shards.shared), lambda: tuple(
                    self._mlp(rt, c, self.shapes(layer), shards.shared, "mlp.shared_experts"))))
        else:
            out.append(self.cached(("dense", layer, rt, shards.dense),
                                   lambda: tuple(self._mlp(rt, c, self.shapes(layer), shards.dense, "mlp"))))
        return out

    def experts_part(self, layer: int, rt: str, shards: RankShards) -> tuple[Buffer, ...]:
        """Layer ``layer``'s routed experts (``w13_weight``, ``w2_weight``) on a rank with ``shards``."""
        return self.cached(("experts", layer, rt, shards.moe_tp, shards.experts, shards.fuse_shared),
                           lambda: tuple(self._experts(layer, rt, shards)))

    def _skeleton(self, shards: RankShards) -> tuple[list, list[tuple[int, int, str]]]:
        """A rank's layer parts without its routed experts (None in their place: the same for every
        rank with these attention / MLP shards) and (place, layer, prefix) of each expert part."""
        parts: list = []
        slots = []
        for layer in range(*shards.layers):
            rt = f"model.layers.{layer}."
            for part in self.layer_parts(layer, rt, shards, experts=False):
                if part is None:
                    slots.append((len(parts), layer, rt))
                parts.append(part)
        return parts, slots

    def _replicated(self, layer: int, rt: str) -> list[Buffer]:
        """Norms, router, fused q/kv down-projection: the same on every rank."""
        cfg, dt, S = self.cfg, self.dtype, self.shapes(layer)
        c = f"model.layers.{layer}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        out = []
        if cfg.is_mla:
            if cfg.q_lora_rank:
                qa, kva = "self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"
                out.append(merged_column(rt + self.names.fused_qkv_a, [(c + qa, S[qa]), (c + kva, S[kva])], dt, 1, 0))
                names.append("self_attn.q_a_layernorm.weight")
            else:
                names.append("self_attn.kv_a_proj_with_mqa.weight")
            names.append("self_attn.kv_a_layernorm.weight")
        elif cfg.qk_norm:
            names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        if cfg.is_moe_layer(layer):
            names.append("mlp.gate.weight")
            if cfg.router_bias:
                names.append("mlp.gate.e_score_correction_bias")
        tensors = self.layout.tensors
        return out + [replicated(rt + s, c + s, S[s], tensors[c + s].dtype) for s in names]

    def _attn(self, layer: int, rt: str, n: int, i: int) -> list[Buffer]:
        """Column-parallel q/kv up-projections (or fused qkv) and the row-parallel o_proj."""
        cfg, dt, S = self.cfg, self.dtype, self.shapes(layer)
        c = f"model.layers.{layer}."
        cols = ["self_attn.q_b_proj.weight" if cfg.q_lora_rank else "self_attn.q_proj.weight",
                "self_attn.kv_b_proj.weight"] if cfg.is_mla else []
        out = [sharded(rt + s, c + s, S[s], dt, n, i) for s in cols]
        if not cfg.is_mla:
            hd, H = cfg.head_dim, cfg.hidden_size
            qkv = [c + f"self_attn.{p}_proj.weight" for p in "qkv"]
            out.append(qkv_parallel(rt + "self_attn.qkv_proj.weight", *qkv, cfg.num_attention_heads,
                                    cfg.num_key_value_heads, hd, (H,), dt, n, i))
            if cfg.attention_bias:
                qkvb = [c + f"self_attn.{p}_proj.bias" for p in "qkv"]
                out.append(qkv_parallel(rt + "self_attn.qkv_proj.bias", *qkvb, cfg.num_attention_heads,
                                        cfg.num_key_value_heads, hd, (), dt, n, i))
        out.append(sharded(rt + "self_attn.o_proj.weight", c + "self_attn.o_proj.weight", S["self_attn.o_proj.weight"],
                           dt, n, i, dim=1))
        return out

    def _mlp(self, rt: str, c: str, S: dict, split: tuple[int, int], stem: str) -> list[Buffer]:
        """``gate_up_proj`` (merged column, ``[gate_r; up_r]``) and row-parallel ``down_proj``."""
        n, i = split
        g, u, d = (f"{stem}.{p}_proj.weight" for p in ("gate", "up", "down"))
        return [merged_column(rt + f"{stem}.gate_up_proj.weight", [(c + g, S[g]), (c + u, S[u])], self.dtype, n, i),
                sharded(rt + d, c + d, S[d], self.dtype, n, i, dim=1)]

    def _experts(self, layer: int, rt: str, shards: RankShards) -> list[Buffer]:
        cfg, dt = self.cfg, self.dtype
        c = f"model.layers.{layer}."
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        m, j = shards.moe_tp
        shared13 = shared2 = None
        if shards.fuse_shared:
            if cfg.shared_intermediate_size != I:
                raise LayoutError(f"cannot fuse {cfg.n_shared_experts} shared experts of {cfg.shared_intermediate_size} "
                                  f"into expert slots of {I}")
            shared13 = (c + "mlp.shared_experts.gate_proj.weight", c + "mlp.shared_experts.up_proj.weight")
            shared2 = c + "mlp.shared_experts.down_proj.weight"
        ex = self.names.experts
        return [experts_w13(rt + ex + "w13_weight", c + "mlp.experts.gate_up_proj", shards.experts, I, H, dt, m, j, shared13),
                experts_w2(rt + ex + "w2_weight", c + "mlp.experts.down_proj", shards.experts, I, H, dt, m, j, shared2)]

    # ------------------------------------------------------------------ globals
    def vocab(self, rt_name: str, tensor: str, split: tuple[int, int]) -> Buffer:
        cfg = self.cfg
        return self.cached(("vocab", rt_name, tensor, split), lambda: vocab_parallel(
            rt_name, tensor, cfg.vocab_size, cfg.hidden_size, self.dtype, *split))

    def whole(self, rt_name: str, tensor: str) -> Buffer:
        meta = self.layout.tensors[tensor]
        return self.cached(("whole", rt_name, tensor), lambda: replicated(rt_name, tensor, meta.shape, meta.dtype))

    def main_model(self, rank: int, shards: RankShards) -> None:
        cfg = self.cfg
        head_tensor = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        if shards.embed is not None:
            self.add(rank, [self.vocab("model.embed_tokens.weight", "model.embed_tokens.weight", shards.embed)])
        skeleton, slots = self.cached(("layers", shards.layers, shards.attn, shards.shared, shards.dense,
                                       shards.fuse_shared), lambda: self._skeleton(shards))
        parts = list(skeleton)
        for i, layer, rt in slots:
            parts[i] = self.experts_part(layer, rt, shards)
        self.layout.add_parts(rank, parts)
        if shards.final_norm:
            self.add(rank, [self.whole("model.norm.weight", "model.norm.weight")])
        if shards.head is not None:
            self.add(rank, [self.vocab("lm_head.weight", head_tensor, shards.head)])


def pp_partition(num_layers: int, pp: int, partition: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """vLLM ``get_pp_indices``: even split, remainder to the stages counting back from the
    second-to-last (61 layers, pp=4 -> 15, 15, 16, 15); ``partition`` overrides it
    (``VLLM_PP_LAYER_PARTITION``)."""
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp or sum(sizes) != num_layers:
            raise LayoutError(f"pp partition {sizes} does not split {num_layers} layers into {pp} stages")
    else:
        sizes = [num_layers // pp] * pp
        for k in range(2, num_layers % pp + 2):
            sizes[-k] += 1
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


# vLLM 0.33 ``ParallelConfig.use_sequence_parallel_moe``: with one of these all-to-all backends, EP,
# TP > 1 and DP > 1, the MoE input is sequence-parallel and the shared experts are whole on every rank.
SEQUENCE_PARALLEL_MOE_BACKENDS = ("allgather_reducescatter", "deepep_high_throughput", "deepep_low_latency",
                                  "deepep_v2", "flashinfer_nvlink_one_sided", "passthrough", "mori_high_throughput",
                                  "mori_low_latency", "nixl_ep")
# ``needs_round_robin_routing_tables``: the only all-to-all backends that keep round-robin placement.
ROUND_ROBIN_BACKENDS = ("deepep_low_latency", "nixl_ep")
DEFAULT_ALL2ALL_BACKEND = "allgather_reducescatter"


def sequence_parallel_moe(tp: int, dp: int, enable_expert_parallel: bool,
                          all2all_backend: str = DEFAULT_ALL2ALL_BACKEND) -> bool:
    """vLLM ``ParallelConfig.use_sequence_parallel_moe``."""
    return all2all_backend in SEQUENCE_PARALLEL_MOE_BACKENDS and enable_expert_parallel and tp > 1 and dp > 1


def effective_expert_placement(config: ModelConfig, placement: str, tp: int, dp: int, enable_expert_parallel: bool,
                               all2all_backend: str = DEFAULT_ALL2ALL_BACKEND) -> str:
    """The placement vLLM really uses (``determine_expert_placement_strategy``, 0.33): round-robin
    falls back to linear unless the model has several expert groups (DeepSeek ``n_group > 1``;
    Qwen3-MoE has none) and, when the all-to-all kernels are in use (EP with DP > 1, or
    sequence-parallel MoE), the backend is DeepEP low-latency or NIXL EP."""
    if placement != "round_robin":
        return placement
    groups = config.n_group if config.family == "deepseek_v3" else 1
    if groups <= 1:
        return "linear"
    all2all = enable_expert_parallel and (dp > 1 or sequence_parallel_moe(tp, dp, enable_expert_parallel,
                                                                            all2all_backend))
    if all2all and all2all_backend not in ROUND_ROBIN_BACKENDS:
        return "linear"
    return placement


@paused_gc()
def vllm_layout(config: ModelConfig, tp: int, dp: int = 1, enable_expert_parallel: bool = False,
                rank_offset: int = 0, dtype: str = "bfloat16", names: str = "current", *, pp: int = 1,
                pp_layer_partition: Sequence[int] | None = None, expert_placement: str = "linear",
                all2all_backend: str = DEFAULT_ALL2ALL_BACKEND, mtp: bool = False, mtp_prefix: str = "mtp.") -> Layout:
    """Layout of every rank of a vLLM deployment of ``config`` (``dp * pp * tp`` ranks).

    ``expert_placement`` is the configured ``expert_placement_strategy``; the layout uses the one
    vLLM really applies (:func:`effective_expert_placement`).  ``all2all_backend`` (vLLM's
    ``--all2all-backend``) decides that and whether the MoE is sequence-parallel
    (:func:`sequence_parallel_moe`: shared experts whole on every rank)."""
    if names not in ("current", "legacy"):
        raise ValueError(f"names must be 'current' or 'legacy', not {names!r}")
    if expert_placement not in ("linear", "round_robin"):
        raise ValueError(f"expert_placement must be 'linear' or 'round_robin', not {expert_placement!r}")
    cfg = config
    expert_placement = effective_expert_placement(cfg, expert_placement, tp, dp, enable_expert_parallel, all2all_backend)
    sp_moe = sequence_parallel_moe(tp, dp, enable_expert_parallel, all2all_backend)
    if mtp and not cfg.mtp_layers:
        raise LayoutError("mtp=True but the config has no MTP layers (num_nextn_predict_layers = 0)")
    if mtp and pp > 1:
        raise LayoutError("MTP draft model with pp > 1 is not modelled")
    b = LayoutBuilder(cfg, dtype, EngineNames(experts="mlp.experts.routed_experts." if names == "current" else "mlp.experts."))
    stages = pp_partition(cfg.num_hidden_layers, pp, pp_layer_partition)
    E = cfg.n_routed_experts
    for d in range(dp):
        for s in range(pp):
            for t in range(tp):
                rank = rank_offset + (d * pp + s) * tp + t
                flat = d * tp + t
                if enable_expert_parallel and dp * tp > 1:
                    ep = dp * tp
                    if expert_placement == "linear":
                        experts = tuple(linear_expert_map(E, ep, flat))
                    else:
                        experts = tuple(range(flat, E, ep))
                    moe_tp = (1, 0)
                else:
                    experts, moe_tp = tuple(range(E)), (dp * tp, flat)
                first, last = s == 0, s == pp - 1
                shards = RankShards(
                    attn=(tp, t), dense=(tp, t), shared=(1, 0) if sp_moe else (tp, t),
                    embed=(tp, t) if first or (last and cfg.tie_word_embeddings) else None,
                    head=(tp, t) if last and not cfg.tie_word_embeddings else None,
                    final_norm=last, moe_tp=moe_tp, experts=experts, fuse_shared=False, layers=stages[s])
                b.main_model(rank, shards)
                if mtp:
                    _vllm_mtp(b, rank, shards, mtp_prefix)
    return b.finish()


def _vllm_mtp(b: LayoutBuilder, rank: int, shards: RankShards, prefix: str) -> None:
    cfg = b.cfg
    head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
    bufs = [b.vocab(prefix + "model.embed_tokens.weight", "model.embed_tokens.weight", shards.attn)]
    for layer in cfg.mtp_layers:
        p, c = f"{prefix}model.layers.{layer}.", f"model.layers.{layer}."
        for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"):
            bufs.append(b.whole(p + s, c + s))
        bufs.append(b.vocab(p + "shared_head.head.weight", head, shards.attn))
        bufs += b.layer(layer, p + "mtp_block.", shards)
    b.add(rank, bufs)


__all__ = ["DEFAULT_ALL2ALL_BACKEND", "EngineNames", "effective_expert_placement", "sequence_parallel_moe", "LayoutBuilder", "RankShards", "experts_w13", "experts_w2", "linear_expert_map",
           "merged_column", "pad_vocab", "pp_partition", "qkv_parallel", "replicated", "sharded", "vllm_layout",
           "vocab_parallel"]
