"""mcore-reshard: shard-to-shard resharding of live Megatron-Core weights.

Layers (each importable on its own):
  box, mesh, layout  -- layout descriptors (what box of which tensor each rank holds)
  planner            -- pure planning on layouts (no torch.distributed)
  executor           -- the only torch.distributed user (batched P2P, copy_ into existing storage)
"""
from .box import Box
from .layout import Buffer, Layout, LayoutError, Piece, TensorMeta, stacked
from .mesh import Mesh, megatron_meshes
from .planner import Plan, PlanError, make_plan

__all__ = ["Box", "Buffer", "Layout", "LayoutError", "Mesh", "Piece", "Plan", "PlanError", "TensorMeta",
           "make_plan", "megatron_meshes", "stacked"]
__version__ = "0.1.0"
