"""Unsharded Hugging Face layout: every canonical tensor whole, on one rank, under its HF name.

``fused_experts=True`` keeps transformers 5's stacked experts (one buffer per
``mlp.experts.gate_up_proj`` / ``down_proj``).  ``fused_experts=False`` uses the checkpoint naming
(``mlp.experts.{e}.gate_proj.weight`` ``[I, H]`` ...): each is a 2-D buffer holding a box of the
stacked tensor with a leading size-1 dimension.  Example, expert 3 of a ``[8, 64, 64]``
``gate_up_proj`` (I = 32)::

    buffer                          piece (tensor box)                  -> local box
    mlp.experts.3.gate_proj.weight  gate_up_proj [3:4, 0:32, 0:64]      -> [0:32, 0:64]
    mlp.experts.3.up_proj.weight    gate_up_proj [3:4, 32:64, 0:64]     -> [0:32, 0:64]
    mlp.experts.3.down_proj.weight  down_proj    [3:4, 0:64, 0:32]      -> [0:64, 0:32]

``mtp_copies=True`` adds the checkpoint's per-MTP-layer copies of the shared embedding and head
(``model.layers.{N}.embed_tokens.weight``, ``model.layers.{N}.shared_head.head.weight``) as
buffers holding ``model.embed_tokens.weight`` / ``lm_head.weight``.
"""
from __future__ import annotations

from ..core.box import Box
from ..core.gcpause import paused_gc
from ..core.layout import Buffer, Layout, Piece
from .config import ModelConfig, canonical_tensors


def _whole(name: str, tensor: str, shape, dtype: str) -> Buffer:
    full = Box.full(shape)
    return Buffer(name, tuple(shape), dtype, (Piece(tensor, full, full),))


@paused_gc()
def hf_layout(config: ModelConfig, rank: int = 0, dtype: str = "bfloat16", fused_experts: bool = True,
              mtp_copies: bool = False) -> Layout:
    lay = Layout()
    metas = canonical_tensors(config, dtype)
    for m in metas:
        lay.add_tensor(m.name, m.shape, m.dtype)
    for m in metas:
        if not fused_experts and m.name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            prefix = m.name.rsplit(".", 1)[0] + "."
            E, d1, d2 = m.shape
            for e in range(E):
                if m.name.endswith("gate_up_proj"):
                    I = d1 // 2
                    for k, proj in enumerate(("gate_proj", "up_proj")):
                        lay.add_buffer(rank, Buffer(f"{prefix}{e}.{proj}.weight", (I, d2), m.dtype, (
                            Piece(m.name, Box((e, k * I, 0), (1, I, d2)), Box.full((I, d2))),)))
                else:
                    lay.add_buffer(rank, Buffer(f"{prefix}{e}.down_proj.weight", (d1, d2), m.dtype, (
                        Piece(m.name, Box((e, 0, 0), (1, d1, d2)), Box.full((d1, d2))),)))
            continue
        lay.add_buffer(rank, _whole(m.name, m.name, m.shape, m.dtype))
    if mtp_copies:
        for layer in config.mtp_layers:
            emb = lay.tensors["model.embed_tokens.weight"]
            lay.add_buffer(rank, _whole(f"model.layers.{layer}.embed_tokens.weight", emb.name, emb.shape, emb.dtype))
            head = lay.tensors.get("lm_head.weight", emb)
            lay.add_buffer(rank, _whole(f"model.layers.{layer}.shared_head.head.weight", head.name, head.shape, head.dtype))
    return lay


__all__ = ["hf_layout"]
