"""Model configs (Hugging Face field names) and the canonical tensors they define.

Canonical tensors are the Hugging Face names the family tables in ``layouts/*.toml`` map Megatron
tensors to (transformers 5 fused experts: ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` with the gate
rows first and ``mlp.experts.down_proj`` ``[E, H, I]``).  Every target layout (``hf``, ``vllm``,
``sglang``) places boxes of these tensors, so a plan between any Megatron layout and any target is
``make_plan(canonicalize(megatron), target)``.

Example, :func:`dsv3_tiny` (4 layers, layer 0 dense, one MTP layer as ``model.layers.4``)::

    model.embed_tokens.weight                         [128, 64]
    model.layers.0.self_attn.q_a_proj.weight          [32, 64]
    model.layers.0.mlp.gate_proj.weight               [128, 64]
    model.layers.1.mlp.gate.e_score_correction_bias   [8]          float32
    model.layers.1.mlp.experts.gate_up_proj           [8, 64, 64]
    model.layers.4.eh_proj.weight                     [64, 128]    (MTP)
    lm_head.weight                                    [128, 64]

Families: ``deepseek_v3`` (MLA, routed + shared experts, dense first layers, sigmoid router with
``e_score_correction_bias``, MTP), ``llama`` (Llama / Qwen2 / Mistral dense GQA, optional q/k/v
bias and tied embeddings) and ``qwen3_moe`` (GQA with q/k norms, every layer MoE unless listed in
``mlp_only_layers``, no shared expert).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from ..core.layout import LayoutError, TensorMeta

FAMILY_OF_MODEL_TYPE = {
    "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3",
    "llama": "llama", "qwen2": "llama", "mistral": "llama", "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields the layouts need, under their Hugging Face names.

    Qwen3-MoE's ``num_experts`` is stored as ``n_routed_experts``.  ``qk_norm`` (Qwen3 q/k RMSNorm)
    and ``router_bias`` (DeepSeek's ``e_score_correction_bias``; ``topk_method == "noaux_tc"``)
    are not HF fields but follow from the model type.
    """
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int = 0
    # MoE
    n_routed_experts: int = 0
    moe_intermediate_size: int = 0
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_bias: bool = False
    n_group: int = 1                     # DeepSeek expert groups (grouped top-k); vLLM's round-robin needs > 1
    # MLA
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # misc
    num_nextn_predict_layers: int = 0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.model_type not in FAMILY_OF_MODEL_TYPE:
            raise ValueError(f"unsupported model_type {self.model_type!r}; known: {sorted(FAMILY_OF_MODEL_TYPE)}")
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def family(self) -> str:
        return FAMILY_OF_MODEL_TYPE[self.model_type]

    @property
    def is_mla(self) -> bool:
        return self.family == "deepseek_v3"

    @property
    def mtp_layers(self) -> range:
        """Canonical layer indices of the MTP layers (``num_hidden_layers + k``)."""
        n = self.num_nextn_predict_layers if self.family == "deepseek_v3" else 0
        return range(self.num_hidden_layers, self.num_hidden_layers + n)

    def is_moe_layer(self, layer: int) -> bool:
        """vLLM/SGLang/HF rule (MTP layers included: DeepSeek-V3's layer 61 is MoE)."""
        if not self.n_routed_experts:
            return False
        if self.family == "deepseek_v3":
            return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0
        if self.family == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return False

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * (self.n_shared_experts or 0)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def with_(self, **kw) -> "ModelConfig":
        return replace(self, **kw)

    def to_hf_dict(self) -> dict:
        """The Hugging Face ``config.json`` fields :func:`from_hf_config` reads back to this config (the
        family's own field names only: ``from_hf_config(cfg.to_hf_dict()) == cfg``)."""
        from .hf_fields import READ
        out = {"model_type": self.model_type}
        for name in sorted(READ[self.family]):
            if name == "topk_method":
                out[name] = "noaux_tc" if self.router_bias else "greedy"
            elif name == "num_local_experts":
                continue
            elif name == "num_experts":
                out[name] = self.n_routed_experts
            elif name == "qk_head_dim":
                out[name] = self.qk_head_dim
            elif name == "mlp_only_layers":
                out[name] = list(self.mlp_only_layers)
            else:
                out[name] = getattr(self, name)
        return out


# ----------------------------------------------------------------------------------- presets

def dsv3_671b() -> ModelConfig:
    """DeepSeek-V3 / R1 (671B): HF ``config.json`` of ``deepseek-ai/DeepSeek-V3``."""
    return ModelConfig(
        model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, vocab_size=129280,
        num_attention_heads=128, num_key_value_heads=128, head_dim=64, intermediate_size=18432,
        n_routed_experts=256, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
        router_bias=True, n_group=8, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, num_nextn_predict_layers=1, tie_word_embeddings=False)


