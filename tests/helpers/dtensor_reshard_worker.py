"""Workers of tests/integrations/test_dtensor_reshard.py: :func:`mcore_reshard.reshard` on real DTensors over gloo,
checked against torch itself (its own ``_split_tensor`` per mesh dim, ``full_tensor``, ``redistribute``).

A case (JSON, drawn by hypothesis in the parent)::

    {"shape": [5, 3], "dtype": "bfloat16", "seed": 7, "spec": False,
     "src": {"mesh": [[2], [0, 1]], "placements": [["S", 0]]},           # mesh: [shape, row-major ranks]
     "dst": {"mesh": [[2, 2], [3, 2, 1, 0]], "placements": [["R"], ["SS", 1, 2]]}}
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import mcore_reshard
from mcore_reshard import MeshSpec, ShardSpec
from mcore_reshard.core.executor import ReshardError

DTYPES = {n: getattr(torch, n) for n in ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2",
                                           "int64", "int32", "int16", "int8", "uint8", "bool")}
_MESHES: dict = {}


def placement(obj):
    kind = obj[0]
    if kind == "S":
        return Shard(obj[1])
    if kind == "SS":
        return _StridedShard(obj[1], split_factor=obj[2])
    if kind == "P":
        return Partial()
    return Replicate()


def device_mesh(shape, ranks):
    """A DeviceMesh of ``ranks`` (row-major over ``shape``), made once per launch on every rank
    (DeviceMesh creation is collective over the world)."""
    from torch.distributed.device_mesh import DeviceMesh
    key = (tuple(shape), tuple(ranks))
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.tensor(ranks).reshape(shape))
    return _MESHES[key]


def full_tensor(shape, dtype: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == "bool":
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype in ("int64", "int32", "int16", "int8", "uint8"):
        return torch.randint(0, 100, shape, generator=g).to(DTYPES[dtype])
    return torch.randn(shape, generator=g).to(DTYPES[dtype])


def torch_local(full, mesh_shape, coord, placements) -> torch.Tensor:
    """What DTensor keeps on ``coord``: torch's own ``_split_tensor``, mesh dim by mesh dim."""
    t = full
    for size, c, p in zip(mesh_shape, coord, placements):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, size, with_padding=False)
        t = shards[c]
    return t.contiguous()


def coord_of(rank, shape, ranks):
    idx = ranks.index(rank)
    out = []
    for s in reversed(shape):
        idx, c = divmod(idx, s)
        out.append(c)
    return tuple(reversed(out))


def side(case, which, full, rank, fill=None):
    """(this rank's argument for ``which`` side, local tensor or None, DeviceMesh, placements)."""
    shape, ranks = case[which]["mesh"]
    placements = [placement(p) for p in case[which]["placements"]]
    dm = device_mesh(shape, ranks)
    if rank not in ranks:
        arg = ShardSpec(None, MeshSpec(shape, ranks), placements, full.shape, full.dtype if case["seed"] % 2 else None) if case.get("spec") else None
        return arg, None, dm, placements
    local = torch_local(full, shape, coord_of(rank, shape, ranks), placements)
    if fill is not None:
        local = torch.full_like(local, fill) if local.dtype != torch.bool else ~local
    if case.get("spec"):
        return ShardSpec(local, MeshSpec(shape, ranks), placements, full.shape), local, dm, placements
    dt = DTensor.from_local(local, dm, placements, run_check=False, shape=full.shape, stride=full.stride())
    return dt, local, dm, placements


def needed_bytes(case, full, rank) -> int:
    """Bytes this rank must receive: elements of its destination shard its source shard lacks (torch only)."""
    idx = torch.arange(full.numel()).reshape(full.shape)
    want = have = torch.empty(0, dtype=torch.int64)
    for which in ("dst", "src"):
        shape, ranks = case[which]["mesh"]
        if rank in ranks:
            got = torch_local(idx, shape, coord_of(rank, shape, ranks), [placement(p) for p in case[which]["placements"]])
            if which == "dst":
                want = got.flatten().unique()
            else:
                have = got.flatten().unique()
    return int((~torch.isin(want, have)).sum()) * full.element_size()


