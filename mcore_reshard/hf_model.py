"""Read the layout of a live Hugging Face (transformers) model held whole on one rank.

transformers' own names are the canonical tensor names (``layouts/*.toml`` map Megatron to them),
so every parameter and persistent buffer is one buffer holding the whole canonical tensor.
transformers 5 keeps routed experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]), exactly the canonical stacked expert tensors.

Example, DeepseekV3ForCausalLM on rank 4::

    buffer (= canonical tensor)                       | shape        | box
    model.layers.1.mlp.experts.gate_up_proj           | [8, 64, 64]  | whole
    model.layers.1.mlp.gate.e_score_correction_bias   | [8]  (fp32)  | whole (a buffer)
"""
from __future__ import annotations

import torch

from .box import Box
from .layout import Buffer, Layout, Piece


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by name (tied parameters once, under their first name)."""
    out = {n: p.detach() for n, p in model.named_parameters()}
    persistent = set(model.state_dict(keep_vars=True))
    out.update({n: b for n, b in model.named_buffers() if n in persistent})
    return out


def read_hf_layout(model: torch.nn.Module, rank: int, skip: tuple[str, ...] = ("rotary_emb.inv_freq",)) -> tuple[Layout, dict]:
    """This rank's layout of a whole HF model (canonical names) and its tensors."""
    lay, tensors = Layout(), {}
    for name, t in sorted(module_tensors(model).items()):
        if any(s in name for s in skip):
            continue
        dtype = str(t.dtype).removeprefix("torch.")
        lay.add_tensor(name, tuple(t.shape), dtype)
        lay.add_buffer(rank, Buffer(name, tuple(t.shape), dtype, (Piece(name, Box.full(t.shape), Box.full(t.shape)),)))
        tensors[name] = t
    return lay, tensors