def dsv3_tiny(num_nextn_predict_layers: int = 1, n_routed_experts: int = 8) -> ModelConfig:
    """The tiny Megatron test model (``mcore_reshard.testing.megatron_cpu.build_dsv3_tiny``) in HF terms."""
    return ModelConfig(
        model_type="deepseek_v3", hidden_size=64, num_hidden_layers=4, vocab_size=128,
        num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=128,
        n_routed_experts=n_routed_experts, moe_intermediate_size=32, n_shared_experts=1,
        first_k_dense_replace=1, router_bias=True, n_group=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=num_nextn_predict_layers)


def gqa_tiny(num_key_value_heads: int = 4, tie_word_embeddings: bool = False, attention_bias: bool = False,
             vocab_size: int = 128) -> ModelConfig:
    """``mcore_reshard.testing.megatron_cpu.build_gqa_dense_tiny``: hidden 64, 8 heads of 8, SwiGLU 128, 4 layers."""
    return ModelConfig(
        model_type="qwen2" if attention_bias else "llama", hidden_size=64, num_hidden_layers=4,
        vocab_size=vocab_size, num_attention_heads=8, num_key_value_heads=num_key_value_heads, head_dim=8,
        intermediate_size=128, tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias)


def qwen3_moe_tiny(num_key_value_heads: int = 4, n_routed_experts: int = 8) -> ModelConfig:
    """``mcore_reshard.testing.megatron_cpu.build_qwen3_moe_tiny``: 8 heads of 16, q/k norms, 8 experts of 32."""
    return ModelConfig(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4, vocab_size=128, num_attention_heads=8,
        num_key_value_heads=num_key_value_heads, head_dim=16, intermediate_size=128,
        n_routed_experts=n_routed_experts, moe_intermediate_size=32, qk_norm=True)


def from_hf_config(obj: Any) -> ModelConfig:
    """A :class:`ModelConfig` from a transformers ``PretrainedConfig`` (or a ``config.json`` dict).

    Closed-world (:mod:`mcore_reshard.targets.hf_fields`): every field of the config is read,
    checked against the one value the layouts describe (``mlp_bias=False``, no
    ``quantization_config``), or known not to change the tensors; any other field whose value
    differs from the transformers default is refused (:class:`LayoutError` naming each field and its fix)."""
    from .hf_fields import check_hf_fields
    if hasattr(obj, "get_text_config"):
        obj = obj.get_text_config()
    get = (lambda k, d=None: obj.get(k, d)) if isinstance(obj, Mapping) else (lambda k, d=None: getattr(obj, k, d))
    mt = get("model_type")
    if mt not in FAMILY_OF_MODEL_TYPE:
        raise ValueError(f"unsupported model_type {mt!r}; known: {sorted(FAMILY_OF_MODEL_TYPE)}")
    fam = FAMILY_OF_MODEL_TYPE[mt]
    items = dict(obj) if isinstance(obj, Mapping) else (obj.to_dict() if hasattr(obj, "to_dict") else dict(vars(obj)))
    problems = check_hf_fields(items, mt, fam)
    if problems:
        raise LayoutError(f"the {mt} config has {len(problems)} field(s) the layouts cannot describe:\n  "
                          + "\n  ".join(problems))

    def num(k, d=0):
        v = get(k, d)
        return d if v is None else v

    heads = int(get("num_attention_heads"))
    kw = dict(model_type=mt, hidden_size=int(get("hidden_size")), num_hidden_layers=int(get("num_hidden_layers")),
              vocab_size=int(get("vocab_size")), num_attention_heads=heads,
              num_key_value_heads=int(num("num_key_value_heads", heads)),
              head_dim=get("head_dim"), intermediate_size=int(num("intermediate_size")),
              tie_word_embeddings=bool(get("tie_word_embeddings", False)))
    if fam == "deepseek_v3":
        topk = get("topk_method")
        kw.update(n_routed_experts=int(num("n_routed_experts")), moe_intermediate_size=int(num("moe_intermediate_size")),
                  n_shared_experts=int(num("n_shared_experts")), first_k_dense_replace=int(num("first_k_dense_replace")),
                  moe_layer_freq=int(num("moe_layer_freq", 1)), n_group=int(num("n_group", 1)),
                  router_bias=(topk == "noaux_tc") if topk is not None else mt == "deepseek_v3",
                  q_lora_rank=get("q_lora_rank"), kv_lora_rank=int(num("kv_lora_rank")),
                  qk_nope_head_dim=int(num("qk_nope_head_dim")), qk_rope_head_dim=int(num("qk_rope_head_dim")),
                  v_head_dim=int(num("v_head_dim")), num_nextn_predict_layers=int(num("num_nextn_predict_layers")))
    elif fam == "qwen3_moe":
        n_exp = get("num_experts", None)
        if n_exp is None:
            n_exp = get("num_local_experts", 0)
        kw.update(n_routed_experts=int(n_exp or 0), moe_intermediate_size=int(num("moe_intermediate_size")),
                  decoder_sparse_step=int(num("decoder_sparse_step", 1)),
                  mlp_only_layers=tuple(get("mlp_only_layers") or ()), qk_norm=True,
                  attention_bias=bool(get("attention_bias", False)))
    else:
        kw.update(attention_bias=True if mt == "qwen2" else bool(get("attention_bias", False)),
                  qk_norm=mt == "qwen3")
    if kw["head_dim"] is not None:
        kw["head_dim"] = int(kw["head_dim"])
    return ModelConfig(**kw)


