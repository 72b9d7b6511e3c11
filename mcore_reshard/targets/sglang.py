"""SGLang runtime layouts (parameter names and local boxes), metadata only.

SGLang's linear / vocab / FusedMoE layers are ports of vLLM's, so the buffer primitives are those
of :mod:`mcore_reshard.targets.vllm`; what differs is who shards what (``tp_rank`` in ``[0, tp)``)::

    weight                        | split over (size, rank)
    attention (q_b, kv_b, o, qkv) | attention TP: a = tp/dp with --enable-dp-attention, else tp;
                                  |  attn_tp_rank = tp_rank % a (Llama: always tp)
    fused_qkv_a_proj_with_mqa     | replicated, [q_a_proj; kv_a_proj_with_mqa]
    embed_tokens                  | (tp, tp_rank); under DP attention (a, attn_tp_rank) for DeepSeek
                                  |  and Qwen3-MoE (``use_attn_tp_group``), (tp, tp_rank) for Llama;
                                  |  replicated with SGLANG_ENABLE_EMBED_REPLICATION (DeepSeek)
    lm_head                       | (tp, tp_rank); (a, attn_tp_rank) with enable_dp_lm_head
    dense MLP (first_k_dense)     | (tp, tp_rank); replicated with moe_dense_tp_size=1
    experts                       | MoE-TP m = tp/ep, j = tp_rank % m; ep_rank = tp_rank // m owns
                                  |  [ep_rank*E_loc, (ep_rank+1)*E_loc), E_loc = E_tot/ep
    shared expert                 | fused as expert slot E of w13/w2 (TP-sharded by m) when fused;
                                  |  else mlp.shared_experts.* over (tp, tp_rank), replicated under
                                  |  the DeepEP / Mooncake all-to-all backends
    norms, router, bias (fp32)    | replicated

World: ``tp`` ranks with DP attention (the DP groups live inside the TP group), else ``dp``
independent replicas of ``tp`` ranks (``rank = rank_offset + dp_rank * tp + tp_rank``).

Shared-expert fusion (``fuse_shared_expert=None``): SGLang's default rule for DeepSeek-V3 --
fused iff ``n_routed_experts == 256``, ``n_shared_experts == 1``, ``ep == 1`` and no DeepEP /
Mooncake backend (hardware conditions, sm >= 80, are assumed).  ``True`` / ``False`` force it
(``--enforce-shared-experts-fusion`` / ``--disable-shared-experts-fusion``); fusion with ``ep > 1``
is not modelled.

MTP (``mtp=True``): the ``DeepseekV3ForCausalLMNextN`` draft model, prefixed with ``mtp_prefix``:
``model.{enorm,hnorm,eh_proj,shared_head.norm}.weight`` (replicated) and ``model.decoder.*`` (the
MTP decoder layer).  Its embedding and head are the target's tensors (``set_embed_and_head``), so
they have no buffers of their own.

Not modelled: EPLB / redundant experts, pipeline parallelism, FlashInfer-TRTLLM ``[up; gate]``
order, quantized parameters.
"""
from __future__ import annotations

from dataclasses import replace

from ..core.gcpause import paused_gc
from ..core.layout import Layout, LayoutError
from .config import ModelConfig
from .vllm import EngineNames, LayoutBuilder, RankShards

A2A_REPLICATED_SHARED = ("deepep", "mooncake")
DP_ATTENTION_FAMILIES = ("deepseek_v3", "qwen3_moe")   # their attention and embedding follow DP attention


def default_fuse_shared_expert(config: ModelConfig, ep: int, moe_a2a_backend: str = "none") -> bool:
    return (config.family == "deepseek_v3" and config.n_routed_experts == 256 and config.n_shared_experts == 1
            and ep == 1 and moe_a2a_backend not in A2A_REPLICATED_SHARED)


