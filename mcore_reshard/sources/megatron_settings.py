"""Every Megatron-Core ``TransformerConfig`` / ``MLATransformerConfig`` field, classified for the
transformers config mapping (:mod:`mcore_reshard.sources.hf_config`): closed-world.

A field is one of

* **expressed** -- read into the facts; the family table (``layouts/*.toml`` ``[hf_config]``) maps
  it to a transformers field or requires a value it can express;
* **irrelevant** -- proven not to change the forward of the trained model (parallel layout,
  training only, a kernel or fusion of the same math, numerics, Megatron's own inference engine);
  ``values=`` narrows that to the values listed (others are refused); ``dormant=`` says the field is
  only read while another setting is on, which is itself refused;
* **refused** -- changes the forward in a way no transformers config here expresses: a value other
  than the dataclass default is refused, naming the field, why and the fix.

A field missing from :data:`SETTINGS` (a Megatron-Core release newer than this table) whose value
differs from the dataclass default is refused too, so a new setting fails safe.  Example::

    field                          value     verdict
    hidden_dropout                 0.1       irrelevant (training only)
    glu_linear_offset              1.0       refused: glu_linear_offset=0.0
    moe_router_load_balancing_type sinkhorn  refused (only aux_loss / seq_aux_loss / ... are irrelevant)
    some_new_field                 3         refused: not known to this table (some_new_field=<default>)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple


class Setting(NamedTuple):
    kind: str                      # "expressed" | "irrelevant" | "refused"
    why: str
    fix: str | None = None         # refused: the closest setting that exports
    values: tuple | None = None    # irrelevant: only for these values (others refused)
    dormant: str | None = None     # irrelevant while this (refused) setting stays at its default


def _expressed(why: str) -> Setting:
    return Setting("expressed", why)


def _irrelevant(why: str, values: tuple | None = None, dormant: str | None = None) -> Setting:
    return Setting("irrelevant", why, values=values, dormant=dormant)


def _refused(why: str, fix: str) -> Setting:
    return Setting("refused", why, fix=fix)


def _group(setting: Setting, *fields: str) -> dict[str, Setting]:
    return {f: setting for f in fields}


# TransformerConfig fields read as they are into the facts (hf_config.megatron_facts); absent ones read as None
CONFIG_FIELDS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
    "layernorm_epsilon", "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
    "rope_type", "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
    "mscale_all_dim", "rotary_interleaved", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
    "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
    "moe_router_num_groups", "moe_router_group_topk", "moe_router_pre_softmax", "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate", "moe_router_topk_limited_devices", "moe_apply_probs_on_input", "mtp_num_layers",
    "apply_residual_connection_post_layernorm", "layernorm_zero_centered_gamma", "softmax_scale", "window_size",
    "no_rope_freq", "attention_output_gate",
)

PARALLEL = ("how the model is split over ranks and scheduled (read_layout reads each rank's part from "
            "sharded_state_dict), not what it computes")
TRAINING = "training only (losses, gradients, optimizer, initialisation, checkpointing): not in the forward"
DROPOUT = "dropout: off in the forward of a model in eval mode"
KERNEL = "a kernel, fusion, overlap, offload or memory choice for the same math"
NUMERICS = "the precision the same function is computed at"
INFERENCE = "Megatron's own inference engine (kernels, caches, CUDA graphs, sampling)"
LOGGING = "logging and tests"
EXPRESSED = "read into the facts: the family table maps it or requires a value it expresses"
BALANCING_LOSSES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")

SETTINGS: dict[str, Setting] = {
    **_group(_expressed(EXPRESSED), *CONFIG_FIELDS),
    "activation_func": _expressed("read as the fact 'activation' (required: silu)"),
    "moe_layer_freq": _expressed("read as the facts dense_layers / first_k_dense"),
    "params_dtype": _expressed("read as the fact dtype (config.json's dtype)"),
    "rotary_base": _expressed("MLA: read as the fact rotary_base (rope_theta)"),
    "rotary_percent": _expressed("MLA: read as the fact rotary_percent (required 1.0)"),
    # ---- refused: they change the forward, no transformers config of these families expresses them
    "softmax_type": _refused("'off-by-one' / 'learnable' add a term to the attention softmax's denominator; "
                             "transformers' attention is the plain softmax", "softmax_type='vanilla'"),
    "glu_linear_offset": _refused("adds an offset to the GLU's linear half; transformers' SwiGLU has none",
                                  "glu_linear_offset=0.0"),
    "activation_func_clamp_value": _refused("clamps the GLU's inputs; transformers' SwiGLU does not",
                                            "activation_func_clamp_value=None"),
    "qk_l2_norm": _refused("L2-normalizes queries and keys (Llama-4 style); not in these transformers models",
                           "qk_l2_norm=False"),
    "moe_expert_capacity_factor": _refused("drops the tokens past each expert's capacity; transformers routes "
                                           "every token to its top-k experts", "moe_expert_capacity_factor=None"),
    "moe_expert_rank_capacity_factor": _refused("drops tokens past each expert rank's capacity",
                                                "moe_expert_rank_capacity_factor=None"),
    "moe_input_jitter_eps": _refused("multiplies the router's input by random noise in every forward",
                                     "moe_input_jitter_eps=None"),
    "moe_router_force_load_balancing": _refused("replaces the router's logits by random ones (a benchmark mode)",
                                                "moe_router_force_load_balancing=False"),
    "moe_router_force_biased": _refused("adds a random bias to the router's logits (a benchmark mode)",
                                        "moe_router_force_biased=None"),
    "moe_router_load_balancing_type": Setting(
        "irrelevant", "a training loss, except 'sinkhorn', which changes the routing", values=BALANCING_LOSSES),
    "moe_latent_size": _refused("experts computed in a latent projection of the hidden state", "moe_latent_size=None"),
    "moe_shared_expert_glu_interleave_size": _refused(
        "the shared expert's [gate; up] rows interleaved in blocks: the export splits them as two halves",
        "moe_shared_expert_glu_interleave_size=None"),
    "moe_mlp_glu_interleave_size": _refused(
        "the experts' [gate; up] rows interleaved in blocks: the export splits them as two halves",
        "moe_mlp_glu_interleave_size=None"),
    "window_attn_skip_freq": _refused("sliding-window attention on some layers only", "window_attn_skip_freq=None"),
    "experimental_attention_variant": _refused("another attention (DSA, gated delta net, ...)",
                                               "experimental_attention_variant=None"),
    "linear_attention_freq": _refused("linear-attention layers in the stack", "linear_attention_freq=None"),
    "use_mup": _refused("MuP scales the embeddings, the attention and the logits", "use_mup=False"),
    "mrope_section": _refused("multimodal RoPE sections", "mrope_section=None"),
    "is_hybrid_model": _refused("a hybrid (Mamba) stack", "is_hybrid_model=False"),
    "heterogeneous_block_specs": _refused("layers of different shapes (Nemotron-NAS)", "heterogeneous_block_specs=False"),
    "mtp_use_repeated_layer": _refused("one MTP layer's weights repeated: transformers' DeepseekV3 has "
                                       "num_nextn_predict_layers separate ones", "mtp_use_repeated_layer=False"),
    "mtp_hybrid_override_pattern": _refused("a hybrid MTP block", "mtp_hybrid_override_pattern=None"),
    "mla_down_proj_fusion": _refused("MLA's q and kv down projections fused into one weight, not mapped",
                                     "mla_down_proj_fusion=False"),
    "fp8_param": _refused("the weights are FP8 tensors; the export reads plain floating-point weights", "fp8_param=False"),
    "fp4_param": _refused("the weights are FP4 tensors; the export reads plain floating-point weights", "fp4_param=False"),
    # ---- dormant: only read while a refused setting is on
    **_group(_irrelevant("DSA's indexer, read only with experimental_attention_variant (refused)",
                         dormant="experimental_attention_variant"),
             "experimental_attention_variant_loss_scale_func", "dsa_indexer_n_heads", "dsa_indexer_head_dim",
             "dsa_indexer_topk", "dsa_indexer_topk_freq", "dsa_indexer_skip_topk_offset", "dsa_indexer_loss_coeff",
             "dsa_indexer_use_sparse_loss", "dsa_kernel_backend", "dsa_indexer_rope_interleaved",
             "dsa_indexer_rotate_activation", "dsa_indexer_scoring_relu", "dsa_indexer_k_norm_epsilon",
             "dsa_indexer_k_norm_fp32"),
    **_group(_irrelevant("linear attention's sizes, read only with linear_attention_freq (refused)",
                         dormant="linear_attention_freq"),
             "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
             "linear_num_value_heads"),
    **_group(_irrelevant("MuP's multipliers, read only with use_mup (refused)", dormant="use_mup"),
             "mup_width_mult", "mup_base_hidden_size", "mup_embedding_mult", "mup_output_mult", "mup_base_head_dim",
             "mup_attn_scale_power"),
    **_group(_irrelevant("Mamba's sizes, read only with is_hybrid_model (refused)", dormant="is_hybrid_model"),
             "mamba_state_dim", "mamba_head_dim", "mamba_num_groups", "mamba_num_heads",
             "mamba_training_ssm_states_dtype", "use_mamba_mem_eff_path"),
    **_group(_irrelevant("read only with heterogeneous_block_specs (refused)", dormant="heterogeneous_block_specs"),
             "hetereogenous_dist_checkpoint"),
    **_group(_irrelevant("read only with moe_expert_capacity_factor (refused)", dormant="moe_expert_capacity_factor"),
             "moe_token_drop_policy"),
    # ---- irrelevant to the forward
    **_group(_irrelevant(PARALLEL),
             "tensor_model_parallel_size", "tensor_parallel_num_weight_shards", "gtp_weight_remat_size",
             "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_size",
             "virtual_pipeline_model_parallel_size", "sequence_parallel", "context_parallel_size",
             "hierarchical_context_parallel_sizes", "max_seqlen_per_dp_cp_rank", "hybrid_context_parallel",
             "expert_model_parallel_size", "expert_tensor_parallel_size", "expert_tensor_parallel_num_weight_shards",
             "expert_gtp_weight_remat_size", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
             "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
             "account_for_loss_in_pipeline_split", "variable_seq_lengths", "overlap_p2p_comm", "batch_p2p_comm",
             "batch_p2p_sync", "use_ring_exchange_p2p", "deallocate_pipeline_outputs", "overlap_p2p_comm_warmup_flush",
             "microbatch_group_size_per_vp_stage", "mtp_standalone", "cp_comm_type", "moe_token_dispatcher_type",
             "moe_enable_deepep", "moe_flex_dispatcher_backend", "moe_permute_fusion_into_hybridep",
             "moe_hybridep_pad_uneven_dispatch_inputs", "moe_flex_dispatcher_num_sms", "moe_deepep_num_sms",
             "moe_hybridep_num_sms", "moe_hybridep_num_blocks_permute", "moe_hybridep_num_blocks_unpermute",
             "moe_hybridep_num_sms_preprocessing", "moe_ncclep_static_shape", "moe_ncclep_zero_copy"),
    **_group(_irrelevant(TRAINING),
             "timers", "finalize_model_grads_func", "grad_scale_func", "moe_grad_scale_func", "mtp_grad_scale_func",
             "no_sync_func", "grad_sync_func", "param_sync_func", "perform_initialization", "use_cpu_initialization",
             "barrier_with_L1_time", "gradient_accumulation_fusion", "defer_embedding_wgrad_compute",
             "wgrad_deferral_limit", "delay_wgrad_compute", "overlap_dispatch_backward_with_experts_wgrad",
             "cross_entropy_loss_fusion", "cross_entropy_fusion_impl", "deterministic_mode",
             "mtp_loss_scaling_factor", "mtp_detach_heads", "init_method", "output_layer_init_method",
             "init_method_std", "embedding_init_method", "embedding_init_method_std", "init_model_with_meta_device",
             "calculate_per_token_loss", "qk_clip", "qk_clip_alpha", "qk_clip_threshold",
             "recompute_granularity", "recompute_method", "recompute_num_layers", "distribute_saved_activations",
             "recompute_modules", "moe_layer_recompute", "moe_aux_loss_coeff", "moe_z_loss_coeff",
             "moe_router_bias_update_rate", "moe_router_quantile_balancing_ema", "moe_enable_routing_replay",
             "moe_per_layer_logging", "num_microbatches_with_partial_activation_checkpoints",
             "moe_token_dropping"),
    **_group(_irrelevant(DROPOUT), "hidden_dropout", "attention_dropout"),
    **_group(_irrelevant(KERNEL),
             "attention_backend", "flash_attention_version", "activation_func_fp8_input_store",
             "bias_activation_fusion", "masked_softmax_fusion", "persist_layer_norm", "memory_efficient_layer_norm",
             "bias_dropout_fusion", "apply_rope_fusion", "use_fused_weighted_squared_relu", "fused_single_qkv_rope",
             "fused_residual_rmsnorm", "use_transformer_engine_op_fuser", "high_priority_a2a_comm_stream",
             "moe_shared_expert_overlap", "use_grouped_gemm_for_shared_expert", "use_grouped_gemm_for_dense_mlp",
             "moe_grouped_gemm", "moe_single_grouped_weight", "moe_single_grouped_bias",
             "moe_router_padding_for_quantization", "moe_router_padding_for_fp8", "moe_pad_expert_input_to_capacity",
             "moe_pad_experts_for_cuda_graph_inference", "moe_permute_fusion", "moe_router_fusion",
             "clone_scatter_output_in_embedding", "disable_parameter_transpose_cache", "use_te_activation_func",
             "mlp_chunks_for_prefill", "mlp_chunks_for_training", "transformer_impl",
             "fine_grained_activation_offloading", "offload_modules", "min_offloaded_tensor_size",
             "delay_offload_until_cuda_graph", "delta_offload_bytes_across_pp_ranks", "activation_offload_fraction",
             "moe_paged_stash", "moe_paged_stash_page_size", "moe_paged_stash_buffer_size_factor_cuda",
             "moe_paged_stash_buffer_size_factor_cpu", "fine_grained_offloading_max_inflight_offloads",
             "tp_comm_overlap", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad", "tp_comm_overlap_ag", "tp_comm_overlap_rs",
             "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag", "tp_comm_atomic_ag", "tp_comm_split_rs",
             "tp_comm_atomic_rs", "tp_comm_overlap_disable_qkv", "tp_comm_overlap_disable_fc1",
             "tp_comm_bootstrap_backend", "overlap_moe_expert_parallel_comm", "ep_overlap_early_attn_memory_release",
             "use_te_rng_tracker", "cpu_offloading", "cpu_offloading_num_layers", "_cpu_offloading_context",
             "cpu_offloading_activations", "cpu_offloading_weights", "cpu_offloading_double_buffering",
             "cpu_offloading_retain_pinned_cpu_buffers", "cache_mla_latents", "enable_cuda_graph",
             "cuda_graph_use_single_mempool", "cuda_graph_retain_backward_graph", "cuda_graph_warmup_steps",
             "external_cuda_graph", "cuda_graph_impl", "cuda_graph_modules", "cuda_graph_scope"),
    **_group(_irrelevant(NUMERICS),
             "fp16", "bf16", "pipeline_dtype", "enable_autocast", "autocast_dtype", "fp32_residual_connection",
             "apply_query_key_layer_scaling", "attention_softmax_in_fp32", "disable_bf16_reduced_precision_matmul",
             "moe_router_dtype", "batch_invariant_mode", "fp8", "fp8_recipe", "fp8_quantizer_factory", "fp8_margin",
             "fp8_interval", "fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_wgrad", "fp8_output_proj",
             "fp8_dot_product_attention", "fp8_multi_head_attention", "tp_only_amax_red", "first_last_layers_bf16",
             "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "use_kitchen", "use_kitchen_attention",
             "kitchen_attention_backend", "fp4", "fp4_recipe", "fp4_quantizer_factory", "quant_recipe"),
    **_group(_irrelevant(INFERENCE),
             "flash_decode", "inference_rng_tracker", "inference_sampling_seed", "symmetric_ar_type",
             "nccl_all_reduce_for_prefill", "use_inference_optimized_layers", "inference_fuse_tp_communication",
             "inference_disable_triton_nvls_kernels", "inference_grouped_gemm_backend",
             "inference_moe_disable_fused_quant_kernels", "inference_moe_token_dispatcher_type",
             "inference_cuda_graph_scope"),
    **_group(_irrelevant(LOGGING), "log_max_attention_logit", "test_mode", "config_logger_dir"),
}


class Unexpressed(NamedTuple):
    """A setting the mapping cannot prove it handles: its value, the dataclass default, the table's verdict."""
    field: str
    value: Any
    default: Any
    why: str
    fix: str


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _same(value, default) -> bool:
    if value is default:
        return True
    if isinstance(value, float) and isinstance(default, float) and math.isnan(value) and math.isnan(default):
        return True
    try:
        return bool(value == default)
    except Exception:  # noqa: BLE001 - tensors, objects without a usable ==: not provably the default
        return False


