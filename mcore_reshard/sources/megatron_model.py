"""Read a live Megatron-Core model's layout on this rank.

The source of truth is the model's own ``sharded_state_dict()``: for every parameter and persistent
buffer it names the global tensor (PP/VPP-global layer numbers, MTP, global expert index via the
leading expert axis), its global shape and the box this rank holds, for the local and the
Transformer-Engine specs alike (Megatron's distributed checkpointing reshards through it).
SwiGLU factories (``linear_fc1`` ``[gate; up]`` per TP rank) are built, and every built shard's
position inside the real parameter is read from its storage offset, so nothing is assumed
about how a module lays out its tensor.

Example, DSV3 tiny at tp=2 (rank 1), two of its buffers::

    buffer                                      | Megatron tensor (global shape)   | global box -> local box
    decoder.layers.0.mlp.linear_fc1.weight      | ...mlp.linear_fc1.weight [256,64] | [64:128, :]  -> [0:64, :]
      [64+64, 64]                               |                                  | [192:256, :] -> [64:128, :]
    decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight [64, 32]
                                                | ...experts.linear_fc2 [8,64,32]   | [4:5, 0:64, 0:32] -> [0:64, 0:32]
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..core.box import Box
from ..core.layout import Buffer, Layout, LayoutError, Piece
from ..util.identity import ModuleIdentity, TrackedTensors

CONFIG_KEYS = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
               "num_moe_experts", "ffn_hidden_size", "moe_ffn_hidden_size", "mtp_num_layers",
               "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "vocab_size")


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def view_box(base: torch.Tensor, view: torch.Tensor, name: str) -> Box:
    """The box of ``base`` that ``view`` (a slice of it) occupies."""
    if view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
        raise LayoutError(f"{name}: sharded_state_dict tensor does not share storage with the parameter")
    if view.ndim != base.ndim or not base.is_contiguous():
        raise LayoutError(f"{name}: cannot place a {tuple(view.shape)} shard inside {tuple(base.shape)}")
    if view.numel() == 0:
        return Box((0,) * base.ndim, tuple(view.shape))
    if any(s1 != s2 for s1, s2, n in zip(view.stride(), base.stride(), view.shape) if n > 1):
        raise LayoutError(f"{name}: shard strides {view.stride()} differ from the parameter's {base.stride()}")
    rel = view.storage_offset() - base.storage_offset()
    offs = []
    for stride in base.stride():
        offs.append(rel // stride)
        rel %= stride
    return Box(tuple(offs), tuple(view.shape))


def model_config(chunks: Sequence[torch.nn.Module]) -> dict:
    """The architecture facts the family tables and validation use (JSON-able)."""
    if not chunks:
        return {}
    cfg = chunks[0].config
    out = {k: getattr(cfg, k, None) for k in CONFIG_KEYS}
    out["num_query_groups"] = out["num_query_groups"] or out["num_attention_heads"]
    out["multi_latent_attention"] = bool(getattr(cfg, "multi_latent_attention", False))
    out["vocab_size"] = getattr(chunks[0], "vocab_size", None)
    out["share_embeddings_and_output_weights"] = bool(getattr(chunks[0], "share_embeddings_and_output_weights", False))
    return {k: v for k, v in out.items() if isinstance(v, (int, bool))}


def read_layout(chunks: Sequence[torch.nn.Module], rank: int) -> tuple[Layout, dict[str, torch.Tensor]]:
    """This rank's part of the model layout (tensors named by Megatron global keys, buffers by
    parameter name, prefixed ``vpp{i}.`` when there are several chunks) and the real tensors."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    lay, tensors = Layout(), {}
    for c, chunk in enumerate(chunks):
        prefix = f"vpp{c}." if len(chunks) > 1 else ""
        named = dict(chunk.named_parameters())
        named.update(dict(chunk.named_buffers()))
        # per-layer keys with global layer numbers (homogeneous stacks would otherwise get one key
        # with a leading layer axis)
        for local_name, sh in chunk.sharded_state_dict(metadata={"non_homogeneous_layers": True}).items():
            if isinstance(sh, ShardedObject):
                continue
            if local_name not in named:
                if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and local_name.endswith("_extra_state"):
                    continue
                raise LayoutError(f"rank {rank}: sharded_state_dict entry {local_name} ({getattr(sh, 'key', '?')}) "
                                  "is neither a parameter nor a buffer of the model")
            base = named[local_name].detach()
            shards = sh.build() if isinstance(sh, ShardedTensorFactory) else [sh]
            pieces = []
            for st in shards:
                if not isinstance(st, ShardedTensor):
                    raise LayoutError(f"rank {rank}: {local_name} built into {type(st).__name__}, not ShardedTensors")
                if st.flattened_range is not None:
                    raise LayoutError(f"rank {rank}: {st.key} is flattened (distributed-optimizer format); pass the model")
                lay.add_tensor(st.key, tuple(st.global_shape), _dtype(base))
                local = view_box(base, st.data, local_name)
                gbox = Box(tuple(st.global_offset), (1,) * st.prepend_axis_num + tuple(st.data.shape))
                pieces.append(Piece(st.key, gbox, local))
            lay.add_buffer(rank, Buffer(prefix + local_name, tuple(base.shape), _dtype(base), tuple(pieces)))
            tensors[prefix + local_name] = named[local_name]   # the owner: a later param.data = ... is seen
    # and the modules they live in: a module / parameter / chunk replaced later is seen too
    roots = [(chunks, c, f"vpp{c}." if len(chunks) > 1 else "") for c in range(len(chunks))]
    names = {n: n.split(".", 1)[1] if len(chunks) > 1 else n for n in tensors}
    return lay, TrackedTensors(tensors, ModuleIdentity(roots, names, side="src", rank=rank))


def family_for(config: dict) -> str:
    if config.get("multi_latent_attention"):
        return "deepseek_v3"
    if config.get("num_moe_experts"):
        return "qwen3_moe"
    return "llama"
