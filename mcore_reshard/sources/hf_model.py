"""Read the layout of a live Hugging Face (transformers) model: whole on one rank, or sharded by
transformers' own tensor / expert parallelism (``from_pretrained(..., distributed_config=...)``).

transformers' own names are the canonical tensor names (``layouts/*.toml`` map Megatron to them).
transformers 5 keeps routed experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]), exactly the canonical stacked expert tensors.

A whole model: every parameter and persistent buffer is one buffer holding the whole canonical
tensor.  A model sharded by transformers' plans: every parameter a plan style shards is a DTensor
over the TP (or EP) mesh, and its box is read from the DTensor's own global shape, mesh
coordinate and placements (:mod:`mcore_reshard.core.dtensor`); the parameters the styles leave alone
(norms, routers, MLA attention in DeepSeek-V3) are whole on every rank.  The model's resolved plan
is checked against what is found: a parameter whose style is unknown here, or that a sharding style
names but that is not a DTensor, is an error naming the parameter, its style and the rank.

Example, DeepseekV3ForCausalLM with ``DistributedConfig(tp_size=2)``, rank 1::

    buffer (= canonical tensor)                 | style          | placements                | box of the canonical tensor
    model.embed_tokens.weight  [64, 64]         | embedding_rowwise | Shard(0)              | [64:128, 0:64]
    model.layers.1.mlp.experts.gate_up_proj     | packed_colwise | _StridedShard(1, sf=2)    | [0:8, 16:32, 0:64] -> local rows 0:16
                               [8, 32, 64]      |                |                           | [0:8, 48:64, 0:64] -> local rows 16:32
    model.layers.1.mlp.experts.down_proj [8,64,16] | rowwise     | Shard(2)                  | [0:8, 0:64, 16:32]
    model.layers.1.self_attn.kv_b_proj.weight   | (none)         | plain tensor              | whole
"""
from __future__ import annotations

import re

import torch

from ..core.box import Box
from ..core.layout import Buffer, Layout, LayoutError, Piece
from ..util.identity import tracked

# transformers 5.23 ``ALL_PARALLEL_STYLES``, by what a style does to the parameters it names.
# These replace the parameter by a DTensor (Shard / _StridedShard / Replicate placements):
SHARDING_STYLES = frozenset({
    "colwise", "colwise_rep", "colwise_gather_output", "rowwise", "rowwise_split_input", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "packed_colwise", "packed_rowwise", "sequence_parallel",
    "grouped_gemm",   # expert parallelism: Shard(0) over the EP mesh
})
# These only hook the module's forward; its parameters stay whole plain tensors on every rank:
HOOK_STYLES = frozenset({
    "replicated_with_grad_allreduce", "mla_kv_a_proj", "all_reduce", "moe_tp_experts", "moe_identity_expert",
    "local_params", "replicate", "ep_dispatch_experts",
})


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied parameters once, under their first name)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    persistent = set(model.state_dict(keep_vars=True))
    out.update({n: b for n, b in model.named_buffers() if n in persistent})
    return out


def _generic(name: str) -> str:
    """``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight`` (transformers' plan keys)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def _plan_style(generic: str, plan: dict) -> str | None:
    """The style a transformers plan gives a parameter: its own entry, else its module's."""
    if generic in plan:
        return plan[generic]
    module = generic.rpartition(".")[0]
    return plan.get(module) if module else None


def parallel_styles(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name -> the transformers parallel style that applies to it, as transformers resolves
    the plans of a model loaded with a ``DistributedConfig``: the TP plan when ``tp_size > 1``, the EP plan
    when ``ep_size > 1``, EP rules winning over TP rules on EP modules and everything below them.
    Empty for a model loaded without one."""
    dcfg = getattr(getattr(model, "config", None), "distributed_config", None)
    if dcfg is None:
        return {}
    tp_plan = dict(getattr(model, "tp_plan", None) or {}) if (dcfg.tp_size or 1) > 1 else {}
    ep_plan = dict(getattr(model, "ep_plan", None) or {}) if (dcfg.ep_size or 1) > 1 else {}
    out = {}
    for name, _ in model.named_parameters():
        generic = _generic(name)
        style = _plan_style(generic, ep_plan)
        if style is None and not any(generic == k or generic.startswith(k + ".") for k in ep_plan):
            style = _plan_style(generic, tp_plan)
        if style is not None:
            out[name] = style
    return out


def dtensor_buffer(name: str, t, rank: int) -> tuple[Buffer, torch.Tensor]:
    """The buffer this rank holds of DTensor ``t`` (canonical name ``name``), and its local tensor."""
    from ..core.dtensor import buffer_for  # imports torch.distributed.tensor
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    local = t.to_local()
    dtype = str(t.dtype).removeprefix("torch.")
    if coord is None:
        raise LayoutError(f"rank {rank}: {name} is a DTensor over mesh ranks {mesh.mesh.flatten().tolist()}, "
                          f"which do not include this rank")
    try:
        buf = buffer_for(name, name, dtype, tuple(t.shape), list(mesh.mesh.shape), coord, t.placements)
    except (ValueError, LayoutError) as e:
        raise LayoutError(f"rank {rank}: {name} (global {tuple(t.shape)}, local {tuple(local.shape)}, "
                          f"placements {t.placements}): {e}") from None
    if buf.shape != tuple(local.shape):
        raise LayoutError(f"rank {rank}: {name} holds a local shard of shape {tuple(local.shape)}, but placements "
                          f"{t.placements} over mesh {list(mesh.mesh.shape)} at coordinate {coord} give {buf.shape} "
                          f"of the global {tuple(t.shape)}")
    return buf, local


def read_hf_layout(model: torch.nn.Module, rank: int, skip: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> tuple[Layout, dict]:
    """This rank's layout of an HF model (canonical names) and its tensors: whole tensors, or this
    rank's shards of the parameters transformers' tensor / expert parallelism turned into DTensors."""
    from ..core.dtensor import DTensor
    styles = parallel_styles(model)
    unknown = sorted((n, s) for n, s in styles.items() if s not in SHARDING_STYLES | HOOK_STYLES)
    if unknown:
        shown = ", ".join(f"{n} has transformers parallel style {s!r}" for n, s in unknown[:3])
        raise LayoutError(f"rank {rank}: {shown}{f' (and {len(unknown) - 3} more)' if len(unknown) > 3 else ''}, "
                          f"which mcore_reshard does not know (known: {sorted(SHARDING_STYLES | HOOK_STYLES)})")
    lay, tensors = Layout(), {}
    for name, t in sorted(module_tensors(model).items()):
        if any(s in name for s in skip):
            continue
        style = styles.get(name)
        dtype = str(t.dtype).removeprefix("torch.")
        lay.add_tensor(name, tuple(t.shape), dtype)
        if isinstance(t, DTensor):
            buf, local = dtensor_buffer(name, t, rank)
            lay.add_buffer(rank, buf)
            tensors[name] = local
            continue
        if style in SHARDING_STYLES:
            raise LayoutError(f"rank {rank}: {name} (shape {tuple(t.shape)}) has style {style!r}, which shards it, "
                              f"but it is a plain {type(t).__name__}, not a DTensor: its box is unknown")
        lay.add_buffer(rank, Buffer(name, tuple(t.shape), dtype, (Piece(name, Box.full(t.shape), Box.full(t.shape)),)))
        tensors[name] = t
    return lay, tracked({"": model}, tensors, rank=rank)     # a module / parameter replaced later is seen
