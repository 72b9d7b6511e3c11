"""Tiny Megatron-Core models for CPU runs (DeepSeek-V3-style MLA + MoE + MTP, dense GQA, Qwen3-MoE) and a
forward that works for any PP / VPP / TP / EP / SP on gloo.  Build them after
:func:`mcore_reshard.testing.megatron_cpu.init_megatron`; the names are re-exported there."""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def _ps_sizes() -> dict:
    from megatron.core import parallel_state as ps

    return dict(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        cp=ps.get_context_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        etp=ps.get_expert_tensor_parallel_world_size(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size(),
    )



# ----------------------------------------------------------------------------------------------
# spec tweaks
# ----------------------------------------------------------------------------------------------


def _cpu_norm(config, hidden_size: int, eps: float = 1e-5, **_unused):
    """torch RMSNorm/LayerNorm builder that, unlike ``WrappedTorchNorm``, accepts sequence
    parallelism (it only marks the weights, as Megatron's fused norms do)."""
    if config.normalization == "RMSNorm":
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
    else:
        norm = torch.nn.LayerNorm(hidden_size, eps=eps)
    for p in norm.parameters():
        p.sequence_parallel = config.sequence_parallel
    return norm


_CPU_CORE_ATTENTION = None


def _cpu_core_attention_cls():
    """Local ``DotProductAttention`` that accepts (and drops) MLA's ``k_channels``/``v_channels``
    (valid while ``kv_channels == v_head_dim``)."""
    global _CPU_CORE_ATTENTION
    if _CPU_CORE_ATTENTION is None:
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class CpuDotProductAttention(DotProductAttention):
            def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
                super().__init__(*args, **kwargs)

        _CPU_CORE_ATTENTION = CpuDotProductAttention
    return _CPU_CORE_ATTENTION


def _swap_modules(obj, mapping: dict):
    """Copy of a spec tree (ModuleSpec / submodule dataclasses / partials / lists) with the classes
    in ``mapping`` replaced."""
    try:
        if obj in mapping:
            return mapping[obj]
    except TypeError:  # unhashable
        pass
    if isinstance(obj, functools.partial):
        return functools.partial(_swap_modules(obj.func, mapping),
                                 *[_swap_modules(a, mapping) for a in obj.args],
                                 **{k: _swap_modules(v, mapping) for k, v in obj.keywords.items()})
    if isinstance(obj, list):
        return [_swap_modules(x, mapping) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_swap_modules(x, mapping) for x in obj)
    if isinstance(obj, dict):
        return {k: _swap_modules(v, mapping) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        new = copy.copy(obj)
        for f in dataclasses.fields(obj):
            object.__setattr__(new, f.name, _swap_modules(getattr(obj, f.name), mapping))
        return new
    return obj


def _cpu_spec(spec):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return _swap_modules(spec, {WrappedTorchNorm: _cpu_norm, DotProductAttention: _cpu_core_attention_cls()})


# ----------------------------------------------------------------------------------------------
# model builders
# ----------------------------------------------------------------------------------------------

VOCAB = 128
MAX_SEQ = 64


def base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                        pipeline_layout) -> dict:
    """TransformerConfig arguments every tiny model shares: the parallel sizes of the initialised
    Megatron state, CPU initialisation, no fusions (the live benchmark scales the same spec)."""
    import torch.nn.functional as F

    s = _ps_sizes()
    if vpp is None:
        vpp = s["vpp"]
    kw = dict(
        tensor_model_parallel_size=s["tp"], pipeline_model_parallel_size=s["pp"],
        context_parallel_size=s["cp"], expert_model_parallel_size=s["ep"],
        expert_tensor_parallel_size=s["etp"], virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and s["tp"] > 1,
        use_cpu_initialization=True, params_dtype=dtype, bf16=(dtype == torch.bfloat16),
        fp16=(dtype == torch.float16), pipeline_dtype=dtype,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, transformer_impl="local", hidden_dropout=0.0, attention_dropout=0.0,
        gradient_accumulation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False,
    )
    if pipeline_layout is not None:
        kw["pipeline_model_parallel_layout"] = pipeline_layout
    if first_stage_layers is not None:
        kw["num_layers_in_first_pipeline_stage"] = first_stage_layers
    if last_stage_layers is not None:
        kw["num_layers_in_last_pipeline_stage"] = last_stage_layers
    return kw


def moe_kwargs(dispatcher: str, load_balancing: str) -> dict:
    """TransformerConfig arguments of the tiny MoE models' router and token dispatcher."""
    return dict(moe_router_dtype="fp32", moe_grouped_gemm=False, moe_token_dispatcher_type=dispatcher,
                moe_aux_loss_coeff=0.0, moe_router_load_balancing_type=load_balancing)


def build_chunks(config, vocab_size: int, share_embeddings: bool, mtp: bool) -> list:
    """One GPTModel per virtual pipeline stage of this rank (a single one without VPP)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        # qk_l2_norm reaches the spec as Megatron's training entry point passes it (args.qk_l2_norm)
        spec = _cpu_spec(get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                    normalization=config.normalization,
                                                    qk_l2_norm=bool(config.qk_l2_norm), vp_stage=vp_stage))
        mtp_spec = None
        if mtp:
            mtp_spec = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
            mtp_spec = _cpu_spec(mtp_spec) if mtp_spec is not None else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(config, spec, vocab_size=vocab_size, max_sequence_length=MAX_SEQ,
                         pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=share_embeddings,
                         position_embedding_type="rope", mtp_block_spec=mtp_spec, vp_stage=vp_stage)
        model.eval()
        chunks.append(model)
    return chunks


def build_dsv3_tiny(dtype: torch.dtype = torch.float32, mtp: bool = True, num_layers: int = 4,
                    sequence_parallel: bool = False, vpp: Optional[int] = None,
                    first_stage_layers: Optional[int] = None, last_stage_layers: Optional[int] = None,
                    pipeline_layout: Optional[str] = None, dispatcher: str = "alltoall",
                    num_experts: int = 8, topk: int = 2, rope_type: str = "rope",
                    yarn: Optional[dict] = None, widths: Optional[dict] = None,
                    overrides: Optional[dict] = None) -> list:
    """Tiny DeepSeek-V3-style model: MLA (q_lora 32, kv_lora 16, nope 16, rope 8, v 16, 4 heads,
    hidden 64), first layer dense (ffn 128), the rest MoE with ``num_experts`` routed experts
    (ffn 32, top-2, sigmoid scores, expert bias, 4 groups / top-2 groups, scaling 2.5) plus one
    shared expert (ffn 32); RMSNorm, q/kv layernorms, untied embeddings, vocab 128.

    ``mtp=True`` adds one MTP layer (works with PP=1, PP>1 and VPP; it sits on the last stage).
    ``vpp=None`` takes the virtual pipeline size from ``parallel_state``. Uneven PP: pass
    ``first_stage_layers``/``last_stage_layers`` or a Megatron ``pipeline_layout`` string such as
    ``"Et|ttt,mL"`` (PP2) or ``"Et|t|t|tmL"`` (PP2 x VPP2). ``sequence_parallel`` is ignored when
    TP=1. ``dispatcher``: ``"alltoall"`` or ``"allgather"``. Returns this rank's chunks (one per
    virtual stage), in eval mode.

    ``rope_type="yarn"`` uses YaRN RoPE; ``yarn`` overrides its MLATransformerConfig fields
    (``rotary_scaling_factor``, ``original_max_position_embeddings``, ``beta_fast``, ``beta_slow``,
    ``mscale``, ``mscale_all_dim``; default here: factor 4 over 16 original positions, so that the
    ramp between interpolated and extrapolated frequencies falls inside the 4 rope frequencies, and
    DeepSeek-V3's mscale 1 / mscale_all_dim 0.707, so that both the softmax scale and the cos/sin
    factor differ from 1).

    ``widths`` overrides the sizes (``hidden_size``, ``ffn_hidden_size``, ``num_attention_heads``,
    ``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim``, ``qk_pos_emb_head_dim``, ``v_head_dim`` (=
    ``kv_channels``), ``moe_ffn_hidden_size`` (= the shared expert's), and ``vocab``) for a larger model.

    ``overrides``: more ``MLATransformerConfig`` fields, applied last (any setting under test).

    The other builders take the same layout keywords (and ``overrides``).
    """
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    sizes = dict(hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, q_lora_rank=32, kv_lora_rank=16,
                 qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, moe_ffn_hidden_size=32, vocab=VOCAB)
    sizes.update(widths or {})
    vocab = sizes.pop("vocab")
    sizes.update(kv_channels=sizes["v_head_dim"], moe_shared_expert_intermediate_size=sizes["moe_ffn_hidden_size"])

    kw = base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = MLATransformerConfig(
        num_layers=num_layers, **sizes, rope_type=rope_type, qk_layernorm=True, layernorm_epsilon=1e-6,
        num_moe_experts=num_experts, moe_router_topk=topk, moe_layer_freq=[0] + [1] * (num_layers - 1),
        moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.5, moe_router_num_groups=4, moe_router_group_topk=2,
        moe_router_pre_softmax=True, mtp_num_layers=1 if mtp else None,
        **{**moe_kwargs(dispatcher, "seq_aux_loss"), **kw, **_yarn_kwargs(rope_type, yarn), **(overrides or {})})
    return build_chunks(config, vocab, share_embeddings=False, mtp=mtp)


def _yarn_kwargs(rope_type: str, yarn: Optional[dict]) -> dict:
    if rope_type != "yarn":
        return dict(yarn or {})
    out = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
               mscale=1.0, mscale_all_dim=0.707)
    out.update(yarn or {})
    return out


def build_gqa_dense_tiny(dtype: torch.dtype = torch.float32, num_layers: int = 4,
                         num_query_groups: int = 4, tied_embeddings: bool = False,
                         qkv_bias: bool = False, sequence_parallel: bool = False,
                         vpp: Optional[int] = None, first_stage_layers: Optional[int] = None,
                         last_stage_layers: Optional[int] = None,
                         pipeline_layout: Optional[str] = None, num_attention_heads: int = 8,
                         kv_channels: int = 8, overrides: Optional[dict] = None) -> list:
    """Tiny Llama/Qwen2-style dense model: hidden 64, ``num_attention_heads`` heads of ``kv_channels``
    (default 8 of 8), ``num_query_groups`` KV groups (GQA; must be divisible by TP), SwiGLU ffn 128,
    RMSNorm, rope, optional qkv bias (Qwen2) and tied embeddings, vocab 128."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups, kv_channels=kv_channels, ffn_hidden_size=128, add_qkv_bias=qkv_bias,
        layernorm_epsilon=1e-6, **{**kw, **(overrides or {})})
    return build_chunks(config, VOCAB, share_embeddings=tied_embeddings, mtp=False)


def build_qwen3_moe_tiny(dtype: torch.dtype = torch.float32, num_layers: int = 4,
                         num_query_groups: int = 4, num_experts: int = 8,
                         sequence_parallel: bool = False, vpp: Optional[int] = None,
                         first_stage_layers: Optional[int] = None,
                         last_stage_layers: Optional[int] = None,
                         pipeline_layout: Optional[str] = None, dispatcher: str = "alltoall",
                         overrides: Optional[dict] = None) -> list:
    """Tiny Qwen3-MoE-style model: hidden 64, 8 heads of 16 (q width 128 != hidden, as in Qwen3),
    ``num_query_groups`` KV groups, qk_layernorm, every layer MoE with ``num_experts`` experts
    (ffn 32, softmax router, top-2, renormalised, no shared expert, no expert bias), RMSNorm,
    untied embeddings, vocab 128."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = base_config_kwargs(dtype, sequence_parallel, vpp, first_stage_layers, last_stage_layers,
                             pipeline_layout)
    config = TransformerConfig(
        num_layers=num_layers, hidden_size=64, num_attention_heads=8, num_query_groups=num_query_groups,
        kv_channels=16, ffn_hidden_size=128, qk_layernorm=True, layernorm_epsilon=1e-6,
        num_moe_experts=num_experts, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        **{**moe_kwargs(dispatcher, "aux_loss"), **kw, **(overrides or {})})
    return build_chunks(config, VOCAB, share_embeddings=False, mtp=False)


# ----------------------------------------------------------------------------------------------
# forward
# ----------------------------------------------------------------------------------------------


def causal_mask(seq_len: int) -> torch.Tensor:
    """Megatron's bool attention mask ``[1, 1, s, s]``: True = masked (future positions)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]


@torch.no_grad()
def forward_logits(chunks: Sequence[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    """Forward ``tokens [b, s]`` through the model and return full-vocab fp32 logits ``[b, s, V]``
    on every rank.

    Pipeline stages (and virtual stages) run one after another in a manual loop: each global
    virtual stage receives ``[s(/tp with SP), b, h]`` from the previous one over the PP group
    (``dist.send/recv``) and feeds it with ``set_input_tensor``; Megatron's PP schedule is not used
    (it allocates CUDA tensors). The last stage gathers the vocab-parallel logits over TP, then
    broadcasts them over the PP group. Needs CP=1 and the same ``tokens`` on every rank.
    """
    from megatron.core import parallel_state as ps

    assert ps.get_context_parallel_world_size() == 1, "forward_logits supports CP=1 only"
    tokens = tokens.long()
    b, s = tokens.shape
    position_ids = torch.arange(s, dtype=torch.long)[None].expand(b, s).contiguous()
    mask = causal_mask(s)
    pp = ps.get_pipeline_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = dist.get_process_group_ranks(pp_group) if pp > 1 else [dist.get_rank()]
    n_chunks = len(chunks)
    config = chunks[0].config
    tp = ps.get_tensor_model_parallel_world_size()
    act_seq = s // tp if config.sequence_parallel else s
    act_shape = (act_seq, b, config.hidden_size)
    act_dtype = config.pipeline_dtype or config.params_dtype

    logits_local = None
    for v, model in enumerate(chunks):
        stage = v * pp + pp_rank  # global virtual stage index
        if stage > 0:
            buf = torch.empty(act_shape, dtype=act_dtype)
            dist.recv(buf, src=pp_ranks[(stage - 1) % pp], group=pp_group)
            model.set_input_tensor(buf)
        else:
            model.set_input_tensor(None)
        out = model(tokens, position_ids, mask)
        if stage < n_chunks * pp - 1:
            dist.send(out.contiguous().to(act_dtype), dst=pp_ranks[(stage + 1) % pp], group=pp_group)
        else:
            logits_local = out  # [b, s, V/tp]

    vocab = None
    if logits_local is not None:
        logits_local = logits_local.float().contiguous()
        if tp > 1:
            parts = [torch.empty_like(logits_local) for _ in range(tp)]
            dist.all_gather(parts, logits_local, group=ps.get_tensor_model_parallel_group())
            logits_local = torch.cat(parts, dim=-1)
        vocab = logits_local.shape[-1]
    if pp == 1:
        return logits_local
    # broadcast from the last stage to the rest of the pipeline group
    vocab_t = torch.tensor([vocab if vocab is not None else 0], dtype=torch.long)
    dist.broadcast(vocab_t, src=pp_ranks[-1], group=pp_group)
    if logits_local is None:
        logits_local = torch.empty((b, s, int(vocab_t.item())), dtype=torch.float32)
    dist.broadcast(logits_local, src=pp_ranks[-1], group=pp_group)
    return logits_local
