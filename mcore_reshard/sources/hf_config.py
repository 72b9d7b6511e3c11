"""The transformers config of a live Megatron-Core model: the one that reproduces Megatron's logits.

The weights alone do not make an HF model give Megatron's logits: ``rope_interleave``,
``norm_topk_prob``, ``n_group``/``topk_group``, ``routed_scaling_factor``, YaRN's
``rope_parameters`` or an epsilon set wrong load bit-identical weights into a model that computes
something else.  So the config is derived, never written by hand, and a Megatron setting that no
transformers config can express is refused, naming the setting and the closest fix.  Closed-world:
every field of the ``TransformerConfig`` is walked (:mod:`mcore_reshard.sources.megatron_settings`
classifies each as expressed, irrelevant to the forward, or refused); one that differs from its
default and is neither expressed nor proven irrelevant is refused (``glu_linear_offset=1.0``,
``moe_expert_capacity_factor=1.0``, a field a newer Megatron-Core added).

Three steps, each usable alone:

1. :func:`megatron_facts` reads the model (its ``TransformerConfig`` and the ``GPTModel`` fields the
   config does not carry: vocab size, RoPE base, tied embeddings) into a flat dict of JSON values,
   Megatron names plus a few derived facts (``first_k_dense``, ``n_shared_experts``,
   ``experts_scored_per_group``, ``rope_parameters`` ...).
2. :func:`hf_config_dict` checks the family table's ``[hf_config]`` section (``layouts/*.toml``:
   ``require`` entries, then the model type ``variant``) and fills its ``fields`` (HF name = fact)
   and ``constants``: a ``config.json`` dict, no transformers needed.
3. :func:`hf_config` turns it into a transformers ``PretrainedConfig``.

Example, the tiny DeepSeek-V3 test model with YaRN (factor 4 over 16 positions)::

    Megatron                                         transformers
    moe_router_topk_scaling_factor=2.5           ->  routed_scaling_factor=2.5
    moe_router_num_groups=4, group_topk=2        ->  n_group=4, topk_group=2
    moe_layer_freq=[0, 1, 1, 1]                  ->  first_k_dense_replace=1
    sigmoid router, topk 4 > 1 (renormalized)    ->  norm_topk_prob=True
    rope_type='yarn', rotary_scaling_factor=4,   ->  rope_parameters={rope_type: yarn, factor: 4.0,
      original_max_position_embeddings=16,             original_max_position_embeddings: 16, mscale: 1.0,
      mscale=1, mscale_all_dim=0.707                   mscale_all_dim: 0.707, attention_factor: 1.04, ...},
                                                     max_position_embeddings=64 (= 4 x 16)
"""
from __future__ import annotations

import math
from functools import lru_cache
from importlib import resources
from typing import Any, Mapping

from ..core.layout import LayoutError
from .megatron_settings import CONFIG_FIELDS, describe, unexpressed


class HFConfigError(LayoutError):
    """A Megatron setting that no transformers config of the family can express."""


