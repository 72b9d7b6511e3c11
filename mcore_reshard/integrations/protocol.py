"""The refit protocol every side runs: trainer ranks, vLLM workers, SGLang TP workers.

One process group holds the trainer ranks and the inference workers together (one "world"):
trainer ranks are ``[0, T)``, an engine's workers follow at ``rank_offset``
(vLLM: ``rank_offset + (dp_rank * pp + pp_rank) * tp + tp_rank``; SGLang: ``rank_offset + tp_rank``,
one ``rank_offset`` per engine).  Inside an engine ``torch.distributed`` already holds the engine's
own world, so :func:`join_group` builds the shared group *beside* it (the pattern vLLM's RLHF
examples, SGLang's ``init_weights_update_group`` and OpenRLHF use), and falls back to
``init_process_group`` in a process that has no default group yet.

Every rank then calls :func:`join_refit` once (collective)::

    rank      | src                                  | dst
    trainer r | its canonical layout part + tensors  | None
    worker w  | None                                 | a layout *spec* (engine, config, kwargs)
              |                                      |  + its live parameters (runtime names)

1. each rank puts what it brings into one JSON payload: a layout part (only its own buffers),
   or a spec (``{"engine": "vllm", "config": {...}, "kwargs": {...}}``: every rank rebuilds the same
   whole-engine layout from it, so the exchange stays tiny), the plan options, and any error it
   found locally (e.g. parameter names that do not match the layout);
2. :func:`mcore_reshard.core.executor.all_gather_json`: every rank sees every payload, in rank order;
3. if any rank reported an error, or options differ, *every* rank raises
   :class:`~mcore_reshard.core.executor.ReshardError` (nothing has moved);
4. every rank merges the parts and the distinct specs into one source and one destination layout
   and calls :func:`mcore_reshard.core.planner.make_plan` with the same options: the same plan everywhere;
5. every rank constructs :class:`~mcore_reshard.core.executor.Resharder` (its collective handshake checks
   the plan hash and each rank's tensors once more) and returns it; ``refit()`` then moves the weights
   after every training step, ``copy_`` into existing storage.

Example, 2 trainer ranks (HF-style unsharded source on each, i.e. two replicas) and vLLM tp=2 at
``rank_offset=2``::

    rank 0, 1: join_refit(g, src=part_r, src_tensors=...)                 # trainer
    rank 2, 3: join_refit(g, dst=layout_spec("vllm", cfg, tp=2, rank_offset=2), dst_tensors=params)
    all:       r.refit(version)
"""
from __future__ import annotations

import dataclasses
import datetime
import difflib
import hashlib
import math
import numbers
import re
import time
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

from ..core.executor import Resharder, ReshardError, WindowedResharder, all_gather_json, all_or_none, dtype_name
from ..core.layout import Layout, LayoutError, merge_layouts
from ..core.planner import DEFAULT_BUDGET, PlanError, check_budget, make_plan, make_windowed_plan
from ..core.planner.windows import check_window_bytes
from ..util.identity import ModuleIdentity, TrackedTensors, identity_of, tracked

ENGINES = ("vllm", "sglang", "hf", "megatron")


# ----------------------------------------------------------------------------------- process group

def _rank_map(world_size: int, rank: int, default_rank: int) -> dict[int, int]:
    """A global->group rank map in which this process's default-world rank maps to ``rank``.

    ``torch.distributed.get_rank(group)`` looks the default-world rank up in this map; the other
    members get placeholder global ids (the executor always addresses peers by group rank)."""
    spare = (k for k in range(world_size + 1) if k != default_rank)
    out = {next(spare): r for r in range(world_size) if r != rank}
    out[default_rank] = rank
    return out


def _whole(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what}={value!r}: must be an integer, not {type(value).__name__}")
    return int(value)


def check_join_args(init_method, world_size, rank, timeout_s, backend=None) -> tuple[int, int, float]:
    """``(world_size, rank, timeout_s)`` checked before any rendezvous (a bad value would otherwise
    wait on the store until the timeout, or fail inside torch with a message naming nothing):
    TypeError / ValueError naming the argument.  ``rank`` may be a worker's computed rank."""
    if not isinstance(init_method, str) or "://" not in init_method:
        raise ValueError(f"init_method={init_method!r}: must be a URL string, tcp://host:port or file:///path")
    world_size, rank = _whole(world_size, "world_size"), _whole(rank, "rank")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: outside the group of world_size={world_size} (ranks 0..{world_size - 1})")
    if (isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not math.isfinite(float(timeout_s))
            or not 0 < float(timeout_s) <= 1e9):
        raise ValueError(f"timeout_s={timeout_s!r}: must be a finite number of seconds > 0 and <= 1e9")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend={backend!r}: must be a backend name ('gloo', 'nccl') or None")
    return world_size, rank, float(timeout_s)


