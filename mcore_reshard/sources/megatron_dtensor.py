"""Export a live Megatron-Core model's shards as DTensors over Megatron's own global tensors.

Each Megatron global tensor (``sharded_state_dict`` key) lives on one pipeline stage, on the dense
mesh ``(dp, cp, tp)`` or the expert mesh ``(edp, ep, etp)`` of that stage (DeviceMesh dims
slowest first).  Its placements are found by matching the layout read from the model
(:func:`mcore_reshard.core.dtensor.placements_for`): e.g. an embedding at tp=2 is
``[Replicate(), Replicate(), Shard(0)]``, expert ``linear_fc1`` ``[E, 2I, H]`` at ep=2, etp=2 is
``[Replicate(), Shard(0), _StridedShard(1, split_factor=2)]``.  Collective over the world.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..core.dtensor import mesh_ranks, placements_for, to_dtensor
from ..core.executor import all_gather_json
from ..core.layout import Layout
from ..core.mesh import megatron_meshes
from .megatron_model import read_layout


def _sizes(config) -> dict:
    return {"tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
            "cp": config.context_parallel_size, "ep": config.expert_model_parallel_size,
            "etp": config.expert_tensor_parallel_size or config.tensor_model_parallel_size}


def candidate_meshes(world: int, sizes: dict) -> list:
    """Per pipeline stage, the dense and expert sub-meshes (as :class:`Mesh`, pp removed), then the
    two whole meshes (for tensors every stage holds, e.g. the embedding copy on the last stage)."""
    from ..core.mesh import Mesh
    m = megatron_meshes(world, sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"], sizes["etp"])
    out = []
    for full in (m.dense, m.expert):
        if full.axis_names[-1] != "pp":
            raise ValueError(f"DTensor export needs pp as the slowest axis, got order {full.axis_names}")
        inner = Mesh.of(list(zip(full.axis_names[:-1], full.axis_sizes[:-1])))
        for stage in range(sizes["pp"]):
            out.append(Mesh(inner.axis_names, inner.axis_sizes, stage * inner.size))
    return out + ([m.dense, m.expert] if sizes["pp"] > 1 else [])


def export_dtensors(chunks: Sequence[torch.nn.Module], group=None) -> tuple[dict, list[str]]:
    """(key -> DTensor for this rank's shards, keys DTensor cannot express).  Collective.

    Not expressible: SequentialMLP / TEGroupedMLP experts (one local tensor per expert, while a
    DTensor wraps exactly one local tensor per rank) and anything with padding or uneven splits."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local, tensors = read_layout(chunks, rank)
    parts = all_gather_json({"layout": local.to_json(), "sizes": _sizes(chunks[0].config) if chunks else None}, group)
    sizes = next(p["sizes"] for p in parts if p["sizes"])
    layout = Layout()
    for p in parts:
        part = Layout.from_json(p["layout"])
        for n, m in part.tensors.items():
            layout.add_tensor(n, m.shape, m.dtype)
        for r, bufs in part.buffers.items():
            for b in bufs.values():
                layout.add_buffer(r, b)
    meshes = candidate_meshes(world, sizes)
    device_meshes = {}
    for mesh in meshes:   # every rank creates every DeviceMesh, in the same order (collective)
        names, _ = mesh.device_mesh_shape()
        device_meshes[mesh] = DeviceMesh("cpu" if dist.get_backend(group) == "gloo" else "cuda",
                                         mesh_ranks(mesh), mesh_dim_names=tuple(names))
    holders: dict[str, set[int]] = {}
    for r, buf, piece in layout.iter_pieces():
        holders.setdefault(piece.tensor, set()).add(r)
    out, inexpressible = {}, []
    for key in sorted(layout.tensors):
        mesh = next((m for m in meshes if set(m.ranks) == holders.get(key, set())), None)
        placements = placements_for(layout, key, mesh) if mesh is not None else None
        if placements is None:
            inexpressible.append(key)
            continue
        if rank in holders[key]:
            (buf,) = [b for b in layout.buffers[rank].values() if any(p.tensor == key for p in b.pieces)]
            out[key] = to_dtensor(tensors[buf.name], device_meshes[mesh], placements, layout.tensors[key].shape)
    return out, inexpressible
