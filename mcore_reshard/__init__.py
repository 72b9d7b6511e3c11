"""mcore-reshard: shard-to-shard resharding of live Megatron-Core weights.

Subpackages, in layer order (each imports only those above it in this list):
  core/          layout descriptors (box, mesh, layout, dtensor), planner (pure), executor (torch.distributed)
  mapper/        source names and fused buffers -> canonical (Hugging Face) tensors, from layouts/*.toml
  sources/       layouts read from live models: Megatron-Core (or its dims alone), transformers
  targets/       layouts of inference engines: Hugging Face, vLLM, SGLang (metadata only)
  fp8/           FP8 in transit: FP8 target layouts, block-owner plans, quantizing executor
  refit.py       MegatronRefit: read, exchange, map, plan, bind -- the one-call API
  dtensor_reshard.py  reshard(src, dst): DTensors (or rank-list ShardSpecs) in, DTensors out; reshard_group
  export.py      export_hf: a live Megatron model to a Hugging Face directory (config derived by sources/hf_config)
  integrations/  vLLM worker extension, SGLang loader, post-refit hooks, the engine-side protocol
  testing/       opt-in CPU shims for Megatron-Core on a CPU-only torch (nothing applies them unasked)
  tools/         CLI, demo, benchmarks, cost model, launch
  util/          progress bars and memory readings (no resharding logic; imports nothing of the package)
See docs/architecture.md.

``hf_config`` (the transformers config of a Megatron model), ``export_hf`` and the DTensor call
(``reshard``, ``reshard_group``, ``MeshSpec``, ``ShardSpec``) are loaded on first use:
importing ``mcore_reshard`` imports neither megatron-core nor transformers.
"""
from .core.box import Box
from .core.layout import Buffer, Layout, LayoutError, Piece, TensorMeta, stacked
from .core.mesh import Mesh, megatron_meshes
from .core.planner import Plan, PlanError, make_plan

__all__ = ["Box", "Buffer", "Layout", "LayoutError", "Mesh", "MeshSpec", "Piece", "Plan", "PlanError", "ShardSpec",
           "TensorMeta", "export_hf", "hf_config", "make_plan", "megatron_meshes", "reshard", "reshard_group", "stacked"]

_LAZY = {"hf_config": ("mcore_reshard.sources.hf_config", "hf_config"), "export_hf": ("mcore_reshard.export", "export_hf"),
         **{n: ("mcore_reshard.dtensor_reshard", n) for n in ("reshard", "reshard_group", "MeshSpec", "ShardSpec")}}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'mcore_reshard' has no attribute {name!r}")
__version__ = "0.1.0"