# Settings every family needs, in the format of the tables' [[hf_config.require]] entries.
COMMON_REQUIRES = (
    dict(setting="normalization", equals="RMSNorm", why="the transformers families here use RMSNorm",
         fix="normalization='RMSNorm'"),
    dict(setting="gated_linear_unit", equals=True, why="their MLPs are SwiGLU (gate_proj, up_proj, down_proj)",
         fix="gated_linear_unit=True"),
    dict(setting="activation", equals="silu", why="hidden_act is SiLU", fix="activation_func=F.silu"),
    dict(setting="add_bias_linear", equals=False, why="their linears (but Qwen2's q/k/v) have no bias",
         fix="add_bias_linear=False (add_qkv_bias=True alone for Qwen2)"),
    dict(setting="position_embedding_type", equals="rope", why="only RoPE (plain, or YaRN for MLA) is mapped",
         fix="position_embedding_type='rope'"),
    dict(setting="rotary_percent", equals=1.0, why="partial rotary embeddings are not mapped", fix="rotary_percent=1.0"),
    dict(setting="rotary_interleaved", equals=False, why="Llama-style attention rotates halves (rotate_half)",
         fix="rotary_interleaved=False"),
    dict(setting="rope_scaling", equals=False, why="Llama-3 RoPE scaling (GPTModel rope_scaling=True) is not mapped yet",
         fix="rope_scaling=False"),
    dict(setting="seq_len_interpolation_factor", equals=None, why="linear RoPE interpolation is not mapped yet",
         fix="seq_len_interpolation_factor=None"),
    dict(setting="apply_residual_connection_post_layernorm", equals=False,
         why="transformers adds the residual before the norm", fix="apply_residual_connection_post_layernorm=False"),
    dict(setting="layernorm_zero_centered_gamma", equals=False, why="HF RMSNorm multiplies by weight, not 1 + weight",
         fix="layernorm_zero_centered_gamma=False"),
    dict(setting="softmax_scale", equals=None, why="transformers scales attention by 1/sqrt(head dim)",
         fix="softmax_scale=None"),
    dict(setting="window_size", equals=None, why="sliding-window attention is not mapped", fix="window_size=None"),
    dict(setting="no_rope_freq", equals=None, why="layers without RoPE are not mapped", fix="no_rope_freq=None"),
    dict(setting="attention_output_gate", equals=False, why="gated attention output is not mapped",
         fix="attention_output_gate=False"),
    dict(setting="moe_shared_expert_gate", equals=False, why="a gated shared expert is not mapped",
         fix="moe_shared_expert_gate=False"),
    dict(setting="moe_router_topk_limited_devices", equals=None, why="device-limited routing is not mapped",
         fix="moe_router_topk_limited_devices=None"),
    dict(setting="moe_apply_probs_on_input", equals=False, why="transformers weights the experts' outputs",
         fix="moe_apply_probs_on_input=False"),
)

def _unwrap(m):
    while not hasattr(m, "vocab_size") and hasattr(m, "module"):   # DDP / Float16Module wrappers
        m = m.module
    return m


def _json(v):
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    return str(v).removeprefix("torch.")


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Megatron's ``_yarn_get_mscale`` (= DeepSeek's ``yarn_get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


POSITIVE_FACTS = ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length")


