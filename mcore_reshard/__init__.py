"""mcore-reshard: shard-to-shard resharding of live Megatron-Core weights.

Layers (each importable on its own):
  box, mesh, layout  -- layout descriptors (what box of which tensor each rank holds)
  planner            -- pure planning on layouts (no torch.distributed)
  executor           -- the only torch.distributed user (batched P2P, copy_ into existing storage)

``hf_config`` (the transformers config of a Megatron model) and ``export_hf`` (a live Megatron model
to a Hugging Face directory) are loaded on first use: importing ``mcore_reshard`` imports neither
megatron-core nor transformers.
"""
from .box import Box
from .layout import Buffer, Layout, LayoutError, Piece, TensorMeta, stacked
from .mesh import Mesh, megatron_meshes
from .planner import Plan, PlanError, make_plan

__all__ = ["Box", "Buffer", "Layout", "LayoutError", "Mesh", "Piece", "Plan", "PlanError", "TensorMeta",
           "export_hf", "hf_config", "make_plan", "megatron_meshes", "stacked"]

_LAZY = {"hf_config": ("mcore_reshard.mapper.hf_config", "hf_config"), "export_hf": ("mcore_reshard.export", "export_hf")}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'mcore_reshard' has no attribute {name!r}")
__version__ = "0.1.0"