def _text(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def unexpressed(cfg) -> list[Unexpressed]:
    """Every field of ``cfg`` (a ``TransformerConfig`` dataclass) that differs from its dataclass
    default and that :data:`SETTINGS` neither expresses nor proves irrelevant, in field order.

    Raises TypeError when ``cfg`` is not a dataclass instance (its settings cannot be walked)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"config={type(cfg).__name__}: not a Megatron-Core TransformerConfig dataclass, so its "
                        "settings cannot be checked (pass the model chunks, a GPTModel or a TransformerConfig)")
    fields = dataclasses.fields(cfg)
    defaults = {f.name: _default(f) for f in fields}
    out = []
    for f in fields:
        value, default = getattr(cfg, f.name, None), defaults[f.name]
        if default is not dataclasses.MISSING and _same(value, default):
            continue
        s = SETTINGS.get(f.name)
        fix = f"{f.name}={_text(default)}" if default is not dataclasses.MISSING else f"leave {f.name} unset"
        if s is None:
            out.append(Unexpressed(f.name, value, default, "a Megatron-Core setting this version of mcore-reshard "
                                   "does not know: it may change the forward", fix))
        elif s.kind == "refused":
            out.append(Unexpressed(f.name, value, default, s.why, s.fix or fix))
        elif s.kind == "irrelevant" and s.values is not None:
            items = value if isinstance(value, (list, tuple)) else [value]
            if not all(v in s.values for v in items):
                out.append(Unexpressed(f.name, value, default, s.why,
                                       f"{f.name} in {', '.join(map(repr, s.values))}"))
        elif s.kind == "irrelevant" and s.dormant is not None and s.dormant not in defaults:
            out.append(Unexpressed(f.name, value, default, f"{s.why}; but {s.dormant} is not a field of "
                                   f"{type(cfg).__name__}", fix))
    return out


def describe(u: Unexpressed) -> str:
    """One line of a refusal: ``field=value (default ...): why; closest fix: ...``."""
    return f"{u.field}={_text(u.value)} (default {_text(u.default)}): {u.why}; closest fix: {u.fix}"


__all__ = ["CONFIG_FIELDS", "SETTINGS", "Setting", "Unexpressed", "describe", "unexpressed"]
