"""Reliability, part 4a: many random (source layout, destination layout) pairs in one run, each
planned, checked with ``validate_plan``, round-tripped through JSON, applied by the independent
simulator (``sim.apply_plan``) and compared element for element with the reference (every
destination buffer cut directly from the full tensors).  0 mismatches allowed.

A seeded generator (not hypothesis) so that the run has a fixed number of cases, each its own test
ID (``random-007``, ``synthetic-231``; the cases are drawn from one stream, once per session): random
shapes (1-3 dims, sizes 1-9), meshes of 1-4 ranks (1-D or 2x2), random placements over random
dims with ``even``/``chunk`` splits, fused ``[a; b]`` buffers, a second partially overlapping
source copy, colocated / disaggregated / overlapping rank sets, mixed dtypes (with and without a
cast), staging budgets from 1 KiB; and the synthetic Megatron-shaped model between random valid
parallel configs (TP/PP/EP/ETP/DP, vocab padding, fused QKV and gate/up, stacked experts).
"""
from __future__ import annotations

import functools
import json
import random

import pytest
import torch
from sim import apply_plan, brute_lower_bound

from mcore_reshard.core.executor import torch_dtype
from mcore_reshard.core.layout import Buffer, Layout, shard_box, stacked
from mcore_reshard.core.mesh import Mesh
from mcore_reshard.core.planner import Plan, make_plan, validate_plan
from mcore_reshard.tools.synthetic import SyntheticModel, materialize, parse_parallel, synthetic_layout, world_size_of

N_RANDOM = 220
N_SYNTHETIC = 40
DTYPES = ["float32", "bfloat16", "float16", "int32"]


def _mesh(rng: random.Random, offset: int) -> Mesh:
    world = rng.randint(1, 4)
    if world == 4 and rng.random() < 0.5:
        return Mesh.of({"a": 2, "b": 2}, offset)
    return Mesh.of({"a": world}, offset)


def _side(rng, specs, fused, offset, tag, dtypes) -> Layout:
    mesh = _mesh(rng, offset)
    lay = Layout()
    for name, shape in specs:
        axes = list(mesh.axis_names)
        rng.shuffle(axes)
        placements = [(a, rng.randrange(len(shape))) for a in axes[:rng.randint(0, len(axes))]]
        lay.add_sharded(name, shape, dtypes[name], mesh, placements, buffer=f"{name}@{tag}", mode=rng.choice(["even", "chunk"]))
    if fused:
        a_rows, b_rows, cols = fused
        lay.add_tensor("f0", (a_rows, cols), dtypes["f0"])
        lay.add_tensor("f1", (b_rows, cols), dtypes["f0"])
        axis, mode = mesh.axis_names[0], rng.choice(["even", "chunk"])
        for r in mesh.ranks:
            parts = [(n, shard_box(s, mesh, r, [(axis, 0)], mode)) for n, s in (("f0", (a_rows, cols)), ("f1", (b_rows, cols)))]
            parts = [(n, b) for n, b in parts if b.numel]
            lay.add_buffer(r, stacked(f"fused@{tag}", dtypes["f0"], parts) if parts
                           else Buffer(f"fused@{tag}", (0, cols), dtypes["f0"], ()))
    return lay