def engine_rank(rank_offset, local_rank: int, world_size, who: str) -> int:
    """An engine worker's rank in the shared group, ``rank_offset + local_rank``: TypeError /
    ValueError naming ``rank_offset`` / ``world_size`` for a value of the wrong kind,
    :class:`ReshardError` when the rank falls outside ``world_size``."""
    offset, world = _whole(rank_offset, "rank_offset"), _whole(world_size, "world_size")
    if offset < 0:
        raise ValueError(f"rank_offset={offset}: must be >= 0 (the shared group rank of the engine's first worker)")
    rank = offset + int(local_rank)
    if not 0 <= rank < world:
        raise ReshardError(f"{who} rank {rank} (rank_offset {offset}) is outside world_size {world}")
    return rank


def join_group(init_method: str, world_size: int, rank: int, *, backend: str | None = None,
               timeout_s: float = 600.0, group_name: str | None = None):
    """Collective over the ``world_size`` processes that call it: a process group in which this
    process is ``rank``.  Returns the group to pass as ``group=``.

    Without a default process group this is ``init_process_group`` (and returns ``dist.group.WORLD``).
    With one (an engine worker, or a trainer with its own world) it creates an independent group next
    to it through ``torch.distributed``'s private ``_new_process_group_helper`` (as SGLang's
    ``init_custom_process_group`` does), so that ``dist.get_rank(group)`` and every collective /
    point-to-point call with ``group=`` work.  ``init_method``: ``tcp://host:port`` (group rank 0
    hosts the store) or ``file:///shared/path``.  ``backend``: ``nccl`` with CUDA, else ``gloo``.
    Every member must be of the same kind (all with a default group, or none): a mix is refused on
    every member as soon as all have arrived (``RuntimeError`` naming the ranks of each kind and the fix).
    """
    from torch.distributed import distributed_c10d as c10d

    world_size, rank, timeout_s = check_join_args(init_method, world_size, rank, timeout_s, backend)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=timeout_s)
    name = group_name or "mcore_reshard_" + hashlib.sha1(init_method.encode()).hexdigest()[:12]
    try:
        store, _, _ = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    except RuntimeError as e:     # tcp://: group rank 0's store never came up within the timeout
        raise ReshardError(f"join_group: rank {rank} of {world_size} reached no rendezvous at {init_method} within "
                           f"{timeout_s:g} s: {e}") from e
    store.set_timeout(timeout)
    _same_kind_of_join(store, name, rank, world_size, dist.is_initialized(), timeout)
    try:
        return _make_group(store, name, rank, world_size, backend, timeout)
    except RuntimeError as e:     # a peer that left after the rendezvous: torch's bare timeout, named here
        if isinstance(e, ReshardError):
            raise
        raise ReshardError(f"join_group: rank {rank} of {world_size} could not connect the group within "
                           f"{timeout.total_seconds():g} s (a member left or stalled after the rendezvous): {e}") from e


def _make_group(store, name: str, rank: int, world_size: int, backend: str, timeout: datetime.timedelta):
    from torch.distributed import distributed_c10d as c10d
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, world_size=world_size, rank=rank, timeout=timeout)
        return dist.group.WORLD
    default = c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    if bound is not None:
        default.bound_device_id = None   # never ncclCommSplit from the engine's own world
    try:
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                               group_name=name, timeout=timeout)
    finally:
        if bound is not None:
            default.bound_device_id = bound
    c10d._world.pg_group_ranks[pg] = _rank_map(world_size, rank, default.rank())
    if dist.get_rank(pg) != rank or dist.get_world_size(pg) != world_size:
        raise RuntimeError(f"join_group: built group reports rank {dist.get_rank(pg)}/{dist.get_world_size(pg)}, "
                           f"expected {rank}/{world_size}")
    return pg