@paused_gc()
def sglang_layout(config: ModelConfig, tp: int, dp: int = 1, ep: int = 1, enable_dp_attention: bool = False,
                  fuse_shared_expert: bool | None = None, rank_offset: int = 0, dtype: str = "bfloat16", *,
                  moe_a2a_backend: str = "none", moe_dense_tp_size: int | None = None,
                  enable_dp_lm_head: bool = False, embed_replicated: bool = False, mtp: bool = False,
                  mtp_prefix: str = "mtp.") -> Layout:
    """Layout of every rank of an SGLang deployment (``--tp tp --dp dp --ep ep``).

    ``embed_replicated``: ``SGLANG_ENABLE_EMBED_REPLICATION`` (DeepSeek's embedding whole on every rank)."""
    cfg = config
    if tp % ep:
        raise LayoutError(f"ep={ep} must divide tp={tp}")
    if enable_dp_attention and tp % dp:
        raise LayoutError(f"with DP attention dp={dp} must divide tp={tp}")
    if moe_dense_tp_size not in (None, 1, tp):
        raise LayoutError(f"moe_dense_tp_size must be None, 1 or tp, not {moe_dense_tp_size}")
    if mtp and list(cfg.mtp_layers) != [cfg.num_hidden_layers]:
        raise LayoutError("SGLang's NextN draft model needs exactly one MTP layer (num_nextn_predict_layers = 1)")
    fuse = default_fuse_shared_expert(cfg, ep, moe_a2a_backend) if fuse_shared_expert is None else fuse_shared_expert
    fuse = bool(fuse and cfg.n_shared_experts and cfg.n_routed_experts)
    if fuse and ep > 1:
        raise LayoutError("shared-expert fusion with ep > 1 is not modelled")
    if fuse and cfg.n_shared_experts != 1:
        raise LayoutError(f"shared-expert fusion needs n_shared_experts = 1, not {cfg.n_shared_experts}")
    E = cfg.n_routed_experts
    if E and E % ep:
        raise LayoutError(f"{E} experts are not divisible by ep={ep}")
    e_loc = E // ep
    # attention TP width of the deployment (tp / dp with DP attention): the LM head with
    # enable_dp_lm_head and the DP-attention families' attention and embedding use it; Llama's
    # attention (SGLang 0.5.23 llama.py) stays on the whole TP group.
    a_par = tp // dp if enable_dp_attention else tp
    a = a_par if cfg.family in DP_ATTENTION_FAMILIES else tp
    m = tp // ep
    b = LayoutBuilder(cfg, dtype, EngineNames(fused_qkv_a="self_attn.fused_qkv_a_proj_with_mqa.weight",
                                              experts="mlp.experts."))
    replicas = 1 if enable_dp_attention else dp
    for d in range(replicas):
        for t in range(tp):
            rank = rank_offset + d * tp + t
            ep_rank = t // m
            attn = (a, t % a)
            attn_par = (a_par, t % a_par)
            # SGLang 0.5.23: DeepSeek (get_embedding_tp_kwargs) and Qwen2/3-MoE shard the embedding over
            # the attention-TP group under DP attention; Llama's stays on the whole TP group.
            if embed_replicated and cfg.family == "deepseek_v3":
                embed = (1, 0)
            elif enable_dp_attention and cfg.family in DP_ATTENTION_FAMILIES:
                embed = attn_par
            else:
                embed = (tp, t)
            shards = RankShards(
                attn=attn,
                dense=(1, 0) if moe_dense_tp_size == 1 else (tp, t),
                shared=(1, 0) if moe_a2a_backend in A2A_REPLICATED_SHARED else (tp, t),
                embed=embed,
                head=attn_par if enable_dp_lm_head and enable_dp_attention else (tp, t),
                final_norm=True, moe_tp=(m, t % m), experts=tuple(range(ep_rank * e_loc, (ep_rank + 1) * e_loc)),
                fuse_shared=fuse, layers=(0, cfg.num_hidden_layers))
            if cfg.tie_word_embeddings:
                shards = replace(shards, head=None)
            b.main_model(rank, shards)
            if mtp:
                layer = cfg.num_hidden_layers
                p, c = mtp_prefix + "model.", f"model.layers.{layer}."
                bufs = [b.whole(p + s, c + s) for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight",
                                                         "shared_head.norm.weight")]
                b.add(rank, bufs + b.layer(layer, p + "decoder.", shards))
    return b.finish()


__all__ = ["default_fuse_shared_expert", "sglang_layout"]