# ----------------------------------------------------------------------------------- canonical tensors

def layer_tensors(cfg: ModelConfig, layer: int, dtype: str = "bfloat16") -> dict[str, tuple[tuple[int, ...], str]]:
    """Suffix (inside ``model.layers.{layer}.``) -> (shape, dtype) of one layer's canonical tensors."""
    H = cfg.hidden_size
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "input_layernorm.weight": ((H,), dtype),
        "post_attention_layernorm.weight": ((H,), dtype),
    }
    if cfg.is_mla:
        nh = cfg.num_attention_heads
        if cfg.q_lora_rank:
            out["self_attn.q_a_proj.weight"] = ((cfg.q_lora_rank, H), dtype)
            out["self_attn.q_a_layernorm.weight"] = ((cfg.q_lora_rank,), dtype)
            out["self_attn.q_b_proj.weight"] = ((nh * cfg.qk_head_dim, cfg.q_lora_rank), dtype)
        else:
            out["self_attn.q_proj.weight"] = ((nh * cfg.qk_head_dim, H), dtype)
        out["self_attn.kv_a_proj_with_mqa.weight"] = ((cfg.kv_lora_rank + cfg.qk_rope_head_dim, H), dtype)
        out["self_attn.kv_a_layernorm.weight"] = ((cfg.kv_lora_rank,), dtype)
        out["self_attn.kv_b_proj.weight"] = ((nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), dtype)
        out["self_attn.o_proj.weight"] = ((H, nh * cfg.v_head_dim), dtype)
    else:
        hd, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        for p, n in (("q", nq), ("k", nkv), ("v", nkv)):
            out[f"self_attn.{p}_proj.weight"] = ((n * hd, H), dtype)
            if cfg.attention_bias:
                out[f"self_attn.{p}_proj.bias"] = ((n * hd,), dtype)
        out["self_attn.o_proj.weight"] = ((H, nq * hd), dtype)
        if cfg.qk_norm:
            out["self_attn.q_norm.weight"] = ((hd,), dtype)
            out["self_attn.k_norm.weight"] = ((hd,), dtype)
    if cfg.is_moe_layer(layer):
        E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
        out["mlp.gate.weight"] = ((E, H), dtype)
        if cfg.router_bias:
            out["mlp.gate.e_score_correction_bias"] = ((E,), "float32")
        out["mlp.experts.gate_up_proj"] = ((E, 2 * I, H), dtype)
        out["mlp.experts.down_proj"] = ((E, H, I), dtype)
        if cfg.n_shared_experts:
            Is = cfg.shared_intermediate_size
            out["mlp.shared_experts.gate_proj.weight"] = ((Is, H), dtype)
            out["mlp.shared_experts.up_proj.weight"] = ((Is, H), dtype)
            out["mlp.shared_experts.down_proj.weight"] = ((H, Is), dtype)
    else:
        I = cfg.intermediate_size
        out["mlp.gate_proj.weight"] = ((I, H), dtype)
        out["mlp.up_proj.weight"] = ((I, H), dtype)
        out["mlp.down_proj.weight"] = ((H, I), dtype)
    if layer in cfg.mtp_layers:
        out["enorm.weight"] = ((H,), dtype)
        out["hnorm.weight"] = ((H,), dtype)
        out["eh_proj.weight"] = ((H, 2 * H), dtype)
        out["shared_head.norm.weight"] = ((H,), dtype)
    return out


def canonical_tensors(cfg: ModelConfig, dtype: str = "bfloat16") -> list[TensorMeta]:
    """Every canonical tensor of the model (main model, then MTP layers), with shape and dtype.

    Norms and weights are in ``dtype``; DeepSeek's router bias is float32.  Tied embeddings have no
    ``lm_head.weight``.  MTP layers reuse ``model.embed_tokens.weight`` and ``lm_head.weight`` (the
    Hugging Face checkpoint's ``model.layers.{N}.embed_tokens`` / ``shared_head.head`` copies are
    not separate canonical tensors)."""
    V, H = cfg.vocab_size, cfg.hidden_size
    out = [TensorMeta("model.embed_tokens.weight", (V, H), dtype)]
    for layer in list(range(cfg.num_hidden_layers)) + list(cfg.mtp_layers):
        for suffix, (shape, dt) in layer_tensors(cfg, layer, dtype).items():
            out.append(TensorMeta(f"model.layers.{layer}.{suffix}", shape, dt))
    out.append(TensorMeta("model.norm.weight", (H,), dtype))
    if not cfg.tie_word_embeddings:
        out.append(TensorMeta("lm_head.weight", (V, H), dtype))
    return out


__all__ = ["ModelConfig", "canonical_tensors", "dsv3_671b", "dsv3_tiny", "from_hf_config", "gqa_tiny",
           "layer_tensors", "qwen3_moe_tiny"]
