"""transformers' own TP / EP sharding of tiny Llama, Qwen3-MoE and DeepSeek-V3 models (no Megatron), read by
``read_hf_layout`` and compared with boxes written out by hand per style (not by ``mcore_reshard.core.dtensor``)."""
from __future__ import annotations

import torch

COMMON = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, max_position_embeddings=64,
              intermediate_size=128, tie_word_embeddings=False)


def tiny(kind: str):
    import transformers as T
    if kind == "llama":
        return T.LlamaForCausalLM, T.LlamaConfig(num_key_value_heads=4, head_dim=8, **COMMON)
    if kind == "qwen3":
        return T.Qwen3MoeForCausalLM, T.Qwen3MoeConfig(num_key_value_heads=4, head_dim=8, num_experts=8, num_experts_per_tok=2,
                                                       moe_intermediate_size=32, mlp_only_layers=[], **COMMON)
    return T.DeepseekV3ForCausalLM, T.DeepseekV3Config(
        num_key_value_heads=8, moe_intermediate_size=32, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
        q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
        num_experts_per_tok=2, first_k_dense_replace=1, **COMMON)


def _chunk(size: int, n: int, r: int) -> tuple[int, int]:
    assert size % n == 0, (size, n)
    return r * size // n, size // n


def hand_pieces(style, shape, n: int, r: int) -> list:
    """(global offsets, sizes, local offsets) of each piece rank r of n holds under ``style``, by hand."""
    shape = list(shape)
    whole = [(tuple([0] * len(shape)), tuple(shape), tuple([0] * len(shape)))]

    def cut(dim):
        off, size = _chunk(shape[dim], n, r)
        offs, sizes = [0] * len(shape), list(shape)
        offs[dim], sizes[dim] = off, size
        return [(tuple(offs), tuple(sizes), tuple([0] * len(shape)))]

    if style in ("colwise", "colwise_rep", "colwise_gather_output"):
        return cut(max(len(shape) - 2, 0))
    if style in ("rowwise", "rowwise_split_input", "rowwise_rep"):
        return cut(len(shape) - 1) if len(shape) > 1 else whole
    if style in ("embedding_rowwise", "grouped_gemm"):
        return cut(0)
    if style == "packed_colwise" and len(shape) > 1:   # [.., gate; up, in]: this rank's rows of each half
        dim = len(shape) - 2
        half = shape[dim] // 2
        off, size = _chunk(half, n, r)
        out = []
        for k in range(2):
            offs, sizes, local = [0] * len(shape), list(shape), [0] * len(shape)
            offs[dim], sizes[dim], local[dim] = k * half + off, size, k * size
            out.append((tuple(offs), tuple(sizes), tuple(local)))
        return out
    assert style in (None, "replicated_with_grad_allreduce"), style
    return whole


def layout_boxes(rank: int, world: int) -> list:
    from transformers.distributed import DistributedConfig

    from mcore_reshard.sources.hf_model import parallel_styles, read_hf_layout
    out = []
    for kind, ep in (("llama", 1), ("qwen3", 1), ("dsv3", 1), ("dsv3", world)):
        cls, cfg = tiny(kind)
        torch.manual_seed(0)
        model = cls(cfg).eval()
        dcfg, _, meshes = cls.prepare_distribute_model(DistributedConfig(tp_size=world, ep_size=ep))
        model = cls.maybe_distribute_model(model, dcfg, meshes)
        styles = parallel_styles(model)
        lay, tensors = read_hf_layout(model, rank)
        bad = []
        for name, buf in lay.buffers[rank].items():
            got = sorted((p.box.offsets, p.box.sizes, p.local.offsets) for p in buf.pieces)
            want = sorted(hand_pieces(styles.get(name), lay.tensors[name].shape, world, rank))
            if got != want or tuple(tensors[name].shape) != buf.shape:
                bad.append((name, styles.get(name), got, want))
        declared = {**cfg.base_model_tp_plan} if ep == 1 else {}   # the config class's own plan
        out.append({"kind": kind, "ep": ep, "bad": bad, "styles": styles,
                    "declared": sorted(declared), "sharded": sorted(n for n, b in lay.buffers[rank].items()
                                                                      if b.shape != lay.tensors[n].shape)})
    return out
