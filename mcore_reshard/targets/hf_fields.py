"""Every Hugging Face config field the layouts' config reader (:func:`mcore_reshard.targets.from_hf_config`)
meets, classified: closed-world.

The reader turns an engine's or a checkpoint's transformers config into a :class:`ModelConfig`, the
description of the canonical tensors every target layout places.  A field is

* **read** (:data:`READ`) -- it becomes a ``ModelConfig`` field;
* **required** (:data:`REQUIRE`) -- it changes which tensors exist or what their rows mean, and the
  layouts only describe one value (``mlp_bias=True`` adds tensors no layout has);
* **irrelevant** to the tensors (:data:`METADATA`: names, tokens, generation, runtime state;
  :data:`ENGINE_MATH`: how the engine computes with the same tensors -- RoPE, epsilons, routing
  weights -- which it reads from this same config);
* anything else is refused when its value differs from the transformers config class's default
  (or, without transformers, always): a field a newer transformers or another model variant adds
  may add or reshape tensors.

Example::

    model_type  field                 value          verdict
    llama       rms_norm_eps          1e-5           irrelevant (engine math)
    llama       mlp_bias              True           refused: mlp_bias=False (MLP biases are not in the layouts)
    deepseek_v3 quantization_config   {fp8 ...}      refused (FP8 weights + scales)
    qwen3_moe   shared_expert_...     512            refused: not known (shared_expert_...=<default>)
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, NamedTuple


class Require(NamedTuple):
    """The value a field must have: ``equals`` a constant, ``one_of`` constants, or ``sum_of`` two other fields."""
    why: str
    fix: str
    equals: Any = None
    one_of: tuple | None = None
    sum_of: tuple[str, str] | None = None


METADATA = frozenset((
    "_name_or_path", "architectures", "auto_map", "model_type", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "return_dict", "output_hidden_states", "output_attentions", "torchscript",
    "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "finetuning_task", "id2label",
    "label2id", "problem_type", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id", "eos_token_id",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "max_length", "min_length", "do_sample",
    "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
    "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "num_labels",
    # training only: auxiliary losses, router logits as an output, dropout (off in inference), expert parallel size
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "attention_dropout", "ep_size",
))
METADATA_WHY = "names, tokens, generation defaults, runtime state or training only"

ENGINE_MATH = frozenset((
    "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "partial_rotary_factor", "pretraining_tp", "sliding_window", "use_sliding_window", "max_window_layers",
    "layer_types", "num_experts_per_tok", "norm_topk_prob", "routed_scaling_factor", "topk_group", "scoring_func",
    "rope_interleave",
))
ENGINE_MATH_WHY = ("how the engine computes with the same tensors, read by the engine from this same config "
                   "(hf_config derives it from the Megatron model)")

READ = {
    "llama": frozenset(("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "tie_word_embeddings", "attention_bias")),
    "qwen3_moe": frozenset(("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
                            "num_experts", "num_local_experts", "moe_intermediate_size", "decoder_sparse_step",
                            "mlp_only_layers", "attention_bias")),
    "deepseek_v3": frozenset(("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
                              "num_key_value_heads", "head_dim", "intermediate_size", "tie_word_embeddings",
                              "n_routed_experts", "moe_intermediate_size", "n_shared_experts", "first_k_dense_replace",
                              "moe_layer_freq", "n_group", "topk_method", "q_lora_rank", "kv_lora_rank",
                              "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "num_nextn_predict_layers",
                              "qk_head_dim")),
}

_O_PROJ_BIAS = Require("attention_bias=True also gives o_proj a bias, which no layout has (q/k/v biases alone: "
                       "model_type 'qwen2')", "attention_bias=False", equals=False)
_QUANTIZED = Require("quantized weights (weights + scales): the layouts describe floating-point tensors "
                     "(FP8 block scales: mcore_reshard.fp8)", "a bf16 / fp32 model (no quantization_config)",
                     equals=None)
REQUIRE: dict[str, dict[str, Require]] = {   # by model type; "*": every model type
    "*": {"quantization_config": _QUANTIZED, "compression_config": _QUANTIZED},
    "llama": {"mlp_bias": Require("MLP biases are not in the layouts", "mlp_bias=False", equals=False),
              "attention_bias": _O_PROJ_BIAS},
    "qwen3": {"attention_bias": _O_PROJ_BIAS},
    "mistral": {"attention_bias": _O_PROJ_BIAS},
    "qwen3_moe": {"attention_bias": _O_PROJ_BIAS},
    "deepseek_v3": {
        "attention_bias": Require("MLA projections with biases are not in the layouts", "attention_bias=False",
                                  equals=False),
        "topk_method": Require("the router: 'noaux_tc' has e_score_correction_bias, the greedy ones none",
                               "topk_method='noaux_tc'", one_of=("noaux_tc", "greedy", "group_limited_greedy", None)),
        "qk_head_dim": Require("q_b_proj's rows per head", "qk_head_dim = qk_nope_head_dim + qk_rope_head_dim",
                               sum_of=("qk_nope_head_dim", "qk_rope_head_dim")),
    },
}
REQUIRE["deepseek_v2"] = {**REQUIRE["deepseek_v3"], "mlp_bias": REQUIRE["llama"]["mlp_bias"]}


@lru_cache(maxsize=None)
def _class_defaults(model_type: str) -> dict | None:
    """The transformers config class's defaults for ``model_type`` (None without transformers)."""
    try:
        from transformers import AutoConfig
        return AutoConfig.for_model(model_type).to_dict()
    except Exception:  # noqa: BLE001 - no transformers, or a model type it does not know: nothing to compare with
        return None


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def check_hf_fields(items: Mapping[str, Any], model_type: str, family: str) -> list[str]:
    """One line per field of ``items`` (a transformers config as a dict) that the reader cannot prove it handles:
    a required value not met, or a field none of the tables knows whose value differs from the default."""
    requires = {**REQUIRE["*"], **REQUIRE.get(model_type, {})}
    known = METADATA | ENGINE_MATH | READ[family] | set(requires)
    # transformers' defaults only for a field the tables do not know (no transformers import otherwise)
    defaults = _class_defaults(model_type) if any(k not in known and not k.startswith("_") for k in items) else None
    problems = []
    for key, value in items.items():
        if key in requires:
            r = requires[key]
            if r.sum_of is not None:
                a, b = (items.get(k) for k in r.sum_of)
                bad = value is not None and a is not None and b is not None and value != a + b
            elif r.one_of is not None:
                bad = value not in r.one_of
            elif isinstance(r.equals, bool):
                bad = bool(value) != r.equals
            elif r.equals is None:
                bad = bool(value)
            else:
                bad = value != r.equals
            if bad:
                problems.append(f"{key}={_short(value)}: {r.why}; closest fix: {r.fix}")
            continue
        if key.startswith("_") or key in METADATA or key in ENGINE_MATH or key in READ[family]:
            continue
        if defaults is not None and key in defaults and defaults[key] == value:
            continue
        if defaults is None:
            why = "transformers is not importable, so its default is unknown"
            fix = f"drop {key}"
        elif key in defaults:
            why, fix = "it may add or reshape tensors", f"{key}={_short(defaults[key])}"
        else:
            why, fix = f"transformers' {model_type} config has no such field either", f"drop {key}"
        problems.append(f"{key}={_short(value)}: a field the layouts' reader does not know ({why}); closest fix: {fix}")
    return problems


__all__ = ["ENGINE_MATH", "METADATA", "READ", "REQUIRE", "Require", "check_hf_fields"]
