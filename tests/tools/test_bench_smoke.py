"""Smoke of the benchmarks (``mcore-reshard bench``): not timed, only that every part runs and that its
numbers obey the invariants the benchmark reports (bytes = lower bound, bit-exact, cost model
floors below predictions), plus hand-checked cost-model and baseline arithmetic."""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

import pytest
from repo_paths import ROOT

from mcore_reshard.core.box import Box
from mcore_reshard.core.layout import Buffer, Layout, Piece
from mcore_reshard.core.planner import make_plan
from mcore_reshard.tools import bench, costmodel


def _whole(lay: Layout, rank: int, name: str, shape, dtype="float32", box: Box | None = None):
    box = box or Box.full(shape)
    lay.add_tensor(name, shape, dtype)
    lay.add_buffer(rank, Buffer(name, box.sizes, dtype, (Piece(name, box, Box.full(box.sizes)),)))


def _one_tensor(src_ranks, dst_ranks, rows=1024, cols=256):
    """A [rows, cols] fp32 tensor split by rows over ``src_ranks``, whole on every ``dst_ranks``."""
    src, dst = Layout(), Layout()
    n = len(src_ranks)
    for i, r in enumerate(src_ranks):
        _whole(src, r, "w", (rows, cols), box=Box((i * rows // n, 0), (rows // n, cols)))
    for r in dst_ranks:
        _whole(dst, r, "w", (rows, cols))
    return src, dst


def test_costmodel_hand_checked():
    topo = costmodel.dgx_h100().with_(msg_latency_s=0.0, round_latency_s=0.0, hbm_bw=float("inf"))
    nbytes = 1024 * 256 * 4
    # rank 0 -> rank 1 (same node, NVLink) and rank 0 -> rank 8 (next node, NIC): NIC dominates
    src, dst = _one_tensor([0], [1, 8])
    plan = make_plan(src, dst)
    p = costmodel.predict(plan, topo)
    assert p["nic_bytes"] == nbytes and p["nvlink_bytes"] == nbytes
    assert p["seconds"] == pytest.approx(nbytes / topo.nic_bw)
    assert p["link_bound_s"] == pytest.approx(nbytes / topo.nic_bw)
    # two receivers on node 1 need the same bytes from node 0: fan-out halves rank 0's NIC traffic
    src, dst = _one_tensor([0], [8, 9])
    plan = make_plan(src, dst)
    direct = costmodel.predict(plan, topo)
    hier = costmodel.hierarchical(plan, topo)
    assert direct["link_bound_s"] == pytest.approx(2 * nbytes / topo.nic_bw)
    assert hier["nic_bytes_saved"] == nbytes and hier["nic_bytes"] == nbytes and hier["nvlink_bytes"] == nbytes
    assert hier["link_bound_s"] == pytest.approx(nbytes / topo.nic_bw)
    # latency terms: one message per rank, one round
    topo2 = topo.with_(msg_latency_s=1e-3, round_latency_s=1e-2)
    assert costmodel.predict(plan, topo2)["seconds"] == pytest.approx(2 * nbytes / topo.nic_bw + 2e-3 + 1e-2)
    # GB200 NVL72: ranks 0 and 8 share one NVLink domain
    nvl = costmodel.gb200_nvl72()
    assert nvl.same_domain(0, 71) and not nvl.same_domain(71, 72)
    assert costmodel.link_bound(plan, nvl.with_(hbm_bw=float("inf"))) == pytest.approx(2 * nbytes / nvl.nvlink_bw)


def test_gather_broadcast_baseline_hand_checked():
    # [1024, 256] fp32 split over ranks 0-1; ranks 2 and 3 need it whole: root 0 gathers rank 1's half
    # (512 KiB) and sends the whole 1 MiB tensor to both receivers
    src, dst = _one_tensor([0, 1], [2, 3])
    gb = bench.gather_broadcast(src, dst)
    half, whole = 512 * 256 * 4, 1024 * 256 * 4
    assert gb["gather_bytes"] == half and gb["broadcast_bytes"] == 2 * whole
    assert gb["sent"] == {1: half, 0: 2 * whole} and gb["recv"] == {0: half, 2: whole, 3: whole}
    assert bench.lower_bound(src, dst)["bytes"] == 2 * whole == make_plan(src, dst).stats["lower_bound_bytes"]
    t = costmodel.gather_broadcast_time(gb["items"], costmodel.dgx_h100().with_(msg_latency_s=0.0))
    assert t["seconds"] == pytest.approx(half / costmodel.dgx_h100().nvlink_bw + whole / costmodel.dgx_h100().nvlink_bw)


def test_gather_broadcast_baseline_counts_experts_one_by_one():
    # stacked experts [4, 2I, H] (I = 8, H = 16, bf16): experts 0-1 on rank 0, 2-3 on rank 1; rank 2
    # needs expert 3 only, so it receives expert 3's gate_proj and up_proj units, not the stack
    name, (E, I, H) = "model.layers.1.mlp.experts.gate_up_proj", (4, 8, 16)
    src, dst = Layout(), Layout()
    for r in (0, 1):
        _whole(src, r, name, (E, 2 * I, H), "bfloat16", Box((2 * r, 0, 0), (2, 2 * I, H)))
    _whole(dst, 2, name, (E, 2 * I, H), "bfloat16", Box((3, 0, 0), (1, 2 * I, H)))
    assert len(bench.checkpoint_units(name, (E, 2 * I, H))) == 2 * E
    gb = bench.gather_broadcast(src, dst)
    assert gb["gather_bytes"] == 0 and gb["broadcast_bytes"] == 2 * I * H * 2 == make_plan(src, dst).stats["network_bytes"]
    assert gb["recv"] == {2: 2 * I * H * 2} and gb["sent"] == {1: 2 * I * H * 2}


def test_full_size_pipeline_on_scaled_down_dsv3(tmp_path):
    res = bench.run_full_size_config("small", budget=1 << 20, memory="tracemalloc")
    p = res["plan"]
    assert p["network_bytes"] == p["lower_bound_bytes"] == res["layout_lower_bound"] > 0
    assert res["baseline"]["bytes"] > p["network_bytes"]
    assert p["rounds"] >= 1 and p["messages"] > 0 and res["plan_tracemalloc_peak"] > 0
    assert p["max_stage_send_bytes"] <= 1 << 20 and p["max_stage_recv_bytes"] <= 1 << 20
    assert p["max_stage_bytes"] <= 1 << 20
    for c in res["cost"].values():
        assert 0 < c["link_bound_s"] <= c["predicted_s"]
        assert c["hier_link_bound_s"] <= c["link_bound_s"] * (1 + 1e-9)
    assert sum(map(sum, res["matrix"])) == p["network_bytes"]
    text = bench.markdown_full_size([res])
    assert "| small |" in text and "(yes)" in text
    if importlib.util.find_spec("matplotlib") is not None:
        files = bench.plot_full_size(res, tmp_path)
        assert all(os.path.getsize(f) > 1000 for f in files)


def test_bench_parser_registers_on_a_subparsers_object():
    parser = argparse.ArgumentParser(prog="mcore-reshard")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_bench_parser(sub)
    args = parser.parse_args(["bench", "--live", "--sizes", "20M,100M", "--reps", "7"])
    assert args.func is bench.cmd_bench and args.live and args.sizes == "20M,100M" and args.reps == 7
    assert not args.full_size and args.budget_mib == 256.0
    assert bench.cmd_bench(parser.parse_args(["bench"])) == 2     # nothing selected


def test_gpu_check_refuses_without_a_gpu():
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the check would run")
    env = {k: v for k, v in os.environ.items() if k != "MCORE_RESHARD_GPU_CHECK_DEVICE"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gpu_check.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "needs an NVIDIA GPU" in proc.stderr


@pytest.mark.megatron
@pytest.mark.multiproc
def test_live_one_rep_tiny():
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    from mcore_reshard.tools.bench.live import run_live
    (row,) = run_live(["tiny"], ["TP2 EP2 -> TP1 EP4"], reps=1, timeout=300)
    m = row["methods"]
    ours = m["mcore_reshard"]
    assert ours["bit_exact"] and ours["bytes"] == ours["lower_bound"] > 0
    assert m["megatron_resharding"]["bit_exact"] and m["gather_broadcast"]["bit_exact"]
    # as shipped, megatron.core.resharding 0.19.2 maps SequentialMLP experts by local index
    assert "bit_exact" in m["megatron_resharding_unpatched"] or "error" in m["megatron_resharding_unpatched"]
    assert m["gather_broadcast"]["bytes"] > ours["bytes"]
    # the floor moves the plan's network bytes, one message per (sender, receiver) pair
    assert m["floor"]["bytes"] == ours["bytes"] and 0 < m["floor"]["messages"] <= ours["messages"]
    # the floor + the local copies: the same wire, timed with them (interleaved)
    assert m["floor_local"]["bytes"] == ours["bytes"] and m["floor_local"]["messages"] == m["floor"]["messages"]
    assert len(m["floor_local"]["times"]) == len(m["floor"]["times"]) == len(ours["times"]) == 1
    assert all(e["median_s"] > 0 for e in m.values() if "median_s" in e)
    table = bench.markdown_live([row])
    assert "| tiny" in table and "| floor |" in table and "n/a (bare transport)" in table
    assert "| floor_local |" in table and "n/a (bare transport + local copies)" in table


def test_costmodel_paced_hand_checked():
    """Round by round a round lasts as long as its slowest rank; paced, ranks that do not exchange
    with the slow pair go on (the docstring example of ``costmodel.paced``)."""
    from types import SimpleNamespace as NS
    topo = costmodel.dgx_h100().with_(msg_latency_s=0.0, round_latency_s=0.0, hbm_bw=float("inf"))
    gb = 10 ** 9

    def msg(k, s, d, n):
        return NS(round=k, src=s, dst=d, unstaged=False, entries=[NS(nbytes=n, tensor="w")])
    plan = NS(messages=[msg(0, 0, 8, gb), msg(0, 16, 24, gb // 10), msg(1, 16, 24, gb)], local_copies=[],
              tensors={"w": {"shape": [gb], "src_dtype": "uint8", "dst_dtype": "uint8"}})
    assert costmodel.predict(plan, topo)["seconds"] == pytest.approx(0.040)
    assert costmodel.paced(plan, topo) == pytest.approx(0.022)
    # a message of round 1 between a fast and a slow rank starts when the slow one is done: 20 + 20 ms
    plan.messages[2] = msg(1, 16, 8, gb)
    assert costmodel.paced(plan, topo) == pytest.approx(0.040)
    # two messages into one receiver share its NIC in-queue (40 ms); NVLink (same node) is separate
    plan = NS(messages=[msg(0, 0, 8, gb), msg(0, 16, 8, gb), msg(0, 9, 8, 45 * gb // 10)], local_copies=[])
    assert costmodel.paced(plan, topo) == pytest.approx(0.040)
    topo2 = topo.with_(msg_latency_s=1e-3, round_latency_s=1e-2)
    assert costmodel.paced(plan, topo2) == pytest.approx(0.040 + 1e-3 + 1e-2)


def test_costmodel_paced_pipelines_pack_and_unpack():
    """A 1 GB staged message over the NIC (20 ms): its pack and unpack (0.6 ms each at 3.35 TB/s)
    run beside the wire, as the executor's batched path does, except the first window (1 MiB, the
    sender's) and the last (11,192,832 B = 1e9 - 15 MiB - 58 x 16 MiB, the receiver's); with a
    memory slower than the wire (50 GB/s: 40 ms of copies), the copies bound the round.  The
    windows are the executor's own."""
    from types import SimpleNamespace as NS

    from mcore_reshard.core.executor import common
    from mcore_reshard.core.executor.rounds import windows
    assert (costmodel.CHUNK_MIN, costmodel.CHUNK_MAX) == (common._CHUNK_MIN, common._CHUNK_MAX)
    for n in (1, 1 << 20, (1 << 20) + 1, 3 << 20, (3 << 20) + 5, 31 << 20, (47 << 20) + 3, 10 ** 9):
        w = windows(n)
        assert costmodel.edge_windows(n) == (w[0][1] - w[0][0], w[-1][1] - w[-1][0])
    topo = costmodel.dgx_h100().with_(msg_latency_s=0.0, round_latency_s=0.0)
    plan = NS(messages=[NS(round=0, src=0, dst=8, entries=[NS(nbytes=10 ** 9)])], local_copies=[])
    assert costmodel.paced(plan, topo) == pytest.approx(0.020 + 2 * 11192832 / 3.35e12, rel=1e-12)
    # the serial model: every copy after the wire
    assert costmodel.paced(plan, topo, pipelined=False) == pytest.approx(0.020 + 2 * 10 ** 9 / 3.35e12, rel=1e-12)
    slow = topo.with_(hbm_bw=50e9)
    assert costmodel.paced(plan, slow) == pytest.approx(2 * 10 ** 9 / 50e9 + 2 * 11192832 / 50e9, rel=1e-12)
    plan.messages[0].unstaged = True            # straight from / into the tensors: no copies at all
    assert costmodel.paced(plan, slow) == pytest.approx(0.020, rel=1e-12)


def test_cli_column_measures_the_command_beside_its_plan_build_time():
    """BENCHMARKS A's column "CLI wall / plan build": ``mcore-reshard plan`` in a fresh process on the
    scaled-down configuration (its model as a config.json), its wall from outside against the plan
    build time the same process prints."""
    from mcore_reshard.targets import from_hf_config
    from mcore_reshard.tools.bench.fullsize import hf_config_json
    assert from_hf_config(hf_config_json(bench.small_config())) == bench.small_config()
    c = bench.run_cli("small", timeout=300)
    assert "error" not in c, c
    assert c["command"].startswith("mcore-reshard --progress never plan --config ")
    assert 0 < c["plan_s"] < c["wall_s"] and c["wall_over_plan"] == c["wall_s"] / c["plan_s"]
    assert 0 < c["plan_cpu_s"] < c["cpu_s"] and 0 < c["layouts_cpu_s"] < c["cpu_s"] and c["layouts_s"] > 0
    assert 10 << 20 < c["max_rss_bytes"] < 1 << 30
    assert "x** (" in bench.report.markdown_cli([{"name": "small", "cli": c}])
    # every full-size configuration is a command line: the model a preset, both layouts strings
    from mcore_reshard.tools import layout_strings
    from mcore_reshard.tools.cli import PRESETS
    for name, conf in bench.CONFIGS.items():
        args = conf.cli_args()
        assert args[:3] == ["plan", "--model", conf.model_name] and (name == "small" or conf.model_name in PRESETS)
        assert ("--colocated" in args) == conf.colocated
        src, dst = layout_strings.parse(conf.src_layout), layout_strings.parse(conf.dst_layout)
        assert src.engine == "megatron" and src.world() > 0 and dst.world() > 0
