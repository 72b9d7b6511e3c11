"""Post-refit hooks: what each engine derives from its weights and must redo after a refit.

A refit writes the engine's *parameters* in place (``copy_``); anything an engine computed from them
after loading is stale unless it is a view of the same memory.  The table below lists those derived
tensors per engine; each hook is a small duck-typed function (``hasattr`` checks, no engine import)
that takes the engine's model (and the objects that own its caches), does its work and returns a
report of what it did::

    engine | hook          | derived from                | what it redoes
    vllm   | fp8_guard     | *_scale / *_scale_inv, fp8  | refuses: block-scaled FP8 params are not refit yet
    vllm   | mla_absorb    | self_attn.kv_b_proj.weight  | W_UK_T [N,P,L], W_UV [N,L,V]: views in bf16/fp16
           |               |                             |  (data_ptr inside kv_b_proj: nothing to do);
           |               |                             |  copies (.contiguous() variants): copy_ recomputed
           |               |                             |  values into the same storage; FP8 W_K/W_V: refused
    vllm   | prefix_cache  | KV cache of old weights     | reset_prefix_cache() on an owner that has it (the
           |               |                             |  V1 scheduler owns it: call llm.reset_prefix_cache()
           |               |                             |  on the driver when no worker-side owner has it)
    sglang | fp8_guard     | as above                    | as above
    sglang | mla_post_load | self_attn.kv_b_proj.weight  | model.post_load_weights(weight_names=[...kv_b_proj])
           |               |                             |  rebuilds w_kc / w_vc (bind_or_assign: same storage);
           |               |                             |  without it: copy_ w_kc [N,P,L], w_vc [N,L,V]
    sglang | flush_cache   | radix / KV cache            | flush_cache() on an owner that has it (the scheduler
           |               |                             |  does it after update_weights_from_tensor when
           |               |                             |  flush_cache=True, the default)

``run_post_refit("vllm", model, owners=[worker, model_runner])`` runs an engine's hooks in order and
returns ``{"hooks": [report, ...]}``; a hook that cannot redo what it found raises
:class:`PostRefitError` (``strict=True``) instead of serving stale derived weights.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch


class PostRefitError(RuntimeError):
    """A derived tensor the hooks cannot recompute (the engine would serve stale weights)."""


@dataclass(frozen=True)
class Derived:
    """One derived tensor (or cache) of an engine, declaratively."""
    engine: str
    tensor: str          # what is derived
    source: str          # runtime parameter(s) it is derived from
    kind: str            # "view" | "copy" | "cache" | "quant"
    redo: str            # what the hook does
    hook: str            # hook name in POST_REFIT


DERIVED: tuple[Derived, ...] = (
    Derived("vllm", "W_UK_T, W_UV (MLA absorbed up-projections)", "self_attn.kv_b_proj.weight", "view",
            "bf16/fp16: views of kv_b_proj (detected by data_ptr): nothing to do", "mla_absorb"),
    Derived("vllm", "W_UK_T, W_UV (contiguous copies)", "self_attn.kv_b_proj.weight", "copy",
            "recomputed from kv_b_proj and copy_'d into the same storage", "mla_absorb"),
    Derived("vllm", "W_K, W_K_scale, W_V, W_V_scale (AITER fp8 BMM)", "self_attn.kv_b_proj.weight", "quant",
            "not supported: raises", "mla_absorb"),
    Derived("vllm", "weight_scale_inv / fp8 weights", "every block-quantized linear", "quant",
            "not supported yet: raises", "fp8_guard"),
    Derived("vllm", "prefix (KV) cache", "all weights", "cache",
            "reset_prefix_cache() on an owner; else the driver calls llm.reset_prefix_cache()", "prefix_cache"),
    Derived("sglang", "w_kc, w_vc (MLA absorbed up-projections)", "self_attn.kv_b_proj.weight", "copy",
            "model.post_load_weights(weight_names=...) (fallback: copy_)", "mla_post_load"),
    Derived("sglang", "weight_scale_inv / fp8 weights, DeepGEMM UE8M0 requant", "block-quantized linears", "quant",
            "not supported yet: raises", "fp8_guard"),
    Derived("sglang", "radix / KV cache", "all weights", "cache",
            "flush_cache() on an owner; the scheduler flushes after update_weights_from_tensor", "flush_cache"),
)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` lies inside ``b``'s storage (a view of it)."""
    if a.device != b.device:
        return False
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa.nbytes() == sb.nbytes()


def _holders(model: torch.nn.Module, attrs: Sequence[str]) -> list[tuple[str, Any]]:
    """(module path, object) for every module -- or its ``.impl`` -- having all ``attrs``."""
    out = []
    for path, m in model.named_modules():
        for obj, where in ((m, path), (getattr(m, "impl", None), path + ".impl" if path else "impl")):
            if obj is not None and all(hasattr(obj, a) for a in attrs):
                out.append((where, obj))
    return out


