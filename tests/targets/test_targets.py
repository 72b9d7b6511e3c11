"""Inference target layouts (HF, vLLM, SGLang) against an independent re-implementation of the
engines' weight loaders.

For every case: full random canonical tensors are written out in Hugging Face checkpoint form
(per-expert ``mlp.experts.{e}.gate_proj.weight``, MTP embed/head copies), fed to a small emulation
of the engine's ``load_weights`` (module tree with each layer's own ``weight_loader``:
``stacked_params_mapping``, merged-column / QKV / row / vocab-parallel narrowing,
``FusedMoE.weight_loader`` with the global->local expert map and MoE-TP narrowing of w1/w3 on dim
0 and w2 on dim 1), and every resulting parameter must equal what ``materialize(layout, rank,
full)`` cuts for that rank.  The emulation never looks at the layout; it only shares the config.
"""
from __future__ import annotations

import time
import zlib

import pytest
import torch

from mcore_reshard.core.planner import make_plan
from mcore_reshard.mapper.family import load_family
from mcore_reshard.targets import (
    canonical_tensors,
    dsv3_671b,
    dsv3_tiny,
    from_hf_config,
    gqa_tiny,
    hf_layout,
    pp_partition,
    qwen3_moe_tiny,
    sglang_layout,
    vllm_layout,
)
from mcore_reshard.tools.synthetic import materialize

NAN = float("nan")
OFFSET = 1          # target ranks start after the HF source rank 0


# ----------------------------------------------------------------------------------- tensors

def full_tensors(cfg) -> dict[str, torch.Tensor]:
    out = {}
    for m in canonical_tensors(cfg, "float32"):
        g = torch.Generator().manual_seed(zlib.crc32(m.name.encode()))
        out[m.name] = torch.randn(m.shape, generator=g)
    return out