def random_case(rng: random.Random):
    specs = [(f"t{i}", tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))) for i in range(rng.randint(1, 3))]
    fused = (rng.randint(1, 7), rng.randint(1, 7), rng.randint(1, 4)) if rng.random() < 0.5 else None
    src_dt = {n: rng.choice(DTYPES) for n in [s[0] for s in specs] + ["f0"]}
    cast = rng.random() < 0.25
    dst_dt = {n: (rng.choice(DTYPES[:3]) if cast and src_dt[n] != "int32" else src_dt[n]) for n in src_dt}
    src = _side(rng, specs, fused, 0, "s", src_dt)
    where = rng.choice(["colocated", "disaggregated", "overlap"])
    offset = {"colocated": 0, "disaggregated": max(src.ranks) + 1, "overlap": (max(src.ranks) + 1) // 2}[where]
    dst = _side(rng, specs, fused, offset, "d", dst_dt)
    if rng.random() < 0.5:   # a second source copy with another split: partially overlapping boxes
        extra = _side(rng, specs, None, max(src.ranks) + 1, "s2", src_dt)
        for r, bufs in extra.buffers.items():
            for b in bufs.values():
                src.add_buffer(r, b)
    return src, dst, rng.choice([1024, 4096, 1 << 20]), cast


SPECS = ["tp=1", "tp=2", "tp=4", "tp=2,pp=2", "tp=1,pp=2,dp=2", "tp=2,ep=2,dp=2", "tp=1,ep=4,etp=1,dp=4",
         "tp=2,ep=2,etp=1,pp=2", "tp=4,dp=2", "tp=2,dp=2,ep=4,etp=1", "tp=2,ep=2,etp=2,dp=2", "tp=1,dp=2"]


def synthetic_case(rng: random.Random):
    a, b = parse_parallel(rng.choice(SPECS)), parse_parallel(rng.choice(SPECS))
    model = SyntheticModel(odd_rows=3 * max(world_size_of(a), world_size_of(b)) + rng.randint(1, 5))
    colocated = rng.random() < 0.5
    dtype = rng.choice(["float32", "bfloat16"])
    src = synthetic_layout(a, model, dtype)
    dst = synthetic_layout(b, model, dtype, rank_offset=0 if colocated else world_size_of(a))
    return src, dst, rng.choice([2048, 16384, 1 << 20]), False


def _full(layout: Layout, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, m in sorted(layout.tensors.items()):
        t = torch.randn(m.shape, generator=g) * 100
        out[n] = t.round() if m.dtype.startswith("int") else t
    return out


def run_case(src: Layout, dst: Layout, budget: int, cast: bool, seed: int) -> list[str]:
    """Problems found (empty: the plan is exact, minimal, valid and JSON-stable)."""
    plan = make_plan(src, dst, budget_bytes=budget, allow_cast=cast)
    problems = list(validate_plan(plan))
    text = plan.dumps()
    again = Plan.from_json(json.loads(text))
    if again != plan or again.dumps() != text or again.hash != plan.hash:
        problems.append("plan JSON round trip is not exact")
    full = _full(src, seed)
    S = {r: materialize(src, r, full) for r in src.ranks}
    nan = float("nan")
    D = {r: {n: t.fill_(nan) if t.is_floating_point() else t.fill_(-7)
             for n, t in materialize(dst, r, full).items()} for r in dst.ranks}
    # the simulator copies source bytes as they are; a planned cast happens on the receiver
    apply_plan(again, {r: {n: t for n, t in bufs.items()} for r, bufs in S.items()}, _CastingDst(D))
    for r in dst.ranks:
        want = materialize(dst, r, {n: t.to(torch_dtype(src.tensors[n].dtype)) for n, t in full.items()})
        for n, t in want.items():
            if not torch.equal(D[r][n], t):
                problems.append(f"rank {r} buffer {n} differs from the reference")
    lb = brute_lower_bound(src, dst)
    if not plan.stats["network_bytes"] == lb == plan.stats["lower_bound_bytes"]:
        problems.append(f"network bytes {plan.stats['network_bytes']} != lower bound {lb}")
    if plan.stats["max_stage_bytes"] > budget:
        problems.append("staging budget exceeded")
    return problems


class _CastingDst(dict):
    """Destination tensors for ``apply_plan`` whose assignments cast like the executor's copy_."""

    def __init__(self, D):
        super().__init__({r: _CastingBufs(b) for r, b in D.items()})


class _CastingBufs(dict):
    def __getitem__(self, name):
        return _Casting(dict.__getitem__(self, name))


class _Casting:
    def __init__(self, t):
        self.t = t

    def __setitem__(self, idx, value):
        self.t[idx].copy_(value if isinstance(value, torch.Tensor) else torch.tensor(value))


@functools.cache
def _cases() -> list:
    """The (src, dst, budget, cast) of every case, drawn in order from one seeded stream."""
    rng = random.Random(20240611)
    return [random_case(rng) if i < N_RANDOM else synthetic_case(rng) for i in range(N_RANDOM + N_SYNTHETIC)]


@pytest.mark.parametrize("i", range(N_RANDOM + N_SYNTHETIC),
                         ids=[f"random-{i:03d}" if i < N_RANDOM else f"synthetic-{i:03d}" for i in range(N_RANDOM + N_SYNTHETIC)])
def test_random_layout_pair_zero_mismatches(i):
    src, dst, budget, cast = _cases()[i]
    problems = run_case(src, dst, budget, cast, seed=i)
    assert not problems, problems[:3]