def run_cases(rank: int, world: int, cases: list) -> list:
    """Every case: reshard, then this rank's destination shard vs torch's split of the full tensor,
    ``full_tensor()`` and (same mesh) ``redistribute``; twice, the second call reusing the binding."""
    out = []
    for case in cases:
        full = full_tensor(case["shape"], case["dtype"], case["seed"])
        src, _, sdm, splace = side(case, "src", full, rank)
        dst, dlocal, ddm, dplace = side(case, "dst", full, rank, fill=7)
        res = mcore_reshard.reshard(src, dst, timeout=60)
        again = mcore_reshard.reshard(src, dst, timeout=60)
        row = {"network": res.plan.stats["network_bytes"], "lower_bound": res.plan.stats["lower_bound_bytes"],
               "needed": needed_bytes(case, full, rank), "reused": [res.reused, again.reused], "ok": True}
        if dlocal is not None:
            shape, ranks = case["dst"]["mesh"]
            expect = torch_local(full, shape, coord_of(rank, shape, ranks), dplace)
            row["ok"] = torch.equal(dlocal, expect)
        strided = any(p[0] == "SS" for p in case["src"]["placements"] + case["dst"]["placements"])
        # torch's own collectives (full_tensor, redistribute) gather in process-group order, which
        # is the mesh's order only when its ranks ascend: compared there (the local check covers all)
        ascending = all(case[w]["mesh"][1] == sorted(case[w]["mesh"][1]) for w in ("src", "dst"))
        strided = strided or not ascending
        strided = strided or case["dtype"].startswith("float8")     # gloo has no float8 collectives
        if dlocal is not None and not case.get("spec") and not strided:
            row["full_ok"] = torch.equal(dst.full_tensor(), full)
        if case["src"]["mesh"] == case["dst"]["mesh"] and dlocal is not None and not strided and not case.get("spec"):
            row["redistribute_ok"] = torch.equal(src.redistribute(sdm, dplace).to_local(), dlocal)
        out.append(row)
    return out


def grouped(rank: int, world: int, cases: list) -> dict:
    """The same cases as one ``reshard_group``: one plan and one refit; bytes equal the dict call's."""
    fulls = [full_tensor(c["shape"], c["dtype"], c["seed"]) for c in cases]
    sides = [(side(c, "src", f, rank), side(c, "dst", f, rank, fill=7)) for c, f in zip(cases, fulls)]
    with mcore_reshard.reshard_group(timeout=60) as g:
        for (s, _, _, _), (d, _, _, _) in sides:
            mcore_reshard.reshard(s, d)
    ok = all(d[1] is None or torch.equal(d[1], torch_local(f, c["dst"]["mesh"][0], coord_of(rank, *c["dst"]["mesh"]),
                                                            d[3]))
             for c, f, (_, d) in zip(cases, fulls, sides))
    for _, (_, dl, _, _) in sides:
        if dl is not None:
            dl.fill_(0) if dl.dtype != torch.bool else dl.logical_not_()
    whole = mcore_reshard.reshard({f"tensor{i}": s[0] for i, (s, _) in enumerate(sides) if s[0] is not None},
                                  {f"tensor{i}": d[0] for i, (_, d) in enumerate(sides) if d[0] is not None}, timeout=60)
    ok2 = all(d[1] is None or torch.equal(d[1], torch_local(f, c["dst"]["mesh"][0], coord_of(rank, *c["dst"]["mesh"]),
                                                             d[3]))
              for c, f, (_, d) in zip(cases, fulls, sides))
    return {"ok": ok, "ok_whole": ok2, "hash": g.result.plan.hash, "whole_hash": whole.plan.hash,
            "network": g.result.plan.stats["network_bytes"], "whole_network": whole.plan.stats["network_bytes"],
            "rounds": g.result.plan.stats["rounds"], "tensors": len(g.result.plan.tensors)}


# ----------------------------------------------------------------------------- refusals

def _attempt(fn, dst_local):
    before = None if dst_local is None else dst_local.clone()
    try:
        fn()
        return {"error": None}
    except ReshardError as e:
        untouched = before is None or torch.equal(before, dst_local)
        return {"error": "ReshardError", "text": str(e), "untouched": untouched}
    except Exception as e:  # noqa: BLE001 - reported to the parent: any other type is a defect
        return {"error": type(e).__name__, "text": str(e)}


