"""mcore-reshard: shard-to-shard resharding of live Megatron-Core weights.

The layers, numbered (every import points down: a layer imports only lower-numbered ones):
  1 layout descriptors  core/box, core/mesh, core/layout, core/dtensor; sources/ (layouts read from live
                        models: Megatron-Core or its dims alone, transformers)
  2 mapper              mapper/ (source names and fused buffers -> canonical Hugging Face tensors, from
                        layouts/*.toml); targets/ (Hugging Face, vLLM, SGLang layouts, metadata only);
                        fp8/layout; sources/hf_config (a Megatron model's transformers config)
  3 planner             core/planner/ (pure data); fp8/'s block-owner plans
  4 executor            core/executor/ (the only code moving bytes); fp8/refit (quantizing Resharder)
  5 integrations        refit.py (MegatronRefit: read, exchange, map, plan, bind -- the one-call API),
                        export.py (export_hf), dtensor_reshard.py (reshard, reshard_group), integrations/
                        (vLLM and SGLang in place), sources/megatron_dtensor
Under every layer: util/ (progress bars, memory readings), core/gcpause.  Outside the library (never
imported by it): tools/ (CLI, demo, benchmarks, cost model, launch), testing/ (opt-in CPU shims for
Megatron-Core).  README.md "The layers" and tests/test_layers.py hold the same table; see docs/architecture.md.

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