def _positive_int(value, what: str) -> int:
    """``value`` as an integer >= 1, else :class:`HFConfigError` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HFConfigError(f"{what}={value!r}: must be an integer >= 1")
    return value


def _check_keywords(vocab_size, max_position_embeddings, rotary_base, tie_word_embeddings) -> None:
    for what, v in (("vocab_size", vocab_size), ("max_position_embeddings", max_position_embeddings)):
        if v is not None:
            _positive_int(v, what)
    if rotary_base is not None and (isinstance(rotary_base, bool) or not isinstance(rotary_base, (int, float))
                                    or not math.isfinite(rotary_base) or rotary_base <= 0):
        raise HFConfigError(f"rotary_base={rotary_base!r}: must be a finite number > 0")
    if tie_word_embeddings is not None and not isinstance(tie_word_embeddings, bool):
        raise HFConfigError(f"tie_word_embeddings={tie_word_embeddings!r}: must be True, False or None")


def megatron_facts(model, *, vocab_size: int | None = None, max_position_embeddings: int | None = None,
                   rotary_base: float | None = None, tie_word_embeddings: bool | None = None) -> dict:
    """The facts about a Megatron model that decide its transformers config (JSON values).

    ``model``: this rank's model chunks (a list of ``GPTModel``, wrapped or not), one ``GPTModel``, or
    a ``TransformerConfig``.  From a config alone, ``vocab_size`` is required (``GPTModel`` holds it)
    and ``rotary_base`` (for non-MLA configs), ``max_position_embeddings`` (default 4096) and
    ``tie_word_embeddings`` (default False) come from the keywords.  ``vocab_size`` also names the
    real vocabulary of a model whose embedding is padded (the padding rows are not exported)."""
    _check_keywords(vocab_size, max_position_embeddings, rotary_base, tie_word_embeddings)
    chunk = None
    if isinstance(model, (list, tuple)):
        if not model:
            raise HFConfigError("hf_config: no model chunks on this rank (pass them, or the TransformerConfig)")
        model = model[0]
    if hasattr(model, "config") or hasattr(model, "module"):
        chunk = _unwrap(model)
        cfg = chunk.config
    else:
        cfg = model
    if not all(hasattr(cfg, k) for k in ("num_layers", "hidden_size", "num_attention_heads")):
        raise HFConfigError(f"model={type(model).__name__}: expected model chunks, a GPTModel or a TransformerConfig")
    try:
        not_expressed = [describe(u) for u in unexpressed(cfg)]
    except TypeError as e:
        raise HFConfigError(f"model: {e}") from None
    f: dict[str, Any] = {k: _json(getattr(cfg, k, None)) for k in CONFIG_FIELDS}
    act = getattr(cfg, "activation_func", None)
    f["activation"] = getattr(act, "__name__", str(act))
    if chunk is not None:
        if vocab_size is not None and vocab_size > chunk.vocab_size:
            raise HFConfigError(f"vocab_size={vocab_size} is larger than the model's embedding ({chunk.vocab_size} rows): "
                                "pass the real vocabulary of a padded embedding, at most its rows")
        rope = getattr(chunk, "rotary_pos_emb", None)
        f.update(vocab_size=vocab_size or chunk.vocab_size,
                 max_sequence_length=max_position_embeddings or chunk.max_sequence_length,
                 tie_word_embeddings=bool(chunk.share_embeddings_and_output_weights),
                 position_embedding_type=chunk.position_embedding_type,
                 rotary_base=float(getattr(chunk, "rotary_base", None) or getattr(cfg, "rotary_base", 10000)),
                 rotary_percent=float(getattr(chunk, "rotary_percent", 1.0)),   # MLA: the config's (below)
                 rope_scaling=bool(getattr(chunk, "rotary_scaling", False)),
                 seq_len_interpolation_factor=getattr(rope, "seq_len_interpolation_factor", None))
    else:
        if vocab_size is None:
            raise HFConfigError("hf_config: a TransformerConfig does not hold the vocabulary size: pass vocab_size=")
        f.update(vocab_size=int(vocab_size), max_sequence_length=max_position_embeddings or 4096,
                 tie_word_embeddings=bool(tie_word_embeddings), position_embedding_type="rope",
                 rotary_base=float(rotary_base or getattr(cfg, "rotary_base", None) or 10000),
                 rotary_percent=float(getattr(cfg, "rotary_percent", 1.0) or 1.0), rope_scaling=False,
                 seq_len_interpolation_factor=None)
    if tie_word_embeddings is not None:
        f["tie_word_embeddings"] = bool(tie_word_embeddings)
    if f["multi_latent_attention"]:
        f["rotary_interleaved"] = False   # MLA refuses it; its own rotation is HF's rope_interleave
        f["rotary_percent"] = float(getattr(cfg, "rotary_percent", 1.0))   # MLA's RoPE reads the config's
    f["num_query_groups"] = f["num_query_groups"] or f["num_attention_heads"]
    f["num_moe_experts"] = f["num_moe_experts"] or 0
    f["mtp_layers"] = f["mtp_num_layers"] or 0
    f["dtype"] = _json(getattr(cfg, "params_dtype", None))
    f["unexpressed"] = not_expressed
    _facts_moe(f, getattr(cfg, "moe_layer_freq", 1))
    _facts_rope(f)
    return f


def _facts_moe(f: dict, freq) -> None:
    n = f["num_layers"]
    if not f["num_moe_experts"]:
        pattern = [0] * n
    elif isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(n)]
    else:
        pattern = [int(x) for x in freq]
    f["dense_layers"] = [i for i, x in enumerate(pattern) if not x]
    k = next((i for i, x in enumerate(pattern) if x), n)
    f["first_k_dense"] = k
    f["dense_layers_leading"] = f["dense_layers"] == list(range(k))
    topk = f["moe_router_topk"] or 0
    groups = f["moe_router_num_groups"] or 1
    f["router_groups"] = groups
    f["router_group_topk"] = f["moe_router_group_topk"] or 1
    f["experts_scored_per_group"] = topk // f["router_group_topk"] if groups > 1 else 2
    f["routed_scaling_factor"] = float(f["moe_router_topk_scaling_factor"] or 1.0)
    shared, moe_ffn = f["moe_shared_expert_intermediate_size"] or 0, f["moe_ffn_hidden_size"] or 0
    f["n_shared_experts"] = shared // moe_ffn if moe_ffn else 0
    f["shared_experts_whole"] = not moe_ffn or shared % moe_ffn == 0
    # Megatron renormalizes the top-k weights: sigmoid scores when top-k > 1, softmax after the
    # top-k unless moe_router_pre_softmax (transformers: norm_topk_prob)
    if f["moe_router_score_function"] == "sigmoid":
        f["norm_topk_prob"] = topk > 1
    else:
        f["norm_topk_prob"] = not f["moe_router_pre_softmax"]


def _facts_rope(f: dict) -> None:
    base = f["rotary_base"]
    f["rope_softmax_mscale"] = 1.0
    if f["multi_latent_attention"] and f["rope_type"] == "yarn":
        factor, orig = float(f["rotary_scaling_factor"]), int(f["original_max_position_embeddings"])
        mscale, mscale_all = float(f["mscale"]), float(f["mscale_all_dim"])
        # Megatron multiplies cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim); HF infers
        # another value when mscale_all_dim is 0, so it is passed explicitly
        f["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": base, "factor": factor, "original_max_position_embeddings": orig,
            "beta_fast": float(f["beta_fast"]), "beta_slow": float(f["beta_slow"]), "mscale": mscale,
            "mscale_all_dim": mscale_all, "attention_factor": _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all),
            "truncate": True}
        f["max_position_embeddings"] = int(round(factor * orig))   # what HF's YaRN expects
        return
    if f["multi_latent_attention"]:
        # Megatron's MLA scales the softmax by YaRN's mscale even with plain RoPE
        f["rope_softmax_mscale"] = _yarn_mscale(float(f["rotary_scaling_factor"] or 1.0), float(f["mscale_all_dim"] or 0.0))
        if f["rope_type"] != "rope":
            f["position_embedding_type"] = f["rope_type"]
    f["rope_parameters"] = {"rope_type": "default", "rope_theta": base}
    f["max_position_embeddings"] = int(f["max_sequence_length"])


# ------------------------------------------------------------------------------------------ tables

@lru_cache(maxsize=None)
def hf_table(family: str) -> dict:
    """The ``[hf_config]`` section of ``layouts/<family>.toml``."""
    from ..mapper.family import FamilyError, shipped_families, tomllib
    if tomllib is None:
        raise FamilyError("reading family tables needs Python >= 3.11 (tomllib)")
    try:
        text = resources.files("mcore_reshard.layouts").joinpath(f"{family}.toml").read_text()
    except FileNotFoundError:
        raise FamilyError(f"no family table {family!r}; shipped: {', '.join(shipped_families())}") from None
    table = tomllib.loads(text).get("hf_config")
    if not table:
        raise FamilyError(f"layouts/{family}.toml has no [hf_config] section: its transformers config is unknown")
    return table


def _violates(req: Mapping, value) -> bool:
    if "equals" in req:
        want = req["equals"]
        if isinstance(want, float) and isinstance(value, (int, float)) and not isinstance(value, bool):
            return not math.isclose(value, want, rel_tol=1e-12, abs_tol=0.0)
        return value != want
    if "above" in req:
        return not (isinstance(value, (int, float)) and value > req["above"])
    raise HFConfigError(f"hf_config table: requirement {dict(req)} has neither 'equals' nor 'above'")


def _family_of(facts: Mapping) -> str:
    from .megatron_model import family_for
    return family_for(facts)


def hf_config_dict(facts: Mapping, family: str = "auto") -> dict:
    """The ``config.json`` dict (transformers field names) for ``facts`` (:func:`megatron_facts`).

    Raises :class:`HFConfigError` listing every Megatron setting the family's transformers model
    cannot express, each with the reason and the closest fix: the family table's requirements, and
    ``facts["unexpressed"]``, the settings :mod:`~mcore_reshard.sources.megatron_settings` neither
    expresses nor proves irrelevant to the forward (closed-world: every field of the config is
    walked, so a setting added by a newer Megatron-Core is refused until it is classified)."""
    if not isinstance(facts, Mapping):
        raise HFConfigError(f"facts={type(facts).__name__}: expected the dict megatron_facts() returns")
    for key in POSITIVE_FACTS:
        if key not in facts:
            raise HFConfigError(f"facts[{key!r}] is missing: pass the dict megatron_facts() returns")
        _positive_int(facts[key], f"facts[{key!r}]")
    not_expressed = facts.get("unexpressed")
    if not isinstance(not_expressed, list) or not all(isinstance(x, str) for x in not_expressed):
        raise HFConfigError(f"facts['unexpressed']={not_expressed!r:.80}: expected the list megatron_facts() returns "
                            "(the Megatron settings no transformers config expresses); pass its dict")
    if not isinstance(family, str):
        raise HFConfigError(f"family={family!r}: must be a family name or 'auto'")
    family = _family_of(facts) if family == "auto" else family
    table = hf_table(family)
    requires = list(COMMON_REQUIRES) + list(table.get("require", ()))
    variant = None
    problems = list(not_expressed)
    for req in requires:
        value = facts.get(req["setting"])
        if _violates(req, value):
            want = f"= {req['equals']!r}" if "equals" in req else f"> {req['above']!r}"
            problems.append(f"{req['setting']}={value!r} (needs {want}): {req['why']}; closest fix: {req['fix']}")
    variants = table.get("variant", ())
    for v in variants:
        if all(facts.get(k) == want for k, want in (v.get("when") or {}).items()):
            variant = v
            break
    if variant is None:
        options = "; ".join(f"{v['model_type']}: " + ", ".join(f"{k}={w!r}" for k, w in v.get("when", {}).items())
                            for v in variants)
        got = ", ".join(sorted({f"{k}={facts.get(k)!r}" for v in variants for k in v.get("when", {})}))
        problems.append(f"{got}: no transformers model type of family {family} has this combination "
                        f"(known: {options}); closest fix: one of those")
    if problems:
        raise HFConfigError(f"this Megatron model cannot be expressed as a transformers {family} config "
                            f"({len(problems)} setting(s)):\n  " + "\n  ".join(problems))
    out: dict[str, Any] = {"model_type": variant["model_type"], "architectures": list(variant["architectures"])}
    for hf_name, fact in table.get("fields", {}).items():
        if fact not in facts:
            raise HFConfigError(f"layouts/{family}.toml [hf_config.fields] {hf_name} = {fact!r}: no such Megatron fact "
                                f"(known: {', '.join(sorted(facts))})")
        out[hf_name] = facts[fact]
    out.update(table.get("constants", {}))
    out.update(variant.get("constants", {}))
    return out


def hf_config(model, family: str = "auto", **kw):
    """The transformers config (``PretrainedConfig``) that reproduces the Megatron model's logits.

    ``model``: model chunks, a ``GPTModel`` or a ``TransformerConfig`` (then pass ``vocab_size=``);
    ``kw``: see :func:`megatron_facts`.  Raises :class:`HFConfigError` for settings transformers
    cannot express."""
    return to_transformers(hf_config_dict(megatron_facts(model, **kw), family))


def to_transformers(config: Mapping):
    """A ``config.json`` dict as a transformers config object."""
    from transformers import AutoConfig
    if not isinstance(config, Mapping) or not isinstance(config.get("model_type"), str):
        raise HFConfigError(f"config={config!r:.80}: expected a config.json dict with a 'model_type' string")
    d = dict(config)
    model_type = d.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **d)
    except (ValueError, KeyError, TypeError) as e:
        raise HFConfigError(f"config: transformers has no config for model_type={model_type!r} with these fields: "
                            f"{type(e).__name__}: {str(e)[:200]}") from e


__all__ = ["COMMON_REQUIRES", "CONFIG_FIELDS", "HFConfigError", "hf_config", "hf_config_dict", "hf_table", "megatron_facts",
           "to_transformers"]
