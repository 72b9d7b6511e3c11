"""Read the layout of a module whose parameters are DTensors: FSDP2 (``fully_shard``), tensor
parallelism (``parallelize_module``), or both on a 2-D mesh (torchtitan, the FSDP backends of
verl, SkyRL, prime-rl).  The canonical tensor names are the module's own parameter names (a
transformers model trained under FSDP2 keeps its Hugging Face names, so it plans directly against
the Hugging Face, vLLM and SGLang target layouts of :mod:`mcore_reshard.targets`).

Every DTensor parameter's box comes from its own global shape, mesh coordinate and placements
(:func:`mcore_reshard.sources.hf_model.dtensor_buffer`); plain parameters and persistent buffers
(FSDP2 leaves buffers alone) are whole on every rank that holds the module.

Example, a ``[8, 4]`` weight under ``fully_shard`` over mesh ``dp=2`` x ``parallelize_module``
``ColwiseParallel`` over ``tp=2`` (DeviceMesh ``[[0, 1], [2, 3]]``, dims ``(dp, tp)``)::

    rank | placements                              | box of the canonical tensor
    0    | (_StridedShard(0, split_factor=2), Shard(0)) | rows 0:2
    1    |                                         | rows 4:6
    2    |                                         | rows 2:4
    3    |                                         | rows 6:8

``rank`` is this process's rank in the group the layouts are exchanged over (``join_refit``'s).
"""
from __future__ import annotations

import torch

from ..core.box import Box
from ..core.layout import Buffer, Layout, Piece
from .hf_model import dtensor_buffer, module_tensors


def read_dtensor_layout(module: torch.nn.Module, rank: int, skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
                        ) -> tuple[Layout, dict]:
    """(this rank's layout part in the module's own parameter names, tensors by buffer name): a
    DTensor contributes this rank's local shard, anything else the whole tensor."""
    from torch.distributed.tensor import DTensor
    lay, tensors = Layout(), {}
    for name, t in sorted(module_tensors(module).items()):
        if any(s in name for s in skip):
            continue
        lay.add_tensor(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        if isinstance(t, DTensor):
            buf, local = dtensor_buffer(name, t, rank)
            lay.add_buffer(rank, buf)
            tensors[name] = local
            continue
        lay.add_buffer(rank, Buffer(name, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                    (Piece(name, Box.full(t.shape), Box.full(t.shape)),)))
        tensors[name] = t
    return lay, tensors


__all__ = ["read_dtensor_layout"]