def checkpoint(cfg, full) -> dict[str, torch.Tensor]:
    """The HF checkpoint: per-expert tensors, and DeepSeek's MTP copies of embedding and head."""
    out = {}
    for name, t in full.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p, inter = name[: -len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{p}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{p}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    for k in range(cfg.num_nextn_predict_layers if cfg.family == "deepseek_v3" else 0):
        L = cfg.num_hidden_layers + k
        out[f"model.layers.{L}.embed_tokens.weight"] = full["model.embed_tokens.weight"]
        out[f"model.layers.{L}.shared_head.head.weight"] = full["lm_head.weight"]
    return out


# ----------------------------------------------------------------------------------- module emulation

def _copy(dst, src):
    assert dst.shape == src.shape, (dst.shape, src.shape)
    dst.copy_(src)


class Ref:
    """Parameters of one rank's model and their weight loaders."""

    def __init__(self):
        self.p: dict[str, torch.Tensor] = {}
        self.load: dict = {}

    def _add(self, name, shape, fn):
        assert name not in self.p, name
        self.p[name] = torch.full(tuple(shape), NAN)
        self.load[name] = fn

    def replicated(self, name, shape):
        self._add(name, shape, lambda prm, w, sid=None: _copy(prm, w))

    def column(self, name, out, inn, n, i):                       # ColumnParallelLinear
        size = out // n
        assert size * n == out
        self._add(name, (size, inn), lambda prm, w, sid=None: _copy(prm, w.narrow(0, i * size, size)))

    def row(self, name, out, inn, n, i):                          # RowParallelLinear
        size = inn // n
        assert size * n == inn
        self._add(name, (out, size), lambda prm, w, sid=None: _copy(prm, w.narrow(1, i * size, size)))

    def merged(self, name, outs, inn, n, i):                      # MergedColumnParallelLinear
        sizes = [o // n for o in outs]

        def load(prm, w, sid):
            off = sum(sizes[:sid])
            _copy(prm[off:off + sizes[sid]], w.narrow(0, i * sizes[sid], sizes[sid]))
        self._add(name, (sum(sizes), inn), load)

    def qkv(self, name, nh, nkv, hd, inn, n, i):                  # QKVParallelLinear (inn None: bias)
        q = nh // n * hd
        if n >= nkv:
            kv, kv_rank = hd, i // (n // nkv)                      # num_kv_head_replicas = n / nkv
        else:
            kv, kv_rank = nkv // n * hd, i
        where = {"q": (0, q, i), "k": (q, kv, kv_rank), "v": (q + kv, kv, kv_rank)}

        def load(prm, w, sid):
            off, size, r = where[sid]
            _copy(prm[off:off + size], w.narrow(0, r * size, size))
        self._add(name, (q + 2 * kv,) if inn is None else (q + 2 * kv, inn), load)

    def vocab(self, name, V, H, n, i):                            # VocabParallelEmbedding / ParallelLMHead
        padded = (V + 63) // 64 * 64
        per = padded // n
        assert per * n == padded
        start = i * per
        real = max(0, min(per, V - start))

        def load(prm, w, sid=None):
            prm[:real].copy_(w[start:start + real])
            prm[real:].fill_(0)
        self._add(name, (per, H), load)

    def fused_moe(self, prefix, slots, inter, H, m, j):           # FusedMoE
        size = inter // m
        local = {g: s for s, g in enumerate(slots)}

        def w13(prm, w, sid, e):
            if e not in local:
                return False
            half = 0 if sid == "w1" else size
            _copy(prm[local[e], half:half + size], w.narrow(0, j * size, size))
            return True

        def w2(prm, w, sid, e):
            if e not in local:
                return False
            _copy(prm[local[e]], w.narrow(1, j * size, size))
            return True
        self._add(prefix + "w13_weight", (len(slots), 2 * size, H), w13)
        self._add(prefix + "w2_weight", (len(slots), H, size), w2)


def is_moe(cfg, L):
    if not cfg.n_routed_experts:
        return False
    if cfg.model_type == "qwen3_moe":
        return L not in cfg.mlp_only_layers and (L + 1) % cfg.decoder_sparse_step == 0
    return L >= cfg.first_k_dense_replace and L % cfg.moe_layer_freq == 0


def decoder_layer(ref, cfg, L, rt, *, attn, dense, shared, moe_tp, slots, fuse, fused_a, experts_prefix):
    """One decoder layer's modules (vLLM and SGLang build the same ones; names differ)."""
    H = cfg.hidden_size
    ref.replicated(rt + "input_layernorm.weight", (H,))
    ref.replicated(rt + "post_attention_layernorm.weight", (H,))
    n, i = attn
    if cfg.model_type == "deepseek_v3":
        nh, qk = cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank:
            parts = [cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim]
            if fused_a.endswith("_with_mqa.weight"):                # SGLang: ReplicatedLinear, loaded by cat
                ref.replicated(rt + fused_a, (sum(parts), H))
            else:                                                   # vLLM: MergedColumnParallel, disable_tp
                ref.merged(rt + fused_a, parts, H, 1, 0)
            ref.replicated(rt + "self_attn.q_a_layernorm.weight", (cfg.q_lora_rank,))
            ref.column(rt + "self_attn.q_b_proj.weight", nh * qk, cfg.q_lora_rank, n, i)
        else:
            ref.column(rt + "self_attn.q_proj.weight", nh * qk, H, n, i)
            ref.replicated(rt + "self_attn.kv_a_proj_with_mqa.weight", (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H))
        ref.replicated(rt + "self_attn.kv_a_layernorm.weight", (cfg.kv_lora_rank,))
        ref.column(rt + "self_attn.kv_b_proj.weight", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, n, i)
        ref.row(rt + "self_attn.o_proj.weight", H, nh * cfg.v_head_dim, n, i)
    else:
        hd = cfg.head_dim
        ref.qkv(rt + "self_attn.qkv_proj.weight", cfg.num_attention_heads, cfg.num_key_value_heads, hd, H, n, i)
        if cfg.attention_bias:
            ref.qkv(rt + "self_attn.qkv_proj.bias", cfg.num_attention_heads, cfg.num_key_value_heads, hd, None, n, i)
        if cfg.qk_norm:
            ref.replicated(rt + "self_attn.q_norm.weight", (hd,))
            ref.replicated(rt + "self_attn.k_norm.weight", (hd,))
        ref.row(rt + "self_attn.o_proj.weight", H, cfg.num_attention_heads * hd, n, i)
    if is_moe(cfg, L):
        E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
        ref.replicated(rt + "mlp.gate.weight", (E, H))
        if cfg.model_type == "deepseek_v3":
            ref.replicated(rt + "mlp.gate.e_score_correction_bias", (E,))
        ref.fused_moe(rt + experts_prefix, slots, inter, H, *moe_tp)
        if cfg.n_shared_experts and not fuse:
            Is = inter * cfg.n_shared_experts
            ref.merged(rt + "mlp.shared_experts.gate_up_proj.weight", [Is, Is], H, *shared)
            ref.row(rt + "mlp.shared_experts.down_proj.weight", H, Is, *shared)
    else:
        inter = cfg.intermediate_size
        ref.merged(rt + "mlp.gate_up_proj.weight", [inter, inter], H, *dense)
        ref.row(rt + "mlp.down_proj.weight", H, inter, *dense)


STACKED = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
           ("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v")]


def expert_mapping(num_experts, prefix):
    return [(prefix + ("w2_" if sid == "w2" else "w13_"), f"experts.{e}.{proj}.", e, sid)
            for e in range(num_experts) for proj, sid in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))]