def refusals(rank: int, world: int) -> list:
    """Bad inputs: every rank must raise ReshardError before a byte moves (destination untouched)."""
    full = full_tensor([8, 6], "float32", 1)
    base = {"shape": [8, 6], "dtype": "float32", "seed": 1,
            "src": {"mesh": [[2], [0, 1]], "placements": [["S", 0]]},
            "dst": {"mesh": [[2], [2, 3]], "placements": [["S", 1]]}}
    src, _, _, _ = side(base, "src", full, rank)
    dst, dlocal, ddm, _ = side(base, "dst", full, rank, fill=7)
    out = []
    # 1. destination global shape differs (every destination rank sees [8, 5])
    other = full_tensor([8, 5], "float32", 1)
    bad_dst, bl, _, _ = side({**base, "shape": [8, 5]}, "dst", other, rank, fill=7)
    out.append(_attempt(lambda: mcore_reshard.reshard(src, bad_dst, timeout=30), bl))
    # 2. destination dtype differs (no allow_cast)
    half = full.to(torch.bfloat16)
    bad_dst, bl, _, _ = side({**base, "dtype": "bfloat16"}, "dst", half, rank, fill=7)
    out.append(_attempt(lambda: mcore_reshard.reshard(src, bad_dst, timeout=30), bl))
    # 3. a Partial source
    psrc = None
    if rank in (0, 1):
        psrc = DTensor.from_local(full.clone(), device_mesh([2], [0, 1]), [Partial()], run_check=False)
    out.append(_attempt(lambda: mcore_reshard.reshard(psrc, dst, timeout=30), dlocal))
    # 4. only rank 3 is wrong: its destination DTensor claims another global shape
    mine = dst
    if rank == 3:
        mine = DTensor.from_local(dlocal, ddm, [Shard(1)], run_check=False, shape=torch.Size([8, 7]), stride=(7, 1))
    out.append(_attempt(lambda: mcore_reshard.reshard(src, mine, timeout=30), dlocal))
    # 5. only rank 2 is wrong: a local shard of the wrong shape (ShardSpec)
    spec = dst
    if rank == 2:
        spec = ShardSpec(torch.zeros(8, 2), MeshSpec([2], [2, 3]), [Shard(1)], [8, 6])
    out.append(_attempt(lambda: mcore_reshard.reshard(src, spec, timeout=30), dlocal))
    # 6. only rank 1 passes a plain tensor
    plain = src if rank != 1 else torch.zeros(4, 6)
    out.append(_attempt(lambda: mcore_reshard.reshard(plain, dst, timeout=30), dlocal))
    # 7. an exception inside one rank's reshard_group block
    def block():
        with mcore_reshard.reshard_group(timeout=30):
            mcore_reshard.reshard(src, dst)
            if rank == 0:
                raise KeyError("boom")
    out.append(_attempt(block, dlocal))
    # 8. only rank 1 passes a bad option
    out.append(_attempt(lambda: mcore_reshard.reshard(src, dst, timeout=30, version=-1 if rank == 1 else None), dlocal))
    # 9. a destination mesh rank passes nothing
    out.append(_attempt(lambda: mcore_reshard.reshard(src, None if rank == 3 else dst, timeout=30), dlocal))
    # 10. the destination read from a module once (tracked), the module's parameter object replaced since:
    #     refused on every rank naming it (the mapping holds a tensor the model no longer computes with)
    from mcore_reshard.util.identity import tracked
    holder = torch.nn.Module()
    if dst is not None:
        holder.w = torch.nn.Parameter(dst, requires_grad=False)
    mapping = tracked({"": holder}, {"w": holder.w} if dst is not None else {}, rank=rank)
    out.append(_attempt(lambda: mcore_reshard.reshard({"w": src} if src is not None else {}, mapping, timeout=30), dlocal))
    if rank == 3:
        holder.w = torch.nn.Parameter(DTensor.from_local(dlocal.clone(), ddm, [Shard(1)], run_check=False),
                                      requires_grad=False)
    out.append(_attempt(lambda: mcore_reshard.reshard({"w": src} if src is not None else {}, mapping, timeout=30), dlocal))
    # after all refusals the same call works
    res = mcore_reshard.reshard(src, dst, timeout=30)
    works = dlocal is None or torch.equal(dlocal, torch_local(full, [2], coord_of(rank, [2], [2, 3]), [Shard(1)]))
    out.append({"works": works, "network": res.plan.stats["network_bytes"]})
    # 11. rank 3 skips the call: the others raise within the timeout (last: the group is broken after it)
    t0 = time.monotonic()
    if rank == 3:
        time.sleep(12)
        out.append({"skipped": True})
    else:
        got = _attempt(lambda: mcore_reshard.reshard(src, dst, timeout=4), dlocal)
        got["seconds"] = time.monotonic() - t0
        out.append(got)
    return out


def subgroup(rank: int, world: int) -> dict:
    """``group=`` a subgroup of global ranks 1-3: DeviceMesh ranks (global) are translated to group
    ranks, MeshSpec ranks are group ranks; rank 0 takes no part."""
    sub = dist.new_group([1, 2, 3])
    full = full_tensor([6, 4], "float32", 5)
    src_dm, dst_dm = device_mesh([2], [1, 2]), device_mesh([1], [3])     # every rank creates every mesh
    if rank == 0:
        return {"skipped": True}
    src = DTensor.from_local(torch_local(full, [2], coord_of(rank, [2], [1, 2]), [Shard(0)]), src_dm, [Shard(0)],
                             run_check=False, shape=full.shape, stride=full.stride()) if rank in (1, 2) else None
    out = torch.zeros(6, 4)
    dst = DTensor.from_local(out, dst_dm, [Replicate()], run_check=False) if rank == 3 else None
    res = mcore_reshard.reshard(src, dst, group=sub, timeout=60)
    ok = rank != 3 or torch.equal(out, full)
    # the same with rank lists in group ranks (global 3 is group rank 2)
    out.zero_()
    spec = ShardSpec(out, MeshSpec([1], [2]), [Replicate()], [6, 4]) if rank == 3 else None
    res2 = mcore_reshard.reshard(src, spec, group=sub, timeout=60)
    ok2 = rank != 3 or torch.equal(out, full)
    return {"ok": ok, "ok_spec": ok2, "plan_ranks": res.plan.ranks, "network": res2.plan.stats["network_bytes"]}