def _same_kind_of_join(store, name: str, rank: int, world_size: int, has_default: bool,
                       timeout: datetime.timedelta) -> None:
    """Every member says through the rendezvous store whether it already has a default process group.

    A process without one makes the group its default world (``init_process_group``), a process
    with one builds a second group beside it: the two build incompatible stores and would wait for
    each other until the timeout, then fail with a bare gloo "Wait timeout".  So a mix is refused as
    soon as every member has arrived, on every member, saying which ranks are which."""
    key = f"mcore_reshard_join/{name}/"
    store.set(key + str(rank), "beside" if has_default else "world")
    try:
        store.wait([key + str(r) for r in range(world_size)], timeout)
    except RuntimeError as e:     # torch's bare "Wait timeout": say who is missing
        missing = [r for r in range(world_size) if not store.check([key + str(r)])]
        raise ReshardError(f"join_group: group ranks {missing} did not join within {timeout.total_seconds():g} s "
                           f"(this is rank {rank} of {world_size}); every member must call join_group with the same "
                           f"init_method") from e
    kinds = {r: store.get(key + str(r)).decode() for r in range(world_size)}
    if len(set(kinds.values())) > 1:
        beside = [r for r, k in kinds.items() if k == "beside"]
        world = [r for r, k in kinds.items() if k == "world"]
        raise RuntimeError(
            f"join_group: group ranks {beside} already have a default process group (they build this group beside "
            f"it), group ranks {world} have none (they would make this group their default world); the two cannot "
            f"meet.  Make every member the same: on ranks {world}, first create a default group of their own "
            f"(e.g. dist.init_process_group('gloo', init_method='file:///tmp/<unique>', rank=0, world_size=1)), "
            f"then call join_group; or call join_group on every member before any other init_process_group")


def leave_group(group) -> None:
    """Destroy a group made by :func:`join_group` (the default world if that is what it made)."""
    if group is None or group is dist.group.WORLD:
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)


# ----------------------------------------------------------------------------------- layout specs

def config_to_json(config) -> dict:
    """A :class:`~mcore_reshard.targets.ModelConfig` as JSON (``extra`` dropped)."""
    d = dataclasses.asdict(config)
    d.pop("extra", None)
    d["mlp_only_layers"] = list(d.get("mlp_only_layers") or ())
    return d


def config_from_json(obj: Mapping):
    """The :class:`~mcore_reshard.targets.ModelConfig` of :func:`config_to_json`'s dict; LayoutError
    naming the missing, unknown or ill-typed fields."""
    from ..targets import ModelConfig
    if not isinstance(obj, Mapping):
        raise LayoutError(f"model config: expected a dict of ModelConfig fields, not {type(obj).__name__}")
    fields = {f.name: f for f in dataclasses.fields(ModelConfig) if f.name != "extra"}
    required = [n for n, f in fields.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing, unknown = [n for n in required if n not in obj], sorted(set(obj) - set(fields) - {"extra"})
    if missing or unknown:
        raise LayoutError(f"model config: missing fields {missing}, unknown fields {unknown}")
    for n in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        v = obj[n]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"model config: {n}={v!r} must be an integer >= 1")
    d = dict(obj)
    d["mlp_only_layers"] = tuple(d.get("mlp_only_layers") or ())
    return ModelConfig(**d)


def layout_spec(engine: str, config, **kwargs) -> dict:
    """A JSON description of a whole layout that every rank rebuilds identically.

    ``engine``: ``vllm`` (kwargs of :func:`~mcore_reshard.targets.vllm_layout`), ``sglang``
    (:func:`~mcore_reshard.targets.sglang_layout`), ``hf`` (:func:`~mcore_reshard.targets.hf_layout`,
    ``rank=``), ``megatron`` (:func:`~mcore_reshard.sources.megatron_spec.megatron_layout`: ``sizes`` as a dict
    of :class:`~mcore_reshard.sources.megatron_spec.ParallelSizes` fields, ``family``, ``dtype``,
    ``norm_dtype``, ``rank_offset``).  ``config``: a ModelConfig or its JSON."""
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r}: unknown; known: {ENGINES}")
    if not isinstance(config, Mapping) and not dataclasses.is_dataclass(config):
        raise TypeError(f"config={config!r:.60}: expected a ModelConfig or its JSON dict")
    cfg = config if isinstance(config, Mapping) else config_to_json(config)
    kw = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items()}
    return {"engine": engine, "config": dict(cfg), "kwargs": kw}


