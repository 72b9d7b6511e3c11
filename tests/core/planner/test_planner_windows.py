"""Windowed plans (a streamed refit's): the destination cut into windows of whole modules, one plan
each; applied together they write every destination element exactly once, in the lower bound of
bytes, each window within its budget, the same windows and hash on every rank."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest
import torch
from sim import apply_plan, brute_lower_bound, random_full

from mcore_reshard.core.planner import PlanError, make_plan, make_windowed_plan, partition
from mcore_reshard.core.planner.windows import WindowedPlan, module_of, natural_key
from mcore_reshard.tools.demo import build_layouts
from mcore_reshard.tools.synthetic import materialize


def vllm_pair(tp: int = 2):
    """A DeepSeek-V3-style HF source on rank 0 and vLLM at ``tp`` on ranks 1.. (loader format)."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "engines"))
    import engine_models

    from mcore_reshard.integrations.protocol import build_layout, layout_spec
    from mcore_reshard.targets import from_hf_config, hf_layout
    mc = from_hf_config(engine_models.dsv3(layers=4, vocab=128, n_group=4, mtp=0))
    return hf_layout(mc, rank=0, dtype="float32"), build_layout(layout_spec("vllm", mc, tp=tp, rank_offset=1,
                                                                            dtype="bfloat16"))


@pytest.mark.parametrize("window", [1024, 16 << 10, 64 << 10, 1 << 30])
def test_windows_write_everything_once_in_the_lower_bound(window):
    src, dst = vllm_pair()
    wp = make_windowed_plan(src, dst, window_bytes=window, budget_bytes=8192, allow_cast=True, ignore_unused=True)
    one = make_plan(src, dst, budget_bytes=8192, allow_cast=True, ignore_unused=True)
    assert wp.stats["network_bytes"] == wp.stats["lower_bound_bytes"] == one.stats["network_bytes"]
    # every buffer in exactly one window, every module whole in one window, windows in module order
    seen = defaultdict(int)
    where = {}
    for i, w in enumerate(wp.windows):
        for r, names in w.buffers.items():
            for n in names:
                seen[(r, n)] += 1
                assert where.setdefault(module_of(n), i) == i, n
        over = [r for r, b in w.nbytes.items() if b > window]
        assert not over or len(w.modules) == 1, (i, w.modules, w.nbytes)   # alone when over budget
    assert set(seen) == {(r, n) for r in dst.ranks for n in dst.buffers[r]} and set(seen.values()) == {1}
    order = [natural_key(m) for w in wp.windows for m in w.modules]
    assert order == sorted(order)
    for p in wp.plans:
        assert p.stats["max_stage_bytes"] <= 8192
    if window == 1 << 30:
        assert len(wp.windows) == 1


def test_windows_applied_equal_the_reference():
    src, dst = build_layouts("tp=2,pp=2", "tp=4", False)
    wp = make_windowed_plan(src, dst, window_bytes=2048, budget_bytes=1024)
    assert len(wp.windows) > 3
    full = random_full(src)
    S = {r: materialize(src, r, full) for r in src.ranks}
    D = {r: materialize(dst, r, full, fill=float("nan")) for r in dst.ranks}
    for p in wp.plans:
        apply_plan(p, {r: {n: t for n, t in S[r].items() if n in p.buffers["src"].get(r, {})} for r in S},
                   {r: {n: t for n, t in D[r].items() if n in p.buffers["dst"].get(r, {})} for r in D})
    for r in dst.ranks:
        expect = materialize(dst, r, full)
        for n, t in expect.items():
            assert torch.equal(D[r][n], t), (r, n)
    assert wp.stats["network_bytes"] == brute_lower_bound(src, dst)


def test_deterministic_hashed_and_plain_data():
    src, dst = vllm_pair()
    a = make_windowed_plan(src, dst, window_bytes=32 << 10, budget_bytes=8192, allow_cast=True, ignore_unused=True)
    b = make_windowed_plan(src, dst, window_bytes=32 << 10, budget_bytes=8192, allow_cast=True, ignore_unused=True)
    c = make_windowed_plan(src, dst, window_bytes=48 << 10, budget_bytes=8192, allow_cast=True, ignore_unused=True)
    assert a.hash == b.hash != c.hash
    back = WindowedPlan.from_json(json.loads(a.dumps()))
    assert back.hash == a.hash and len(back.windows) == len(a.windows)
    assert partition(dst, 32 << 10) == a.windows
    assert "windows" in a.summary()


@pytest.mark.parametrize("bad", [0, 1023, 2.5, True, "64k", None])
def test_window_bytes_refused(bad):
    src, dst = vllm_pair()
    with pytest.raises(PlanError, match="window_bytes"):
        make_windowed_plan(src, dst, window_bytes=bad, allow_cast=True, ignore_unused=True)


def test_whole_layout_checks_run_once():
    """A source without a destination tensor is refused as by one plan (not hidden by the windows)."""
    from mcore_reshard.core.box import Box
    from mcore_reshard.core.layout import Buffer, Piece
    src, dst = vllm_pair()
    src.add_tensor("extra.weight", (4,), "float32")
    src.add_buffer(0, Buffer("extra.weight", (4,), "float32", (Piece("extra.weight", Box.full((4,)), Box.full((4,))),)))
    with pytest.raises(PlanError, match="no destination: extra.weight"):
        make_windowed_plan(src, dst, window_bytes=8192, allow_cast=True)       # ignore_unused=False
    del src.tensors["extra.weight"], src.buffers[0]["extra.weight"]
    del src.tensors["lm_head.weight"]
    src.buffers[0] = {n: b for n, b in src.buffers[0].items() if n != "lm_head.weight"}
    with pytest.raises(PlanError, match="have no source: lm_head.weight"):
        make_windowed_plan(src, dst, window_bytes=8192, allow_cast=True, ignore_unused=True)