# ----------------------------------------------------------------------------------- FP8

def fp8_guard(model: torch.nn.Module, ctx: Mapping | None = None) -> dict:
    """Refuse block-scaled FP8 parameters: their scales are not part of the target layouts yet."""
    found = [n for n, p in model.named_parameters()
             if p.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) or n.endswith(("_scale_inv", "weight_scale"))]
    report = {"hook": "fp8_guard", "fp8_params": len(found)}
    if found and (ctx or {}).get("strict", True):
        raise PostRefitError(f"{len(found)} FP8 / block-scale parameters (e.g. {found[:3]}): FP8 refit (per-block "
                             "quantization of the new weights and their scales) is not supported yet")
    return report


# ----------------------------------------------------------------------------------- vLLM MLA

def vllm_absorbed(kv_b: torch.Tensor, n_heads: int, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's absorbed MLA weights from ``kv_b_proj.weight`` ``[N*(P+V), L]``:
    ``W_UK_T`` ``[N, P, L]`` and ``W_UV`` ``[N, L, V]`` (views of ``kv_b``)."""
    lora = kv_b.shape[1]
    w = kv_b.T.view(lora, n_heads, nope + v)
    w_uk, w_uv = w.split([nope, v], dim=-1)
    return w_uk.permute(1, 2, 0), w_uv.transpose(0, 1)


def vllm_mla_absorb(model: torch.nn.Module, ctx: Mapping | None = None) -> dict:
    """Redo vLLM's ``W_UK_T`` / ``W_UV`` where they are copies of ``kv_b_proj`` (views need nothing)."""
    strict = (ctx or {}).get("strict", True)
    views, recomputed, refused = [], [], []
    for where, obj in _holders(model, ("W_UK_T", "W_UV", "kv_b_proj")):
        kv_b = getattr(obj.kv_b_proj, "weight", None)
        uk, uv = obj.W_UK_T, obj.W_UV
        if not isinstance(kv_b, torch.Tensor) or not isinstance(uk, torch.Tensor) or not isinstance(uv, torch.Tensor):
            continue
        kv_b = kv_b.detach()
        if _same_memory(uk, kv_b) and _same_memory(uv, kv_b):
            views.append(where)
            continue
        n, nope, lora = uk.shape
        v = uv.shape[2]
        if (kv_b.dtype not in (torch.float16, torch.bfloat16, torch.float32) or uk.dtype != kv_b.dtype
                or uv.dtype != kv_b.dtype or tuple(kv_b.shape) != (n * (nope + v), lora)):
            refused.append(f"{where} (kv_b_proj {list(kv_b.shape)} {kv_b.dtype}, W_UK_T {list(uk.shape)} {uk.dtype})")
            continue
        new_uk, new_uv = vllm_absorbed(kv_b, n, nope, v)
        with torch.no_grad():
            uk.copy_(new_uk)
            uv.copy_(new_uv)
        recomputed.append(where)
    if refused and strict:
        raise PostRefitError("cannot recompute vLLM's absorbed MLA weights (quantized or unexpected shapes) at: "
                             + "; ".join(refused[:4]) + " -- these backends need process_weights_after_loading")
    return {"hook": "mla_absorb", "views": views, "recomputed": recomputed, "refused": refused}


# ----------------------------------------------------------------------------------- SGLang MLA

def sglang_absorbed(kv_b: torch.Tensor, nope: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's ``w_kc`` ``[N, P, L]`` and ``w_vc`` ``[N, L, V]`` values from ``kv_b_proj.weight``."""
    w_kc, w_vc = kv_b.unflatten(0, (-1, nope + v)).split([nope, v], dim=1)
    return w_kc, w_vc.transpose(1, 2)


def _kv_b_names(model: torch.nn.Module, changed: Iterable[str] | None) -> list[str]:
    names = [n for n, _ in model.named_parameters() if n.endswith("kv_b_proj.weight")]
    if changed is not None:
        ch = set(changed)
        names = [n for n in names if n in ch or any(c.endswith(n) for c in ch)]
    return names


def sglang_mla_post_load(model: torch.nn.Module, ctx: Mapping | None = None) -> dict:
    """Rebuild SGLang's ``w_kc`` / ``w_vc`` for layers whose ``kv_b_proj`` changed: the model's own
    ``post_load_weights(weight_names=...)`` when it has one (it keeps storage with
    ``bind_or_assign``), else ``copy_`` of the recomputed values (bf16/fp16/fp32 only)."""
    ctx = ctx or {}
    names = _kv_b_names(model, ctx.get("changed"))
    if not names:
        return {"hook": "mla_post_load", "layers": [], "via": None}
    post = getattr(model, "post_load_weights", None)
    if callable(post):
        try:
            params = inspect.signature(post).parameters
        except (TypeError, ValueError):
            params = {}
        if "weight_names" in params:
            post(weight_names=list(names))
        else:
            post()
        return {"hook": "mla_post_load", "layers": names, "via": "post_load_weights"}
    done, refused = [], []
    for where, attn in _holders(model, ("w_kc", "w_vc", "kv_b_proj")):
        kv_b = attn.kv_b_proj.weight.detach()
        w_kc, w_vc = attn.w_kc, attn.w_vc
        if w_kc is None or w_vc is None:
            continue
        nope, v = w_kc.shape[1], w_vc.shape[2]
        if kv_b.dtype != w_kc.dtype or kv_b.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            refused.append(where)
            continue
        kc, vc = sglang_absorbed(kv_b, nope, v)
        with torch.no_grad():
            w_kc.copy_(kc)
            w_vc.copy_(vc)
        done.append(where)
    if refused and ctx.get("strict", True):
        raise PostRefitError(f"cannot recompute SGLang's w_kc/w_vc (quantized kv_b_proj) at {refused[:4]} and the model "
                             "has no post_load_weights")
    return {"hook": "mla_post_load", "layers": done, "via": "copy_", "refused": refused}


# ----------------------------------------------------------------------------------- caches

def _call_owner(method: str, owners: Iterable[Any]) -> tuple[str | None, Any]:
    for owner in owners:
        fn = getattr(owner, method, None) if owner is not None else None
        if callable(fn):
            return type(owner).__name__, fn()
    return None, None


def reset_prefix_cache(model: torch.nn.Module, ctx: Mapping | None = None) -> dict:
    """vLLM: ``reset_prefix_cache()`` on the first owner that has it."""
    owner, result = _call_owner("reset_prefix_cache", (ctx or {}).get("owners", ()))
    if owner is None:
        return {"hook": "prefix_cache", "done": False,
                "note": "no worker-side owner has reset_prefix_cache: call llm.reset_prefix_cache() on the driver"}
    return {"hook": "prefix_cache", "done": result is not False, "owner": owner}


def flush_cache(model: torch.nn.Module, ctx: Mapping | None = None) -> dict:
    """SGLang: ``flush_cache()`` on the first owner that has it."""
    owner, result = _call_owner("flush_cache", (ctx or {}).get("owners", ()))
    if owner is None:
        return {"hook": "flush_cache", "done": False,
                "note": "SGLang's scheduler flushes after update_weights_from_tensor(flush_cache=True); "
                        "otherwise call engine.flush_cache()"}
    return {"hook": "flush_cache", "done": result is not False, "owner": owner}


@dataclass(frozen=True)
class Hook:
    name: str
    fn: Callable[[torch.nn.Module, Mapping], dict]
    doc: str


POST_REFIT: dict[str, tuple[Hook, ...]] = {
    "vllm": (Hook("fp8_guard", fp8_guard, "refuse FP8 block-scaled parameters"),
             Hook("mla_absorb", vllm_mla_absorb, "W_UK_T/W_UV: nothing for views, copy_ for copies"),
             Hook("prefix_cache", reset_prefix_cache, "reset_prefix_cache on an owner")),
    "sglang": (Hook("fp8_guard", fp8_guard, "refuse FP8 block-scaled parameters"),
               Hook("mla_post_load", sglang_mla_post_load, "post_load_weights for changed kv_b_proj"),
               Hook("flush_cache", flush_cache, "flush_cache on an owner")),
}


def run_post_refit(engine: str, models: torch.nn.Module | Sequence[torch.nn.Module], *, owners: Sequence[Any] = (),
                   changed: Iterable[str] | None = None, strict: bool = True, skip: Iterable[str] = ()) -> dict:
    """Run ``engine``'s hooks (``POST_REFIT[engine]``) on each model (target, then draft); cache
    hooks run once.  ``changed``: the runtime names the refit wrote (None: everything)."""
    if engine not in POST_REFIT:
        raise ValueError(f"unknown engine {engine!r}; known: {sorted(POST_REFIT)}")
    models = [models] if isinstance(models, torch.nn.Module) else [m for m in models if m is not None]
    ctx = {"owners": list(owners), "changed": None if changed is None else list(changed), "strict": strict}
    skip = set(skip)
    reports = []
    for hook in POST_REFIT[engine]:
        if hook.name in skip:
            continue
        if hook.name in ("prefix_cache", "flush_cache"):
            reports.append(hook.fn(models[0] if models else None, ctx))
            continue
        for i, m in enumerate(models):
            rep = hook.fn(m, ctx)
            rep["model"] = i
            reports.append(rep)
    return {"engine": engine, "hooks": reports}


__all__ = ["DERIVED", "Derived", "Hook", "POST_REFIT", "PostRefitError", "flush_cache", "fp8_guard",
           "reset_prefix_cache", "run_post_refit", "sglang_absorbed", "sglang_mla_post_load", "vllm_absorbed",
           "vllm_mla_absorb"]