def build_layout(spec: Mapping) -> Layout:
    """The layout a :func:`layout_spec` describes."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("config"), Mapping) \
            or not isinstance(spec.get("kwargs") or {}, Mapping):
        raise LayoutError(f"layout spec {spec!r:.80}: expected a dict with 'engine', 'config' (a dict) and "
                          "'kwargs' (a dict), as layout_spec() makes")
    engine, kw = spec.get("engine"), dict(spec.get("kwargs") or {})
    if engine not in ENGINES:
        raise LayoutError(f"layout spec: engine={engine!r} is unknown; known: {ENGINES}")
    cfg = config_from_json(spec["config"])
    try:
        layout = _build(engine, cfg, kw)
    except LayoutError:
        raise
    except (TypeError, ValueError, KeyError, IndexError, ZeroDivisionError) as e:
        raise LayoutError(f"layout spec {spec_text(spec)}: the kwargs do not describe a layout: "
                          f"{type(e).__name__}: {e}") from e
    if not layout.buffers:
        raise LayoutError(f"layout spec {spec_text(spec)}: describes no rank's buffers (a parallel size below 1?)")
    return layout


def _build(engine: str, cfg, kw: dict) -> Layout:
    from ..targets import hf_layout, sglang_layout, vllm_layout
    if engine == "vllm":
        return vllm_layout(cfg, **kw)
    if engine == "sglang":
        return sglang_layout(cfg, **kw)
    if engine == "hf":
        return hf_layout(cfg, **kw)
    from ..sources.megatron_spec import ParallelSizes, megatron_layout
    sizes = ParallelSizes(**kw.pop("sizes", {}))
    return megatron_layout(cfg, sizes, **kw)


def spec_text(spec: Mapping) -> str:
    kwargs = spec.get("kwargs") if isinstance(spec, Mapping) else None
    kw = ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())) if isinstance(kwargs, Mapping) else ""
    cfg = spec.get("config") if isinstance(spec, Mapping) else None
    engine = spec.get("engine", "?") if isinstance(spec, Mapping) else "?"
    return f"{engine}_layout({cfg.get('model_type', '?') if isinstance(cfg, Mapping) else '?'}, {kw})"


def _layout_arg(value, what: str) -> Layout:
    if not isinstance(value, Layout):
        raise TypeError(f"{what}={value!r:.60}: must be a Layout, not {type(value).__name__}")
    return value


def rank_part(layout: Layout, rank: int, drop: Iterable[str] = ()) -> Layout:
    """The part of ``layout`` on ``rank`` (its buffers and the tensors they hold), minus ``drop``."""
    _layout_arg(layout, "layout")
    _whole(rank, "rank")
    if isinstance(drop, (str, bytes)) or not isinstance(drop, Iterable):
        raise TypeError(f"drop={drop!r}: must be an iterable of buffer names")
    drop = set(drop)
    part = Layout()
    for name, buf in sorted(layout.buffers.get(rank, {}).items()):
        if name in drop:
            continue
        for p in buf.pieces:
            m = layout.tensors[p.tensor]
            part.add_tensor(m.name, m.shape, m.dtype)
        part.buffers.setdefault(rank, {})[name] = buf
    return part


# ----------------------------------------------------------------------------------- live tensors

def live_tensors(modules: Mapping[str, torch.nn.Module]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parameters of several modules under ``prefix + name`` (``{"": model, "mtp.": draft}``),
    detached (same storage).  A parameter whose memory is already listed under another name (a draft
    model sharing the target's embedding) is left out and returned in ``aliases`` (name -> name it
    shares memory with): it is updated through the other name.  The tensors come as a
    :class:`~mcore_reshard.util.identity.TrackedTensors`: :func:`join_refit` then re-checks at every
    refit that the modules still hold them (a replaced module is followed or refused)."""
    if not isinstance(modules, Mapping):
        raise TypeError(f"modules: must be a mapping of prefix -> torch.nn.Module, not {type(modules).__name__}")
    out: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for prefix, module in modules.items():
        if module is None:
            continue
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"modules[{prefix!r}]: must be a torch.nn.Module, not {type(module).__name__}")
        for name, p in module.named_parameters():
            t = p.detach()
            key = (t.device.type, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            full = prefix + name
            if t.numel() and key in seen:
                aliases[full] = seen[key]
                continue
            seen[key] = full
            out[full] = t
    return tracked(dict(modules), out, rank=-1), aliases


def check_tensors(layout: Layout, rank: int, tensors: Mapping[str, torch.Tensor], *, what: str = "parameters",
                  against: str = "the layout", ignore: Iterable[str] = (), limit: int = 8) -> list[str]:
    """Errors (empty if none) comparing this rank's live tensors with ``layout``'s buffers on
    ``rank``: names the layout has and the model lacks (with a close name when there is one), names
    the model has and the layout lacks (they would keep stale weights), shapes and dtypes.
    ``ignore``: regexes of live names that are not weights the refit owns."""
    _layout_arg(layout, "layout")
    _whole(rank, "rank")
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors: must be a mapping of buffer name -> tensor, not {type(tensors).__name__}")
    if isinstance(ignore, (str, bytes)) or not isinstance(ignore, Iterable):
        raise TypeError(f"ignore={ignore!r}: must be an iterable of regexes")
    try:
        pats = [re.compile(p) for p in ignore]
    except (re.error, TypeError) as e:
        raise ValueError(f"ignore: {e}") from e
    not_tensors = sorted(n for n, t in tensors.items() if not isinstance(t, torch.Tensor))
    if not_tensors:
        return [f"rank {rank}: {what}: not tensors: {', '.join(not_tensors[:limit])}"]
    want = layout.buffers.get(rank, {})
    have = {n: t for n, t in tensors.items() if not any(p.search(n) for p in pats)}
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    bad = []
    for name in sorted(set(want) & set(have)):
        b, t = want[name], have[name]
        if tuple(t.shape) != tuple(b.shape) or dtype_name(t.dtype) != b.dtype:
            why = (" -- empty: the engine's post-load processing moved this weight elsewhere (a packed kernel "
                   "handle); refit it through the engine's load lifecycle (vLLM: post_load='reprocess')"
                   if t.numel() == 0 and math.prod(b.shape) > 0 else "")
            bad.append(f"{name} {list(t.shape)} {dtype_name(t.dtype)} (layout: {list(b.shape)} {b.dtype}){why}")
    parts = []
    if missing:
        items = []
        for n in missing[:limit]:
            close = difflib.get_close_matches(n, extra, n=1, cutoff=0.8)
            b = want[n]
            items.append(f"{n} {list(b.shape)} {b.dtype}" + (f" (the model has {close[0]})" if close else ""))
        parts.append(f"{len(missing)} missing: " + ", ".join(items) + (" ..." if len(missing) > limit else ""))
    if extra:
        parts.append(f"{len(extra)} not in the layout (would keep stale weights): "
                     + ", ".join(f"{n} {list(have[n].shape)}" for n in extra[:limit]) + (" ..." if len(extra) > limit else ""))
    if bad:
        parts.append(f"{len(bad)} of another shape or dtype: " + ", ".join(bad[:limit]) + (" ..." if len(bad) > limit else ""))
    return [f"rank {rank}: {what} do not match {against}: " + "; ".join(parts)] if parts else []


def engine_destination(rank: int, spec: Mapping, tensors: Mapping[str, torch.Tensor], aliases: Mapping[str, str], *,
                       what: str, ignore: Iterable[str] = ()) -> tuple[Any, dict[str, torch.Tensor], str | None]:
    """An engine rank's side of :func:`join_refit`: ``(dst, dst_tensors, error)``.

    Builds the layout ``spec`` describes, checks this rank's live ``tensors`` against it
    (:func:`check_tensors`) and keeps the tensors the layout writes.  A drafter sharing the target's
    memory (``aliases`` from :func:`live_tensors`) makes ``dst`` this rank's part without those
    buffers (the shared tensor is written once, under the target's name); otherwise ``dst`` is the
    spec itself (smaller to exchange).  Any failure comes back as ``error`` (with ``dst = None``),
    to be raised on every rank by :func:`join_refit` before anything moves."""
    try:
        full = build_layout(spec)
        part = rank_part(full, rank, drop=aliases) if aliases else None
        errs = check_tensors(part or full, rank, tensors, what=what, against=spec_text(spec), ignore=ignore)
        if errs:
            return None, {}, " | ".join(errs)
        mine = (part or full).buffers.get(rank, {})
        kept = tensors.subset(mine) if isinstance(tensors, TrackedTensors) else {n: t for n, t in tensors.items() if n in mine}
        return (part if part is not None else spec), kept, None
    except Exception as e:  # noqa: BLE001 - reported to every rank by join_refit
        return None, {}, f"rank {rank}: {type(e).__name__}: {e}"


def engine_identity(models: Mapping[str, Any], names: Iterable[str], rank: int) -> ModuleIdentity:
    """The modules that hold an engine's bound tensors (``names``: runtime names, ``prefix + name``
    under ``models``: ``{prefix: module}`` or ``{prefix: (holder, attribute)}``, e.g.
    ``(model_runner, "model")``), for a binding that cannot follow a replaced module (vLLM's
    loader-format buffers are built per module at prepare): :meth:`ModuleIdentity.check` then names
    every module replaced since, and the refit is refused on every rank (prepare again)."""
    return tracked(dict(models), dict.fromkeys(names), rank=rank, follow=False, leaves=False).identity


def timed_refit(resharder: Resharder, rank: int, version: int | None, *, refusal: list[str] | None = None) -> dict:
    """One refit of an engine rank (``copy_`` into its parameters), synchronised on CUDA, timed.
    ``refusal``: this rank's reasons not to refit (every rank then refuses before a byte moves)."""
    t0 = time.monotonic()
    with torch.no_grad():
        stats = resharder.refit(version, refusal=refusal) if refusal else resharder.refit(version)
    if torch.cuda.is_available() and any(t.is_cuda for t in resharder.dst.values()):
        torch.cuda.synchronize()
    return {"rank": rank, **stats, "seconds": round(time.monotonic() - t0, 3)}


# ----------------------------------------------------------------------------------- the protocol

def _side(payloads: list[dict], side: str) -> Layout:
    parts, specs = [], {}
    for p in payloads:
        if p.get(side) is not None:
            parts.append(Layout.from_json(p[side]))
        spec = p.get(side + "_spec")
        if spec is not None:
            specs.setdefault(_spec_key(spec), spec)
    built = [build_layout(specs[k]) for k in sorted(specs)]
    return merge_layouts(built + parts)


def _spec_key(spec: Mapping) -> str:
    import json
    return json.dumps(spec, sort_keys=True)


def _as_payload(side: str, value, rank: int) -> tuple[dict | None, dict | None]:
    """(part JSON, spec) for what a rank brings on one side."""
    if value is None:
        return None, None
    if isinstance(value, Mapping):
        if "engine" not in value:
            raise ValueError(f"{side}: a dict must be a layout spec (see layout_spec), got keys {sorted(value)}")
        return None, dict(value)
    if isinstance(value, Layout):
        others = [r for r in value.ranks if r != rank]
        if others:
            raise ValueError(f"{side} layout part of rank {rank} has buffers of ranks {others[:8]}: pass only this "
                             "rank's buffers (rank_part(layout, rank)) or a layout_spec")
        return value.to_json(), None
    raise TypeError(f"{side}: expected a Layout part, a layout spec dict or None, not {type(value).__name__}")


def join_refit(group=None, src=None, src_tensors: Mapping[str, torch.Tensor] | None = None, dst=None,
               dst_tensors=None, *, error: str | None = None, budget_bytes: int = DEFAULT_BUDGET,
               allow_cast: bool | str = "loader", ignore_unused: bool = False, timeout: float | None = None,
               verify: bool = False, window_bytes: int | None = None):
    """Collective over ``group``: exchange what each rank brings, plan, bind (see the module doc).

    ``src`` / ``dst``: this rank's layout part (a :class:`Layout` holding only this rank's buffers, in
    canonical tensor names), a :func:`layout_spec` dict, or None.  ``src_tensors`` / ``dst_tensors``:
    this rank's real tensors by buffer name.  ``error``: a problem this rank already found (e.g.
    :func:`check_tensors`); it makes every rank raise before anything moves.  The plan options must
    be the same on every rank.  ``allow_cast``: ``"loader"`` (default) casts between floating-point
    dtypes where source and destination differ, as every engine's ``load_weights`` does (``copy_``,
    round to nearest even: Megatron's fp32 router bias or norms into a bf16 engine are bit-equal to
    the engine's own load of an HF export), and refuses any other cast; ``True`` any cast the
    planner allows; ``False`` none.  Returns the :class:`Resharder` (``.plan`` holds the plan).

    ``window_bytes``: a rank (an engine that streams its refit, :mod:`~.vllm_refit_modes`) asks for
    a *windowed* plan: the destination cut into windows of whole modules of at most that many
    destination bytes per rank (:mod:`mcore_reshard.core.planner.windows`), one plan each.  ``None``
    (default) asks nothing: the plan is windowed when any rank asks (every asking rank must ask
    the same), so a trainer needs no option of its own.  Then every rank gets a
    :class:`~mcore_reshard.core.executor.WindowedResharder` (the same ``refit``, ``state``,
    ``rebind``; ``refit(after_window=...)`` for the receiver's work between windows), and
    ``dst_tensors`` may be a callable ``windows -> [{name: tensor}, ...]`` building each window's
    tensors (over memory a receiver reuses from one window to the next)::

        rank 0, 1: join_refit(g, src=part_r, src_tensors=...)                      # trainer
        rank 2, 3: join_refit(g, dst=spec, dst_tensors=arena.tensors, window_bytes=W)
        all:       r.refit(version)          # engine: r.refit(version, after_window=process)
    """
    bad = []
    if window_bytes is not None:
        try:
            window_bytes = check_window_bytes(window_bytes)
        except PlanError as e:
            bad.append(f"rank {dist.get_rank(group)}: {e}")
    src_layout, dst_layout, plan_kw, windowed = _exchange(
        group, src, src_tensors, dst, dst_tensors, error=error, budget_bytes=budget_bytes, allow_cast=allow_cast,
        ignore_unused=ignore_unused, timeout=timeout, verify=verify, window_bytes=window_bytes, local=bad)
    if windowed is None:
        with all_or_none(group, timeout=timeout):    # deterministic, but still exchanged so nobody waits
            if callable(dst_tensors) and not isinstance(dst_tensors, Mapping):
                raise TypeError("dst_tensors is a callable (per window) but no rank asked for windows (window_bytes)")
            plan = make_plan(src_layout, dst_layout, **plan_kw)
        r = Resharder(plan, dict(src_tensors or {}), dict(dst_tensors or {}), group, timeout=timeout, verify=verify)
    else:
        with all_or_none(group, timeout=timeout):
            plan = make_windowed_plan(src_layout, dst_layout, window_bytes=windowed, **plan_kw)
        tensors = dst_tensors if callable(dst_tensors) and not isinstance(dst_tensors, Mapping) else dict(dst_tensors or {})
        r = WindowedResharder(plan, dict(src_tensors or {}), tensors, group, timeout=timeout, verify=verify)
    # tensors read from modules (megatron_source, live_tensors, read_hf_layout) carry where they live: a
    # module or parameter replaced later is followed at the next refit, or refused on every rank
    rank = dist.get_rank(group)
    for side, tensors in (("src", src_tensors), ("dst", dst_tensors)):
        ident = identity_of(tensors, side, rank=rank) if isinstance(tensors, Mapping) else None
        if ident is not None:
            r.watch(side, ident.check)
    return r


def _exchange(group, src, src_tensors, dst, dst_tensors, *, error, budget_bytes, allow_cast, ignore_unused, timeout,
              verify, window_bytes, local: list | None = None) -> tuple[Layout, Layout, dict, int | None]:
    """Steps 1-3 of the protocol (see the module doc): every rank's payload exchanged, every problem
    raised on every rank; returns the merged source and destination layouts, the plan options and
    the window budget asked for (None: one plan)."""
    if allow_cast != "loader" and not isinstance(allow_cast, bool):
        raise ValueError(f"allow_cast={allow_cast!r}: expected 'loader', True or False")
    rank = dist.get_rank(group)
    local = list(local or [])
    try:
        budget_bytes = check_budget(budget_bytes)
    except PlanError as e:
        local.append(f"rank {rank}: {e}")
    for what, tensors in (("src_tensors", src_tensors), ("dst_tensors", dst_tensors)):
        if tensors is not None and not isinstance(tensors, Mapping) and not (what == "dst_tensors" and callable(tensors)):
            local.append(f"rank {rank}: {what} must be a mapping of buffer name -> tensor, not {type(tensors).__name__}")
    if error is not None and not isinstance(error, str):
        local.append(f"rank {rank}: error={error!r} must be a message string or None")
    options = {"budget_bytes": budget_bytes if isinstance(budget_bytes, int) else repr(budget_bytes),
               "allow_cast": allow_cast, "ignore_unused": bool(ignore_unused), "verify": bool(verify)}
    error = "; ".join(filter(None, [error if isinstance(error, str) else None] + local)) or None
    payload: dict[str, Any] = {"rank": rank, "error": error, "options": options,
                               "window_bytes": window_bytes if isinstance(window_bytes, int) else None}
    try:
        payload["src"], payload["src_spec"] = _as_payload("src", src, rank)
        payload["dst"], payload["dst_spec"] = _as_payload("dst", dst, rank)
    except Exception as e:  # noqa: BLE001 - every rank must hear about it
        payload.update(src=None, src_spec=None, dst=None, dst_spec=None)
        payload["error"] = "; ".join(filter(None, [error, f"rank {rank}: {type(e).__name__}: {e}"]))
    parts = all_gather_json(payload, group, timeout=timeout)
    problems = [p["error"] for p in parts if p.get("error")]
    opts: dict[str, list[int]] = {}
    for r, p in enumerate(parts):
        opts.setdefault(_spec_key(p["options"]), []).append(r)
    if len(opts) > 1:
        problems.append("plan options differ between ranks: " + "; ".join(f"{k} on ranks {v}" for k, v in sorted(opts.items())))
    asked: dict[int, list[int]] = {}
    for r, p in enumerate(parts):
        if p.get("window_bytes") is not None:
            asked.setdefault(p["window_bytes"], []).append(r)
    if len(asked) > 1:
        problems.append("ranks ask for different windows: " + "; ".join(f"window_bytes={w} on ranks {rs}"
                                                                        for w, rs in sorted(asked.items())))
    if problems:
        raise ReshardError("refit refused before any transfer: " + " | ".join(problems))
    with all_or_none(group, timeout=timeout):    # deterministic, but still exchanged so nobody waits
        src_layout = _side(parts, "src")
        dst_layout = _side(parts, "dst")
        cast = loader_casts(src_layout, dst_layout) if allow_cast == "loader" else bool(allow_cast)
    return (src_layout, dst_layout, {"budget_bytes": budget_bytes, "allow_cast": cast, "ignore_unused": ignore_unused},
            next(iter(asked), None))


FLOATING = frozenset({"float64", "float32", "bfloat16", "float16"})


def loader_casts(src: Layout, dst: Layout) -> bool:
    """Whether the plan must cast (``allow_cast="loader"``): True when some tensor's source and
    destination dtypes differ and every such pair is floating point; raises :class:`LayoutError`
    naming the tensors whose cast an engine's loader would not make (integer, FP8)."""
    _layout_arg(src, "src")
    _layout_arg(dst, "dst")
    differ = [(n, src.tensors[n].dtype, m.dtype) for n, m in sorted(dst.tensors.items())
              if n in src.tensors and src.tensors[n].dtype != m.dtype]
    bad = [f"{n} ({a} -> {b})" for n, a, b in differ if a not in FLOATING or b not in FLOATING]
    if bad:
        raise LayoutError(f"{len(bad)} tensor(s) would need a cast no engine loader makes: {', '.join(bad[:8])}"
                          + (" ..." if len(bad) > 8 else "") + " (allow_cast='loader' casts between floating-point "
                          "dtypes only; pass allow_cast=True on every rank to allow it)")
    return bool(differ)


def megatron_source(chunks, rank: int, *, family: str = "auto", vocab_size: int | None = None) -> tuple[Layout, dict]:
    """The trainer side: this rank's part of a live Megatron-Core model in canonical (HF) tensor
    names, and its tensors (``read_layout`` + ``family.canonicalize``).  ``rank`` is this process's
    rank in the refit group (not necessarily its Megatron rank)."""
    from ..mapper.family import canonicalize, load_family
    from ..sources.megatron_model import family_for, model_config, read_layout
    layout, tensors = read_layout(chunks, rank)
    config = model_config(chunks)
    if vocab_size is not None:
        config["vocab_size"] = vocab_size
    fam = load_family(family_for(config) if family == "auto" else family)
    return canonicalize(layout, fam, config), tensors


__all__ = ["FLOATING", "build_layout", "check_tensors", "engine_identity", "loader_casts", "config_from_json", "config_to_json", "check_join_args", "engine_rank", "join_group", "join_refit",
           "layout_spec", "leave_group", "live_tensors", "megatron_source", "rank_part", "spec_text"]