def load_weights(ref, weights, stacked, experts):
    """The ``load_weights`` loop shared by vLLM's and SGLang's DeepSeek / Llama / Qwen3-MoE."""
    for name, w in weights:
        for pname, wname, sid in stacked:
            if wname not in name:
                continue
            if "mlp.experts." in name and name not in ref.p:
                continue
            mapped = name.replace(wname, pname)
            if mapped not in ref.p:
                continue
            ref.load[mapped](ref.p[mapped], w, sid)
            break
        else:
            is_expert = False
            for pname, wname, e, sid in experts:
                if wname not in name:
                    continue
                is_expert = True
                mapped = name.replace(wname, pname)
                if mapped in ref.p and ref.load[mapped](ref.p[mapped], w, sid, e):
                    break
            else:
                if is_expert or name not in ref.p:   # non-local expert / parameter of another PP stage
                    continue
                ref.load[name](ref.p[name], w)


# ----------------------------------------------------------------------------------- vLLM reference

def vllm_reference(cfg, ckpt, rank, tp, dp=1, enable_expert_parallel=False, names="current", pp=1,
                   expert_placement="linear", mtp=False, mtp_prefix="mtp."):
    local = rank - OFFSET
    t, s, d = local % tp, (local // tp) % pp, local // (tp * pp)
    E, N = cfg.n_routed_experts, cfg.num_hidden_layers
    # vLLM 0.33 (checked against the real loaders in test_engines.py): round-robin needs several
    # expert groups and, with DP > 1 (all-to-all kernels), the DeepEP-LL / NIXL backends; with EP,
    # TP > 1 and DP > 1 the MoE is sequence-parallel and the shared experts are whole.
    if expert_placement == "round_robin" and (getattr(cfg, "n_group", 1) <= 1 or dp > 1 or cfg.family != "deepseek_v3"):
        expert_placement = "linear"
    sp_moe = enable_expert_parallel and tp > 1 and dp > 1
    if enable_expert_parallel and dp * tp > 1:
        ep, r = dp * tp, d * tp + t
        if expert_placement == "linear":
            base, rem = divmod(E, ep)
            first = r * base + min(r, rem)
            slots = list(range(first, first + base + (r < rem)))
        else:
            slots = list(range(r, E, ep))
        moe_tp = (1, 0)
    else:
        slots, moe_tp = list(range(E)), (dp * tp, d * tp + t)
    per, rem = divmod(N, pp)
    sizes = [per] * pp
    for k in range(rem):
        sizes[pp - 2 - k] += 1
    start = sum(sizes[:s])
    xp = "mlp.experts.routed_experts." if names == "current" else "mlp.experts."
    kw = dict(attn=(tp, t), dense=(tp, t), shared=(1, 0) if sp_moe else (tp, t), moe_tp=moe_tp, slots=slots,
              fuse=False, fused_a="self_attn.fused_qkv_a_proj.weight", experts_prefix=xp)
    ref = Ref()
    V, H = cfg.vocab_size, cfg.hidden_size
    first, last = s == 0, s == pp - 1
    if first or (last and cfg.tie_word_embeddings):
        ref.vocab("model.embed_tokens.weight", V, H, tp, t)
    for L in range(start, start + sizes[s]):
        decoder_layer(ref, cfg, L, f"model.layers.{L}.", **kw)
    if last:
        ref.replicated("model.norm.weight", (H,))
        if not cfg.tie_word_embeddings:
            ref.vocab("lm_head.weight", V, H, tp, t)
    stacked = STACKED + [("fused_qkv_a_proj", "q_a_proj", 0), ("fused_qkv_a_proj", "kv_a_proj_with_mqa", 1)]
    experts = expert_mapping(E, xp.removeprefix("mlp."))
    main = [(n, w) for n, w in ckpt.items() if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= N)]
    load_weights(ref, main, stacked, experts)
    out = dict(ref.p)
    if mtp:                                                        # DeepSeekMTP draft model
        draft = Ref()
        draft.vocab("model.embed_tokens.weight", V, H, tp, t)
        for L in range(N, N + cfg.num_nextn_predict_layers):
            p = f"model.layers.{L}."
            for nm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
                draft.replicated(p + nm, (H,))
            draft.replicated(p + "eh_proj.weight", (H, 2 * H))
            draft.vocab(p + "shared_head.head.weight", V, H, tp, t)
            decoder_layer(draft, cfg, L, p + "mtp_block.", **kw)
        spec = []
        for n, w in ckpt.items():
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < N:
                continue
            L = int(n.split(".")[2])
            if "embed_tokens" in n:
                if L != N:
                    continue
                n = n.replace(f"model.layers.{L}.", "model.")
            elif not any(k in n for k in ("enorm", "hnorm", "eh_proj", "shared_head")):
                n = n.replace(f"model.layers.{L}.", f"model.layers.{L}.mtp_block.")
            spec.append((n, w))
        load_weights(draft, spec, stacked, experts)
        out.update({mtp_prefix + n: v for n, v in draft.p.items()})
    return out


