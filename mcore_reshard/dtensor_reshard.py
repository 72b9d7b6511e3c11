"""DTensor in, DTensor out: :func:`reshard` moves this rank's source DTensors into its destination
DTensors' local shards, in place, collective over a group spanning both meshes.

Every rank describes what it brings (per tensor and side: global shape, dtype, mesh ranks and shape,
placements) in one JSON all-gather, so that a rank holding no DTensor of a side still builds both
layouts; every rank then builds the same layouts (:mod:`mcore_reshard.core.dtensor`), plans
(:func:`~mcore_reshard.core.planner.make_plan`, cached by the descriptors' signature) and binds a
:class:`~mcore_reshard.core.executor.Resharder` (cached while the same local tensors are bound).
A later call with the same tensors costs one fixed-size control exchange (every rank confirms it reuses the same
binding) plus the transfer.  Any bad input on any rank (mismatched global shapes or dtypes between
the sides, ``Partial``, a rank whose description disagrees with its mesh peers', a local shard of
the wrong shape) raises :class:`ReshardError` on *every* rank before a byte moves, naming the
tensor, the placement and the ranks; a rank that never joins makes the others raise within
``timeout``.

Example, 4 ranks: ``w`` [8, 6] sharded ``Shard(0)`` over ranks 0-1, resharded to ``Shard(1)`` over a
2-D mesh of ranks 0-3 (``[Replicate(), Shard(1)]``, mesh ``[[0, 1], [2, 3]]``)::

    rank | src (Shard(0), mesh [0, 1]) | dst ([R, Shard(1)], mesh [[0, 1], [2, 3]])
    0    | w[0:4, :]                   | w[:, 0:3]
    1    | w[4:8, :]                   | w[:, 3:6]
    2    | None                        | w[:, 0:3]
    3    | None                        | w[:, 3:6]
    reshard(src, dst)      # on every rank; dst.to_local() now holds the bytes

Meshes may also be given as rank lists (:class:`MeshSpec`) with a :class:`ShardSpec` per tensor,
for callers whose processes do not all hold a DeviceMesh (ranks are ranks of ``group``).
``with reshard_group() as g`` (or plain :func:`reshard` calls inside it) collects many calls and
runs them as one plan, one handshake and one refit on exit.
"""
from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from math import prod
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial

from .core.dtensor import Replicate, Shard, _StridedShard, buffer_for
from .core.executor import Resharder, ReshardError, all_gather_json, all_or_none
from .core.executor.common import check_timeout, dtype_name
from .core.executor.handshake import Step, checkin, exchange, missing_ranks
from .core.layout import Layout
from .core.planner import DEFAULT_BUDGET, Plan, make_plan


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh as ranks of the reshard group: ``ranks`` row-major over ``shape`` (slowest dim
    first, as a DeviceMesh's rank tensor).  ``MeshSpec.arange((2, 2), start_rank=4)`` is ranks
    ``[[4, 5], [6, 7]]`` (``nccl_m2n``'s ``Mesh(dims, start_rank=)``)."""
    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if not self.shape or any(s < 1 for s in self.shape) or prod(self.shape) != len(self.ranks):
            raise ValueError(f"MeshSpec: shape {self.shape} must be >= 1 per dim and hold exactly the {len(self.ranks)} ranks {list(self.ranks)}")
        if len(set(self.ranks)) != len(self.ranks) or min(self.ranks) < 0:
            raise ValueError(f"MeshSpec: ranks {list(self.ranks)} must be distinct and >= 0")

    @staticmethod
    def arange(shape: Sequence[int], start_rank: int = 0) -> "MeshSpec":
        n = prod(int(s) for s in shape)
        return MeshSpec(tuple(shape), tuple(range(start_rank, start_rank + n)))


@dataclass(frozen=True)
class ShardSpec:
    """One tensor as this rank holds it, without a DTensor: ``local`` (this rank's shard, None on a
    rank outside ``mesh``), ``mesh`` (a :class:`MeshSpec` or a DeviceMesh), ``placements`` (one per
    mesh dim: ``Shard``, ``_StridedShard``, ``Replicate``), the global ``shape`` and, when ``local`` is
    None, optionally the ``dtype`` (else ``local``'s): a rank outside the mesh may describe the
    tensor (checked against the mesh ranks' description) or not (``dtype=None``)."""
    local: torch.Tensor | None
    mesh: Any
    placements: Sequence
    shape: Sequence[int]
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class ReshardResult:
    """What one :func:`reshard` call did: the plan (``plan.stats``: network bytes, lower bound,
    messages, rounds), this rank's refit counts, and whether the binding was reused."""
    plan: Plan
    counts: dict
    reused: bool


# ----------------------------------------------------------------------------- descriptors

def _placement_json(p) -> list:
    if isinstance(p, _StridedShard):
        return ["SS", int(p.dim), int(p.split_factor)]
    if isinstance(p, Shard):
        return ["S", int(p.dim)]
    if isinstance(p, Replicate):
        return ["R"]
    if isinstance(p, Partial):
        return ["P", str(p.reduce_op)]
    return ["?", repr(p)]


def _placement(obj):
    kind = obj[0]
    return (_StridedShard(obj[1], split_factor=obj[2]) if kind == "SS" else Shard(obj[1]) if kind == "S"
            else Replicate())


def _shown(obj) -> str:
    kind = obj[0]
    return {"SS": lambda: f"_StridedShard({obj[1]}, split_factor={obj[2]})", "S": lambda: f"Shard({obj[1]})",
            "R": lambda: "Replicate()", "P": lambda: f"Partial({obj[1]})"}.get(kind, lambda: str(obj[1]))()


def _group_ranks(global_ranks: list[int], group) -> list[int]:
    if group is None or group is dist.group.WORLD:
        return global_ranks
    out = []
    for g in global_ranks:
        r = dist.get_group_rank(group, g)
        if r is None or r < 0:
            raise ValueError(f"mesh rank {g} (global) is not in the reshard group")
        out.append(r)
    return out


_MESHES: dict = {}     # (id(DeviceMesh), id(group)) -> (the mesh, the group, shape, group ranks)


def _mesh_of(mesh, group) -> tuple[list[int], list[int]]:
    """(shape, row-major group ranks) of a MeshSpec or a DeviceMesh (DeviceMeshes remembered:
    reading ``DeviceMesh.mesh`` costs ~0.5 ms)."""
    if isinstance(mesh, MeshSpec):
        return list(mesh.shape), list(mesh.ranks)
    known = _MESHES.get((id(mesh), id(group)))
    if known is not None and known[0] is mesh and known[1] is group:
        return known[2], known[3]
    ranks = getattr(mesh, "mesh", None)
    if not isinstance(ranks, torch.Tensor):
        raise TypeError(f"mesh={mesh!r}: must be a MeshSpec or a torch DeviceMesh")
    out = list(ranks.shape), _group_ranks([int(r) for r in ranks.flatten().tolist()], group)
    if len(_MESHES) > 256:
        _MESHES.clear()
    _MESHES[(id(mesh), id(group))] = (mesh, group, *out)
    return out


def _describe(obj, group, rank: int) -> tuple[dict | None, torch.Tensor | None]:
    """(descriptor, this rank's local tensor or None) of a DTensor or a ShardSpec; (None, None) for
    ``ShardSpec(None, ..., dtype=None)``."""
    from torch.distributed.tensor import DTensor
    if isinstance(obj, DTensor):
        shape_, ranks = _mesh_of(obj.device_mesh, group)
        placements, gshape, dtype = list(obj.placements), tuple(obj.shape), obj.dtype
        local = obj.to_local() if rank in ranks else None
    elif isinstance(obj, ShardSpec):
        if obj.local is None and obj.dtype is None:
            return None, None           # a rank outside the mesh that does not describe it: the mesh ranks do
        shape_, ranks = _mesh_of(obj.mesh, group)
        placements, gshape = list(obj.placements), tuple(int(s) for s in obj.shape)
        local = obj.local
        if local is not None and not isinstance(local, torch.Tensor):
            raise TypeError(f"ShardSpec.local={type(local).__name__}: must be a torch.Tensor or None")
        dtype = local.dtype if local is not None else obj.dtype
        if local is not None and obj.dtype is not None and obj.dtype != local.dtype:
            raise ValueError(f"ShardSpec.dtype={obj.dtype} but ShardSpec.local is {local.dtype}")
        if local is not None and rank not in ranks:
            raise ValueError(f"ShardSpec.local is given on rank {rank}, which is not in the mesh ranks {ranks}")
    else:
        raise TypeError(f"expected a DTensor or a ShardSpec, got {type(obj).__name__}")
    desc = {"shape": list(gshape), "dtype": dtype_name(dtype), "mesh": ranks, "mesh_shape": shape_,
            "placements": [_placement_json(p) for p in placements], "holds": local is not None}
    return desc, local


def _as_map(value, what: str) -> Mapping:
    if value is None:
        return {}
    if isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise TypeError(f"{what}: tensor names must be strings, got {bad[:3]!r}")
        return {k: v for k, v in value.items() if v is not None}
    return {"tensor": value}


@dataclass
class _Local:
    """This rank's side of a call: descriptors, local tensors, errors found here."""
    descs: dict = field(default_factory=lambda: {"src": {}, "dst": {}})
    tensors: dict = field(default_factory=lambda: {"src": {}, "dst": {}})
    errors: list = field(default_factory=list)


def _collect(local: _Local, side: str, entries: Mapping, group, rank: int) -> None:
    which = "source" if side == "src" else "destination"
    for name, obj in entries.items():
        if name in local.descs[side]:
            local.errors.append(f"rank {rank}: {which} tensor {name!r} is given twice")
            continue
        try:
            desc, t = _describe(obj, group, rank)
            if desc is None:
                continue
            if t is not None:
                _check_local(name, which, desc, t, rank)
                local.tensors[side][name] = t
            local.descs[side][name] = desc
        except Exception as e:  # noqa: BLE001 - every rank must hear about it, before a byte moves
            local.errors.append(f"rank {rank}: {which} tensor {name!r}: {type(e).__name__}: {e}")


def _check_local(name: str, which: str, desc: dict, t: torch.Tensor, rank: int) -> None:
    placements = desc["placements"]
    if any(p[0] not in ("S", "SS", "R") for p in placements):
        return      # refused for everyone when the descriptors are merged
    coord = _coord(desc["mesh"].index(rank), desc["mesh_shape"])
    if len(placements) != len(desc["mesh_shape"]):
        return
    buf = buffer_for(name, name, desc["dtype"], desc["shape"], desc["mesh_shape"], coord, [_placement(p) for p in placements])
    if buf.shape != tuple(t.shape):
        raise ValueError(f"local shard of shape {tuple(t.shape)}, but placements "
                         f"[{', '.join(_shown(p) for p in placements)}] over mesh ranks {desc['mesh']} (shape "
                         f"{desc['mesh_shape']}) at coordinate {coord} give {buf.shape} of the global {tuple(desc['shape'])}")


def _coord(index: int, shape: Sequence[int]) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        index, c = divmod(index, s)
        out.append(c)
    return tuple(reversed(out))


# ----------------------------------------------------------------------------- merging

def _merge_side(parts: list[dict], side: str, world: int, problems: list[str]) -> tuple[dict, set]:
    """(name -> the one descriptor every reporting rank agrees on, names refused: problems appended)."""
    which = "source" if side == "src" else "destination"
    reports: dict[str, dict[str, list[int]]] = {}
    holders: dict[str, set[int]] = {}
    for r, p in enumerate(parts):
        for name, d in (p.get("descs") or {}).get(side, {}).items():
            key = json.dumps({k: d[k] for k in ("shape", "dtype", "mesh", "mesh_shape", "placements")}, sort_keys=True)
            reports.setdefault(name, {}).setdefault(key, []).append(r)
            if d["holds"]:
                holders.setdefault(name, set()).add(r)
    out, refused = {}, set()
    for name in sorted(reports):
        refused.add(name)
        by = reports[name]
        d = _replicas([json.loads(k) for k in by])
        if d is None:
            shown = "; ".join(f"ranks {rs}: {_desc_text(json.loads(k))}" for k, rs in sorted(by.items(), key=lambda x: x[1]))
            problems.append(f"{which} tensor {name!r}: ranks describe it differently: {shown}")
            continue
        bad = _desc_problem(d, world)
        if bad:
            problems.append(f"{which} tensor {name!r} ({_desc_text(d)}): {bad}")
            continue
        missing = sorted(set(d["mesh"]) - holders.get(name, set()))
        if missing:
            problems.append(f"{which} tensor {name!r} ({_desc_text(d)}): mesh ranks {missing} pass no local shard of it")
            continue
        out[name] = d
        refused.discard(name)
    return out, refused


def _replicas(descs: list[dict]) -> dict | None:
    """One descriptor of a tensor from every distinct description ranks gave: the same one, or the
    same tensor and placements over several disjoint meshes of one shape (replicas: FSDP2's ``dp``
    sub-meshes of a parameter TP leaves whole, one per ``tp`` coordinate), ``meshes`` listing them and
    ``mesh`` all their ranks; None when they contradict each other."""
    first = descs[0]
    if len(descs) == 1:
        return {**first, "meshes": [first["mesh"]]}
    same = ("shape", "dtype", "mesh_shape", "placements")
    if any(any(d[k] != first[k] for k in same) for d in descs[1:]):
        return None
    meshes = sorted(d["mesh"] for d in descs)
    flat = [r for m in meshes for r in m]
    if len(set(flat)) != len(flat):
        return None         # overlapping meshes that differ: not replicas
    return {**first, "mesh": sorted(flat), "meshes": meshes}


def _desc_text(d: dict) -> str:
    meshes = d.get("meshes", [d["mesh"]])
    where = " + ".join(str(m) for m in meshes)
    return (f"global {tuple(d['shape'])} {d['dtype']}, mesh ranks {where} shape {d['mesh_shape']}, "
            f"placements [{', '.join(_shown(p) for p in d['placements'])}]")


def _desc_problem(d: dict, world: int) -> str | None:
    for i, p in enumerate(d["placements"]):
        if p[0] == "P":
            return (f"placement {_shown(p)} on mesh dim {i} (ranks {d['mesh']}): a Partial DTensor holds unreduced "
                    f"partial values; reduce it first (redistribute to Replicate() or Shard)")
        if p[0] not in ("S", "SS", "R"):
            return f"placement {p[1]} on mesh dim {i} is not supported (Shard, _StridedShard, Replicate only)"
        if p[0] in ("S", "SS") and not -len(d["shape"]) <= p[1] < len(d["shape"]):
            return f"placement {_shown(p)}: dim {p[1]} is out of range for a tensor of {len(d['shape'])} dims"
        if p[0] == "SS" and p[2] < 1:
            return f"placement {_shown(p)}: split_factor must be >= 1"
    if len(d["placements"]) != len(d["mesh_shape"]):
        return f"{len(d['placements'])} placements for a {len(d['mesh_shape'])}-D mesh"
    outside = [r for r in d["mesh"] if not 0 <= r < world]
    if outside:
        return f"mesh ranks {outside} are outside the reshard group of {world} ranks"
    return None


def _cross_check(src: dict, dst: dict, refused: set, allow_cast: bool, problems: list[str]) -> None:
    for name in sorted(set(src) | set(dst)):
        if name in refused:
            continue        # already reported
        if name not in src:
            problems.append(f"tensor {name!r} has a destination ({_desc_text(dst[name])}) but no source on any rank")
        elif name not in dst:
            problems.append(f"tensor {name!r} has a source ({_desc_text(src[name])}) but no destination on any rank")
        elif src[name]["shape"] != dst[name]["shape"]:
            problems.append(f"tensor {name!r}: source global shape {tuple(src[name]['shape'])} (ranks {src[name]['mesh']}) "
                            f"!= destination global shape {tuple(dst[name]['shape'])} (ranks {dst[name]['mesh']})")
        elif src[name]["dtype"] != dst[name]["dtype"] and not allow_cast:
            problems.append(f"tensor {name!r}: source dtype {src[name]['dtype']} (ranks {src[name]['mesh']}) != destination "
                            f"dtype {dst[name]['dtype']} (ranks {dst[name]['mesh']}); pass allow_cast=True to cast")


def layout_of(descs: Mapping[str, dict]) -> Layout:
    """The layout of merged descriptors (every mesh rank's buffer; equal buffers shared)."""
    lay = Layout()
    memo: dict = {}
    for name, d in sorted(descs.items()):
        lay.add_tensor(name, d["shape"], d["dtype"])
        placements = [_placement(p) for p in d["placements"]]
        for mesh in d.get("meshes", [d["mesh"]]):
            for i, r in enumerate(mesh):
                buf = buffer_for(name, name, d["dtype"], d["shape"], d["mesh_shape"], _coord(i, d["mesh_shape"]), placements)
                lay.add_buffer(r, memo.setdefault(buf, buf))
    return lay


# ----------------------------------------------------------------------------- caches and the call

_PLANS: "OrderedDict[str, tuple]" = OrderedDict()      # signature -> (plan, src layout, dst layout)
_BOUND: "OrderedDict[tuple, tuple]" = OrderedDict()    # local key -> (signature, Resharder)
_PLAN_CACHE, _BIND_CACHE = 16, 8
_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every cached plan and binding (bindings keep their tensors alive)."""
    with _LOCK:
        _PLANS.clear()
        _BOUND.clear()


def _remember(cache: OrderedDict, key, value, limit: int) -> None:
    with _LOCK:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > limit:
            cache.popitem(last=False)


def _local_key(local: _Local, group, options: dict) -> tuple:
    parts = [id(group if group is not None else dist.group.WORLD), json.dumps(options, sort_keys=True),
             json.dumps(local.descs, sort_keys=True)]
    for side in ("src", "dst"):
        for name, t in sorted(local.tensors[side].items()):
            parts.append((side, name, t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device)))
    return tuple(parts)


def _options(budget_bytes, allow_cast, verify, timeout, version) -> tuple[dict, list[str]]:
    errors = []
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        errors.append(f"version={version!r}: must be a non-negative integer (or None)")
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 1024:
        errors.append(f"budget_bytes={budget_bytes!r}: must be an integer number of bytes >= 1024")
    if not isinstance(allow_cast, bool) or not isinstance(verify, bool):
        errors.append(f"allow_cast={allow_cast!r}, verify={verify!r}: must be True or False")
    try:
        check_timeout(timeout)
    except ValueError as e:
        errors.append(str(e))
    return {"budget_bytes": budget_bytes if isinstance(budget_bytes, int) else None,
            "allow_cast": bool(allow_cast), "verify": bool(verify)}, errors


def _run(local: _Local, group, *, budget_bytes: int = DEFAULT_BUDGET, allow_cast: bool = False,
         verify: bool = False, timeout: float | None = None, version: int | None = None) -> ReshardResult:
    rank = dist.get_rank(group)
    options, bad = _options(budget_bytes, allow_cast, verify, timeout, version)
    local.errors += [f"rank {rank}: {e}" for e in bad]
    timeout = timeout if not bad else None
    key = None if local.errors else _local_key(local, group, options)
    hit = _BOUND.get(key) if key is not None else None
    # 1. does every rank reuse the same binding?  (one fixed-size control message per rank)
    if _reused_everywhere(group, rank, hit, not local.errors, timeout):
        return _refit(key, hit[1], version, reused=True)
    # 2. the full exchange: every rank's descriptors and errors
    parts = all_gather_json({"descs": local.descs, "errors": local.errors, "options": options}, group, timeout=timeout)
    problems = [e for p in parts for e in p["errors"]]
    world = dist.get_world_size(group)
    opts = {json.dumps(p["options"], sort_keys=True) for p in parts}
    if len(opts) > 1:
        problems.append("options differ between ranks: " + "; ".join(sorted(opts)))
    src, src_refused = _merge_side(parts, "src", world, problems)
    dst, dst_refused = _merge_side(parts, "dst", world, problems)
    _cross_check(src, dst, src_refused | dst_refused, allow_cast, problems)
    if problems:
        raise ReshardError("reshard refused before any transfer: " + " | ".join(problems))
    sig = hashlib.sha256(json.dumps([src, dst, options], sort_keys=True).encode()).hexdigest()
    with all_or_none(group, timeout=timeout):
        cached = _PLANS.get(sig)
        if cached is None:
            src_l, dst_l = layout_of(src), layout_of(dst)
            cached = (make_plan(src_l, dst_l, budget_bytes=budget_bytes, allow_cast=allow_cast), src_l, dst_l)
        _remember(_PLANS, sig, cached, _PLAN_CACHE)
    plan, src_l, dst_l = cached
    resharder = Resharder(plan, local.tensors["src"], local.tensors["dst"], group, timeout=timeout, verify=verify,
                          layouts=(src_l, dst_l))
    return _refit(key, resharder, version, reused=False, sig=sig)


def _reused_everywhere(group, rank: int, hit, ok: bool, timeout) -> bool:
    """Collective: whether every rank found the same cached binding (signature + binding id)."""
    t0 = time.monotonic()
    ticket = checkin(group)
    try:
        msgs = exchange(group, Step.REUSE_CHECK, digest=hit[0] if hit else "", token=hit[1].binding_id if hit else 0, ok=ok,
                        timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a peer that died, skipped the call or never joined
        gone = missing_ranks(ticket)
        who = f"ranks {gone} did not answer" if gone else "(which ranks did not answer is unknown)"
        raise ReshardError(f"reshard failed on rank {rank} after {time.monotonic() - t0:.1f} s: {who} (a peer died, "
                           f"skipped the call or the process group is broken): {type(e).__name__}: {str(e)[:300]}") from e
    return hit is not None and all(m["kind"] == Step.REUSE_CHECK and m["ok"] and m["digest"] == hit[0]
                                   and m["token"] == hit[1].binding_id for m in msgs)


def _refit(key, resharder: Resharder, version, *, reused: bool, sig: str | None = None) -> ReshardResult:
    try:
        counts = resharder.refit(version)
    except Exception:
        with _LOCK:
            _BOUND.pop(key, None)        # an interrupted binding is never reused
        raise
    if not reused and key is not None:
        _remember(_BOUND, key, (sig, resharder), _BIND_CACHE)
    return ReshardResult(resharder.plan, counts, reused)


def reshard(src, dst, group=None, *, name: str | None = None, budget_bytes: int = DEFAULT_BUDGET,
            allow_cast: bool = False, verify: bool = False, timeout: float | None = None,
            version: int | None = None) -> ReshardResult | None:
    """Collective over ``group`` (default: the default group; it must hold every rank of both meshes):
    copy this rank's source DTensors into its destination DTensors' local shards, in place.

    ``src`` / ``dst``: a DTensor or :class:`ShardSpec` each, or dicts name -> DTensor / ShardSpec (a
    whole model); None or ``{}`` on a rank outside that side's mesh.  Every rank of a mesh must pass
    its tensor.  Placements: ``Shard``, ``_StridedShard``, ``Replicate`` over meshes of any dimension,
    uneven shards included; ``Partial`` is refused.  Source and destination meshes may be disjoint,
    overlap or be the same.  ``allow_cast``: destination dtypes may differ (cast on receive);
    ``timeout`` (seconds) bounds every exchange and round; ``verify``: checksums (debug);
    ``budget_bytes``: the per-rank staging limit per round.  Returns a :class:`ReshardResult`.

    Inside ``with reshard_group(...)``: the call is recorded (``name``: its tensor name for a single
    tensor, default the call's position) and runs with the others when the block ends; returns None.
    """
    pending = getattr(_ACTIVE, "group", None)
    if pending is not None:
        if group is not None and group is not pending.group:
            pending._errors.append(f"rank {dist.get_rank(pending.group)}: reshard(group=...) inside a reshard_group "
                                   "over another group")
        pending.add(src, dst, name=name)
        return None
    rank = dist.get_rank(group)
    local = _Local()
    for side, value in (("src", src), ("dst", dst)):
        try:
            entries = _as_map(value, side)
            if name is not None and not isinstance(value, Mapping):
                entries = {name: value} if entries else {}
        except TypeError as e:
            local.errors.append(f"rank {rank}: {e}")
            continue
        _collect(local, side, entries, group, rank)
    return _run(local, group, budget_bytes=budget_bytes, allow_cast=allow_cast, verify=verify, timeout=timeout,
                version=version)


_ACTIVE = threading.local()


class reshard_group:  # noqa: N801 - used as a context manager, like m2n.group()
    """Collect :func:`reshard` calls (or :meth:`add`) and run them as ONE reshard on exit: one plan,
    one handshake, one refit, the same bytes as one call with dicts::

        with reshard_group() as g:                 # on every rank, the same calls in the same order
            for name in names:
                reshard(src[name], dst[name], name=name)     # or g.add(src[name], dst[name], name=name)
        g.result.plan.stats["network_bytes"]

    Options are those of :func:`reshard` (given here, for the whole group).  An exception inside the
    block on any rank makes every rank raise :class:`ReshardError` on exit (no rank is left waiting).
    """

    def __init__(self, group=None, **options):
        unknown = sorted(set(options) - {"budget_bytes", "allow_cast", "verify", "timeout", "version"})
        if unknown:
            raise TypeError(f"reshard_group: unknown options {unknown} (budget_bytes, allow_cast, verify, timeout, version)")
        self.group = group
        self.options = options
        self.result: ReshardResult | None = None
        self._src: dict = {}
        self._dst: dict = {}
        self._count = 0
        self._errors: list[str] = []

    def add(self, src, dst, *, name: str | None = None) -> None:
        """Record one call: single tensors (named ``name`` or by call position) or dicts."""
        rank = dist.get_rank(self.group)
        label = name if name is not None else f"tensor{self._count}"
        self._count += 1
        for side, value, into in (("src", src, self._src), ("dst", dst, self._dst)):
            try:
                entries = _as_map(value, side)
            except TypeError as e:
                self._errors.append(f"rank {rank}: call {self._count - 1}: {e}")
                continue
            if not isinstance(value, Mapping):
                entries = {label: value} if entries else {}
            for n, v in entries.items():
                if n in into:
                    self._errors.append(f"rank {rank}: {side} tensor {n!r} is added twice to one reshard_group")
                into[n] = v

    def __enter__(self) -> "reshard_group":
        if getattr(_ACTIVE, "group", None) is not None:
            raise ReshardError("reshard_group blocks do not nest")
        _ACTIVE.group = self
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        _ACTIVE.group = None
        if exc is not None and not isinstance(exc, Exception):
            return False
        rank = dist.get_rank(self.group)
        local = _Local(errors=list(self._errors))
        if exc is not None:
            local.errors.append(f"rank {rank}: the reshard_group block raised {type(exc).__name__}: {exc}")
        _collect(local, "src", self._src, self.group, rank)
        _collect(local, "dst", self._dst, self.group, rank)
        self.result = _run(local, self.group, **self.options)
        return False


__all__ = ["MeshSpec", "ReshardResult", "ShardSpec", "clear_cache", "layout_of", "reshard", "reshard_group"]
