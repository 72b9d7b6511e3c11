"""Target layouts (layer 2, next to the mapper): where inference engines keep the canonical
(Hugging Face) tensors.

* :func:`hf_layout` -- unsharded Hugging Face tensors on one rank (stacked or per-expert names);
* :func:`vllm_layout` -- every rank of a vLLM deployment (TP, DP, EP, PP, MTP draft model);
* :func:`sglang_layout` -- every rank of an SGLang deployment (TP, DP attention, EP, fused
  shared expert, MTP draft model);
* :mod:`.config` -- :class:`ModelConfig` (HF field names), presets, :func:`canonical_tensors`.

All layouts are metadata only (no torch), built from a :class:`ModelConfig`; plan a refit with
``make_plan(canonicalize(megatron_layout, family, cfg), vllm_layout(cfg, tp=8))``.  Imports only
layer 1 (:mod:`mcore_reshard.core`'s box and layout).
"""
from .config import (
                     ModelConfig,
                     canonical_tensors,
                     dsv3_671b,
                     dsv3_tiny,
                     from_hf_config,
                     gqa_tiny,
                     layer_tensors,
                     qwen3_moe_tiny,
)
from .hf import hf_layout
from .sglang import sglang_layout
from .vllm import pad_vocab, pp_partition, vllm_layout

__all__ = ["ModelConfig", "canonical_tensors", "dsv3_671b", "dsv3_tiny", "from_hf_config", "gqa_tiny",
           "hf_layout", "layer_tensors", "pad_vocab", "pp_partition", "qwen3_moe_tiny", "sglang_layout",
           "vllm_layout"]
