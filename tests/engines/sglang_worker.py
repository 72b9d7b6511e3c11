"""SGLang 0.5.23's real model classes and loaders on CPU (imported by engine_worker.py / engine_refit.py
inside ``.venv-sglang``).

Two shims, both outside the weights path (``/work/shared/research/engines_cpu.md`` s.2):

1. a stub ``vllm._custom_ops`` (``rotary_embedding = None``): on an unknown platform SGLang's rotary
   layer imports it as its forward fallback kernel; nothing here runs a forward;
2. ``init_model_parallel_group`` with the CUDA communicators off (pynccl, custom all-reduce, ...):
   they need a CUDA device, gloo is the real backend here.
"""
from __future__ import annotations

import sys
import tempfile
import time
import types
import zlib

import engine_models
import torch
from engine_worker import SENTINEL, compare_params, hf_items, sentinel  # noqa: F401 - re-exported

_SHIMMED = False


def shims() -> None:
    global _SHIMMED
    if _SHIMMED:
        return
    if "vllm" not in sys.modules:
        vllm = types.ModuleType("vllm")
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        vllm._custom_ops = ops
        sys.modules["vllm"], sys.modules["vllm._custom_ops"] = vllm, ops
    from sglang.srt.distributed import parallel_state as ps
    orig = ps.init_model_parallel_group

    def init_model_parallel_group(*args, **kwargs):
        for k in ("use_pynccl", "use_custom_allreduce", "use_mscclpp", "use_torch_symm_mem_allreduce"):
            kwargs[k] = False
        import inspect
        params = inspect.signature(orig).parameters
        return orig(*args, **{k: v for k, v in kwargs.items() if k in params})
    ps.init_model_parallel_group = init_model_parallel_group
    _SHIMMED = True


class SGLangEngine:
    def __init__(self, rank: int, world: int, init_method: str = "env://"):
        shims()
        from sglang.srt.distributed import init_distributed_environment
        self.rank, self.world = rank, world
        self.root = tempfile.mkdtemp(prefix="mr-sglang-")
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, distributed_init_method=init_method,
                                     backend="gloo")
        self.par = None

    def topology(self, par: dict) -> None:
        """SGLang's model-parallel state (and global server args) for ``par``, rebuilt."""
        from sglang.srt.distributed import parallel_state as ps
        from sglang.test.test_utils import publish_build_topology
        if self.par == par:
            return
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        tp, ep, dp = par.get("tp", 1), par.get("ep", 1), par.get("dp", 1)
        if tp != self.world:
            raise ValueError(f"SGLang needs world size == tp * pp: tp={tp}, world {self.world}")
        kw = dict(world_rank=self.rank, tp_size=tp, ep_size=ep, pp_size=1, device="cpu")
        if par.get("dp_attention"):
            kw.update(dp_size=dp, enable_dp_attention=True)
        publish_build_topology(**kw)
        ps.initialize_model_parallel(backend="gloo")
        # what SGLang's bootstrap (srt/distributed/bootstrap.py) runs next: the DP-attention flags that
        # layers read at construction (e.g. the embedding's use_attn_tp_group)
        from sglang.srt.layers.dp_attention import initialize_dp_attention
        from sglang.srt.runtime_context import get_server_args
        initialize_dp_attention(server_args=get_server_args())
        self.par = dict(par)

    def build(self, cfg: dict, par: dict, name: str, reinit: bool = True):
        from sglang.srt.models.registry import ModelRegistry
        from transformers import AutoConfig
        d = engine_models.write_config(self.root, name, cfg)
        if reinit:
            self.topology(par)
        hf = AutoConfig.from_pretrained(d)
        cls, _ = ModelRegistry.resolve_model_cls(hf.architectures)
        old = torch.get_default_dtype()
        torch.set_default_dtype(torch.float32)
        try:
            return cls(config=hf, quant_config=None)
        finally:
            torch.set_default_dtype(old)

    def load(self, model, ck: dict):
        with torch.no_grad():
            return model.load_weights(hf_items(ck))


def layout_case(eng: SGLangEngine, case: dict) -> dict:
    from mcore_reshard.integrations.probe import compare_layouts, probe_layout
    from mcore_reshard.integrations.protocol import build_layout
    from mcore_reshard.integrations.sglang_loader import sglang_spec
    from mcore_reshard.targets import from_hf_config, hf_layout
    cfg, par = engine_models.MODELS[case["model"]](), case["par"]
    tp = par.get("tp", 1)
    lrank = eng.rank % tp
    full, ck = engine_models.random_checkpoint(cfg, seed=zlib.crc32(case["id"].encode()))
    t0 = time.monotonic()
    model = eng.build(cfg, par, case["model"])
    sentinel(model)
    eng.load(model, ck)
    spec = sglang_spec(model, 0)
    layout = build_layout(spec)
    params = dict(model.named_parameters())
    rep = {"errors": compare_params(params, layout, lrank, full), "params": len(params),
           "kwargs": spec["kwargs"], "shapes": {n: list(p.shape) for n, p in params.items()}}
    if case.get("probe"):
        mc = from_hf_config(cfg)
        probed, unwritten = probe_layout(model, hf_layout(mc, fused_experts=False, dtype="float32"), lrank)
        rep["probe_errors"] = compare_layouts(probed, layout, [lrank])
        rep["unwritten"] = unwritten
        rep["probe_buffers"] = len(probed.buffers.get(lrank, {}))
    rep["seconds"] = round(time.monotonic() - t0, 2)
    return rep