# ----------------------------------------------------------------------------------- SGLang reference

def sglang_reference(cfg, ckpt, rank, tp, dp=1, ep=1, enable_dp_attention=False, fuse_shared_expert=None,
                     moe_a2a_backend="none", moe_dense_tp_size=None, enable_dp_lm_head=False, mtp=False,
                     mtp_prefix="mtp."):
    t = (rank - OFFSET) % tp
    a_par = tp // dp if enable_dp_attention else tp
    a = a_par if cfg.family in ("deepseek_v3", "qwen3_moe") else tp   # SGLang's Llama attention: whole TP
    m = tp // ep
    E, N, V, H = cfg.n_routed_experts, cfg.num_hidden_layers, cfg.vocab_size, cfg.hidden_size
    fuse = fuse_shared_expert if fuse_shared_expert is not None else (
        E == 256 and cfg.n_shared_experts == 1 and ep == 1 and moe_a2a_backend == "none")
    e_loc = E // ep
    slots = list(range((t // m) * e_loc, (t // m + 1) * e_loc)) + ([E] if fuse else [])
    kw = dict(attn=(a, t % a), dense=(1, 0) if moe_dense_tp_size == 1 else (tp, t),
              shared=(1, 0) if moe_a2a_backend in ("deepep", "mooncake") else (tp, t), moe_tp=(m, t % m),
              slots=slots, fuse=fuse, fused_a="self_attn.fused_qkv_a_proj_with_mqa.weight",
              experts_prefix="mlp.experts.")
    ref = Ref()
    # SGLang 0.5.23 (checked against the real loaders in test_engines.py): under DP attention DeepSeek and
    # Qwen3-MoE shard the embedding over the attention-TP group; Llama keeps the whole TP group.
    attn_embed = enable_dp_attention and cfg.family in ("deepseek_v3", "qwen3_moe")
    ref.vocab("model.embed_tokens.weight", V, H, *((a_par, t % a_par) if attn_embed else (tp, t)))
    for L in range(N):
        decoder_layer(ref, cfg, L, f"model.layers.{L}.", **kw)
    ref.replicated("model.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        ref.vocab("lm_head.weight", V, H, *((a_par, t % a_par) if enable_dp_lm_head and enable_dp_attention else (tp, t)))
    experts = expert_mapping(E + (1 if fuse else 0), "experts.")

    def prepare(weights):
        """SGLang's DeepSeek loader: q_a / kv_a_with_mqa are cached and concatenated into
        fused_qkv_a_proj_with_mqa; a fused shared expert is renamed to expert slot E."""
        cached, out = {}, []
        for n, w in weights:
            if cfg.model_type == "deepseek_v3" and cfg.q_lora_rank and ("q_a_proj" in n or "kv_a_proj_with_mqa" in n):
                prefix = n.split("self_attn.")[0]
                cached.setdefault(prefix, {})["q" if "q_a_proj" in n else "kv"] = w
                if len(cached[prefix]) == 2:
                    fused = prefix + "self_attn.fused_qkv_a_proj_with_mqa.weight"
                    target = ref if fused in ref.p else draft
                    target.load[fused](target.p[fused], torch.cat([cached[prefix]["q"], cached[prefix]["kv"]], 0))
                continue
            if fuse and "mlp.shared_experts." in n:
                n = n.replace("mlp.shared_experts.", f"mlp.experts.{E}.")
            out.append((n, w))
        return out

    draft = Ref()
    main = [(n, w) for n, w in ckpt.items() if not (n.startswith("model.layers.") and int(n.split(".")[2]) >= N)]
    load_weights(ref, prepare(main), STACKED, experts)
    out = dict(ref.p)
    if mtp:                                                        # DeepseekV3ForCausalLMNextN
        for nm in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            draft.replicated("model." + nm, (H,))
        draft.replicated("model.eh_proj.weight", (H, 2 * H))
        decoder_layer(draft, cfg, N, "model.decoder.", **kw)
        spec = []
        for n, w in ckpt.items():
            if not n.startswith(f"model.layers.{N}."):
                continue
            if "embed_tokens" in n or "shared_head.head" in n:        # shared with the target model
                continue
            if any(k in n for k in ("enorm", "hnorm", "eh_proj", "shared_head")):
                n = n.replace(f"model.layers.{N}.", "model.")
            else:
                n = n.replace(f"model.layers.{N}.", "model.decoder.")
            spec.append((n, w))
        load_weights(draft, prepare(spec), STACKED, experts)
        out.update({mtp_prefix + n: v for n, v in draft.p.items()})
    return out


# ----------------------------------------------------------------------------------- cases

CONFIGS = {"dsv3": dsv3_tiny, "dsv3-noqlora": lambda: dsv3_tiny().with_(q_lora_rank=None),
           "llama": gqa_tiny, "llama-kv2": lambda: gqa_tiny(num_key_value_heads=2),
           "qwen2-tied-v100": lambda: gqa_tiny(attention_bias=True, tie_word_embeddings=True, vocab_size=100),
           "qwen3moe": qwen3_moe_tiny}

VLLM_CASES = [
    ("dsv3", dict(tp=2)),
    ("dsv3", dict(tp=4)),                                                     # experts TP-sharded, m = 4
    ("dsv3", dict(tp=2, dp=2, enable_expert_parallel=True)),                  # ep = 4
    ("dsv3", dict(tp=2, dp=2)),                                               # no EP: m = dp*tp = 4
    ("dsv3", dict(tp=1, dp=3, enable_expert_parallel=True)),                  # 8 experts over 3: 3, 3, 2
    ("dsv3", dict(tp=2, dp=2, enable_expert_parallel=True, expert_placement="round_robin")),   # -> linear
    ("dsv3", dict(tp=4, enable_expert_parallel=True, expert_placement="round_robin")),         # kept: 4 groups
    ("dsv3", dict(tp=2, names="legacy")),
    ("dsv3", dict(tp=2, mtp=True)),
    ("dsv3", dict(tp=1, dp=2, enable_expert_parallel=True, mtp=True)),
    ("dsv3", dict(tp=2, pp=2)),
    ("dsv3-noqlora", dict(tp=2)),
    ("llama", dict(tp=2)),
    ("llama-kv2", dict(tp=8)),                                                # KV heads replicated 4x
    ("qwen2-tied-v100", dict(tp=2)),                                          # padded vocab 128, bias, tied
    ("qwen2-tied-v100", dict(tp=2, pp=2)),                                    # tied: last stage embeds too
    ("qwen3moe", dict(tp=2, dp=2, enable_expert_parallel=True)),
    ("qwen3moe", dict(tp=4)),
]

SGLANG_CASES = [
    ("dsv3", dict(tp=4, dp=2, ep=4, enable_dp_attention=True)),              # a = 2, m = 1
    ("dsv3", dict(tp=2, fuse_shared_expert=True)),                           # shared expert = slot 8
    ("dsv3", dict(tp=2, dp=2)),                                              # default rule: not fused (E != 256)
    ("dsv3", dict(tp=4, ep=2, moe_a2a_backend="deepep")),                    # m = 2, shared replicated
    ("dsv3", dict(tp=4, dp=2, ep=2, enable_dp_attention=True, enable_dp_lm_head=True, moe_dense_tp_size=1)),
    ("dsv3", dict(tp=2, fuse_shared_expert=True, mtp=True)),
    ("dsv3", dict(tp=4, dp=4, ep=4, enable_dp_attention=True, mtp=True)),
    ("dsv3-noqlora", dict(tp=2)),
    ("llama-kv2", dict(tp=4)),
    ("qwen2-tied-v100", dict(tp=2, dp=2, enable_dp_attention=True)),
    ("qwen3moe", dict(tp=4, dp=2, ep=2, enable_dp_attention=True)),
]


def _ids(cases):
    return [f"{c} " + " ".join(f"{k}={v}" for k, v in kw.items()) for c, kw in cases]


def _check(cfg, layout, reference, world):
    full = full_tensors(cfg)
    ckpt = checkpoint(cfg, full)
    assert layout.ranks == list(range(OFFSET, OFFSET + world))
    for rank in layout.ranks:
        got = materialize(layout, rank, full)
        want = reference(ckpt, rank)
        assert sorted(got) == sorted(want), (rank, sorted(set(got) ^ set(want)))
        for name, w in want.items():
            assert not w.isnan().any(), f"reference left {name} unwritten on rank {rank}"
            assert got[name].shape == w.shape, (rank, name, got[name].shape, w.shape)
            assert torch.equal(got[name], w), (rank, name)
    # everything the target holds is planned from an unsharded HF source on rank 0
    plan = make_plan(hf_layout(cfg, dtype="float32"), layout, ignore_unused=True)
    assert plan.stats["network_bytes"] == plan.stats["lower_bound_bytes"] > 0


@pytest.mark.parametrize("case,kw", VLLM_CASES, ids=_ids(VLLM_CASES))
def test_vllm_layout_matches_loader(case, kw):
    cfg = CONFIGS[case]()
    layout = vllm_layout(cfg, rank_offset=OFFSET, dtype="float32", **kw)
    world = kw["tp"] * kw.get("dp", 1) * kw.get("pp", 1)
    _check(cfg, layout, lambda ckpt, rank: vllm_reference(cfg, ckpt, rank, **kw), world)


@pytest.mark.parametrize("case,kw", SGLANG_CASES, ids=_ids(SGLANG_CASES))
def test_sglang_layout_matches_loader(case, kw):
    cfg = CONFIGS[case]()
    layout = sglang_layout(cfg, rank_offset=OFFSET, dtype="float32", **kw)
    world = kw["tp"] * (1 if kw.get("enable_dp_attention") else kw.get("dp", 1))
    _check(cfg, layout, lambda ckpt, rank: sglang_reference(cfg, ckpt, rank, **kw), world)


def test_targets_with_mtp_cover_every_canonical_tensor():
    cfg = dsv3_tiny()
    src = hf_layout(cfg)                        # bf16, router bias fp32
    for dst in (vllm_layout(cfg, 2, mtp=True, rank_offset=1), sglang_layout(cfg, 2, mtp=True, rank_offset=1)):
        assert set(dst.tensors) == set(src.tensors)
        make_plan(src, dst)                     # no ignore_unused: nothing left behind
    dst = vllm_layout(cfg, 2)                   # without the draft model the MTP layer is unused
    assert {n for n in set(src.tensors) - set(dst.tensors)} == {n for n in src.tensors if n.startswith("model.layers.4.")}
    make_plan(src, dst, ignore_unused=True)


# ----------------------------------------------------------------------------------- HF layout, configs

def test_hf_layout_checkpoint_names():
    cfg = dsv3_tiny()
    full = full_tensors(cfg)
    got = materialize(hf_layout(cfg, dtype="float32", fused_experts=False, mtp_copies=True), 0, full)
    want = checkpoint(cfg, full)
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    stacked = materialize(hf_layout(cfg, dtype="float32"), 0, full)
    assert sorted(stacked) == sorted(full) and all(torch.equal(stacked[n], full[n]) for n in full)


def _family_names(family, cfg) -> set[str]:
    """Every HF name the family table can produce for this config."""
    fam = load_family(family)
    n = cfg.num_hidden_layers
    ks = range(cfg.num_nextn_predict_layers if cfg.family == "deepseek_v3" else 0)
    out = set()
    for rule in fam.globals:
        for h in rule.hf:
            out |= {h.replace("{K+num_layers}", str(n + k)) for k in ks} if "{K" in h else {h}
    for _, hp in fam.layer_prefixes:
        idx = [n + k for k in ks] if "{K" in hp else range(n)
        for L in idx:
            p = hp.replace("{L}", str(L)).replace("{K+num_layers}", str(L))
            out |= {p + h for rule in fam.layer_rules for h in rule.hf}
    return out


@pytest.mark.parametrize("family,cfg", [("deepseek_v3", dsv3_tiny()), ("deepseek_v3", dsv3_671b()),
                                        ("llama", gqa_tiny(attention_bias=True)), ("qwen3_moe", qwen3_moe_tiny())])
def test_canonical_tensors_use_family_table_names(family, cfg):
    metas = canonical_tensors(cfg)
    names = [m.name for m in metas]
    assert len(names) == len(set(names))
    assert set(names) <= _family_names(family, cfg), sorted(set(names) - _family_names(family, cfg))[:5]
    dtypes = {m.name: m.dtype for m in metas}
    assert {n for n, d in dtypes.items() if d == "float32"} == {n for n in names if n.endswith("e_score_correction_bias")}


def test_canonical_tensors_dsv3_671b():
    metas = {m.name: m for m in canonical_tensors(dsv3_671b())}
    assert len([n for n in metas if n.endswith("mlp.experts.gate_up_proj")]) == 59      # layers 3..60 + MTP 61
    assert metas["model.layers.3.mlp.experts.gate_up_proj"].shape == (256, 4096, 7168)
    assert metas["model.layers.3.mlp.experts.down_proj"].shape == (256, 7168, 2048)
    assert metas["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)
    assert metas["model.layers.0.self_attn.kv_b_proj.weight"].shape == (32768, 512)
    assert metas["model.layers.61.eh_proj.weight"].shape == (7168, 14336)
    assert metas["model.layers.61.mlp.gate.e_score_correction_bias"].dtype == "float32"
    # 671.03B main model + 11.61B unique to MTP (scales excluded), per the research notes
    main = sum(m.nbytes // 2 for n, m in metas.items() if not n.startswith("model.layers.61.") and m.dtype == "bfloat16")
    main += sum(m.nbytes // 4 for n, m in metas.items() if m.dtype == "float32" and not n.startswith("model.layers.61."))
    assert round(main / 1e9, 2) == 671.03


def test_from_hf_config():
    transformers = pytest.importorskip("transformers")
    assert from_hf_config(transformers.DeepseekV3Config()) == dsv3_671b()
    tiny = transformers.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=4, vocab_size=128, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, num_nextn_predict_layers=1, n_group=4, topk_group=2)
    assert from_hf_config(tiny) == dsv3_tiny()
    assert from_hf_config(tiny.to_dict()) == dsv3_tiny()
    q3 = transformers.Qwen3MoeConfig(hidden_size=64, num_hidden_layers=4, vocab_size=128, num_attention_heads=8,
                                     num_key_value_heads=4, head_dim=16, intermediate_size=128, num_experts=8,
                                     moe_intermediate_size=32)
    assert from_hf_config(q3) == qwen3_moe_tiny()
    ll = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=4, vocab_size=128, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=8, intermediate_size=128)
    assert from_hf_config(ll) == gqa_tiny()
    q2 = from_hf_config(transformers.Qwen2Config(hidden_size=64, num_attention_heads=8, num_key_value_heads=4))
    assert q2.attention_bias and q2.family == "llama" and q2.head_dim == 8


def test_from_hf_config_closed_world():
    """Every field of the config is read, required, or known not to change the tensors; anything else that
    differs from transformers' default is refused naming it (mcore_reshard/targets/hf_fields.py)."""
    pytest.importorskip("transformers")
    from mcore_reshard.core.layout import LayoutError
    # DeepSeek-V3's own config.json (deepseek-ai/DeepSeek-V3, bf16: no quantization_config), as vLLM / SGLang load it
    official = {
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}, "aux_loss_alpha": 0.001,
        "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
        "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
        "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "transformers_version": "4.33.1", "use_cache": True,
        "v_head_dim": 128, "vocab_size": 129280}
    assert from_hf_config(official).with_(head_dim=64) == dsv3_671b()     # MLA reads no head_dim (absent here)
    for model_type, bad, names in [
            ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
             "quantization_config="),
            ("deepseek_v3", {"qk_head_dim": 256}, "qk_head_dim=256"),
            ("deepseek_v3", {"attention_bias": True}, "attention_bias=True"),
            ("llama", {"mlp_bias": True}, "closest fix: mlp_bias=False"),
            ("llama", {"attention_bias": True}, "model_type 'qwen2'"),
            ("qwen3_moe", {"shared_expert_intermediate_size": 512}, "shared_expert_intermediate_size=512")]:
        cfg = {**(official if model_type == "deepseek_v3" else {"model_type": model_type, "hidden_size": 64,
               "num_hidden_layers": 2, "vocab_size": 128, "num_attention_heads": 4}), **bad}
        with pytest.raises(LayoutError, match="the layouts cannot describe") as e:
            from_hf_config(cfg)
        assert names in str(e.value), str(e.value)


# ----------------------------------------------------------------------------------- 671B worked examples

def _shapes(layout, rank=0, needle="model.layers.3."):
    return {n[len(needle):]: b.shape for n, b in layout.buffers[rank].items() if n.startswith(needle)}


def test_dsv3_671b_vllm_worked_examples():
    cfg = dsv3_671b()
    s = _shapes(vllm_layout(cfg, tp=8))
    assert s["mlp.experts.routed_experts.w13_weight"] == (256, 512, 7168)
    assert s["mlp.experts.routed_experts.w2_weight"] == (256, 7168, 256)
    assert s["self_attn.fused_qkv_a_proj.weight"] == (2112, 7168)
    assert s["self_attn.q_b_proj.weight"] == (24576 // 8, 1536)
    assert s["self_attn.o_proj.weight"] == (7168, 16384 // 8)
    assert s["mlp.shared_experts.gate_up_proj.weight"] == (4096 // 8, 7168)
    lay = vllm_layout(cfg, tp=1, dp=8, enable_expert_parallel=True, names="legacy")
    s = _shapes(lay, 5)
    assert s["mlp.experts.w13_weight"] == (32, 4096, 7168) and s["self_attn.q_b_proj.weight"] == (24576, 1536)
    w13 = lay.buffers[5]["model.layers.3.mlp.experts.w13_weight"]
    assert {p.box.offsets[0] for p in w13.pieces} == {160}           # experts 160..191
    assert lay.buffers[0]["model.embed_tokens.weight"].shape == (129280, 7168)
    assert vllm_layout(cfg, tp=8).buffers[3]["lm_head.weight"].shape == (16160, 7168)
    assert pp_partition(61, 2) == [(0, 31), (31, 61)]
    assert [b - a for a, b in pp_partition(61, 4)] == [15, 15, 16, 15]


def test_dsv3_671b_sglang_worked_examples():
    cfg = dsv3_671b()
    lay = sglang_layout(cfg, tp=8)
    s = _shapes(lay, 7)
    assert s["mlp.experts.w13_weight"] == (257, 512, 7168) and s["mlp.experts.w2_weight"] == (257, 7168, 256)
    assert "mlp.shared_experts.gate_up_proj.weight" not in s
    assert s["self_attn.fused_qkv_a_proj_with_mqa.weight"] == (2112, 7168)
    lay = sglang_layout(cfg, tp=16, dp=16, ep=16, enable_dp_attention=True, moe_a2a_backend="deepep")
    assert lay.ranks == list(range(16))
    s = _shapes(lay, 9)
    assert s["mlp.experts.w13_weight"] == (16, 4096, 7168)
    assert s["mlp.shared_experts.gate_up_proj.weight"] == (4096, 7168)      # replicated under DeepEP
    assert s["self_attn.q_b_proj.weight"] == (24576, 1536)                  # a = 1
    assert lay.buffers[9]["model.embed_tokens.weight"].shape == (129280, 7168)
    assert lay.buffers[9]["lm_head.weight"].shape == (129280 // 16, 7168)


def test_dsv3_671b_256_ranks_builds_fast():
    cfg = dsv3_671b()
    t0 = time.process_time()
    lay = vllm_layout(cfg, tp=32, dp=8, enable_expert_parallel=True, mtp=True)
    took = time.process_time() - t0
    assert lay.ranks == list(range(256))
    s = _shapes(lay, 255)
    assert s["mlp.experts.routed_experts.w13_weight"] == (1, 4096, 7168)
    assert s["self_attn.q_b_proj.weight"] == (24576 // 32, 1536)
    assert sum(len(b) for b in lay.buffers.values()) > 200_000
    assert took < 15, f"building 256 ranks took {took:.1f} s of CPU"
