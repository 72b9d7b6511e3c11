"""The CLI's report from a plan's traffic totals (``core.planner.plan_traffic``; a templated plan's
copies never made) against the per-message computation it replaced, kept here verbatim as the
independent reference (``REF_*``, mcore_reshard/tools/costmodel.py and cli.py as of a0a1c34): the same
predicted time, round times, link bound, link totals, gather + broadcast bytes and heatmap, to the
last bit, on the scaled-down DeepSeek-V3 (templated, two-level with forwarded and unstaged messages,
colocated with local copies) and, against values the reference computed, on a full-size one."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest

from mcore_reshard.core.planner import TemplatedPlan, make_plan, plan_traffic
from mcore_reshard.tools import costmodel, layout_strings
from mcore_reshard.tools.bench.configs import small_config
from mcore_reshard.tools.cli import _gather_broadcast_bytes

# ----------------------------------------------------------------------------------- the reference


@dataclass
class RefTraffic:
    nic_out: dict = None
    nic_in: dict = None
    nvl_out: dict = None
    nvl_in: dict = None
    msgs: dict = None
    packed: dict = None

    def __post_init__(self):
        for f in ("nic_out", "nic_in", "nvl_out", "nvl_in", "msgs", "packed"):
            if getattr(self, f) is None:
                setattr(self, f, defaultdict(int))

    def add(self, topo, src, dst, nbytes, messages=1, staged=True):
        if topo.same_domain(src, dst):
            self.nvl_out[src] += nbytes
            self.nvl_in[dst] += nbytes
        else:
            self.nic_out[src] += nbytes
            self.nic_in[dst] += nbytes
        self.msgs[src] += messages
        if staged:
            self.packed[src] += nbytes
            self.packed[dst] += nbytes

    def link_time(self, topo):
        nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
        ranks = set(self.nic_out) | set(self.nic_in) | set(self.nvl_out) | set(self.nvl_in)
        return max((max(max(self.nic_out.get(r, 0), self.nic_in.get(r, 0)) / nic,
                        max(self.nvl_out.get(r, 0), self.nvl_in.get(r, 0)) / nvl) for r in ranks), default=0.0)

    def time(self, topo):
        nic, nvl = topo.nic_bw * topo.efficiency, topo.nvlink_bw * topo.efficiency
        ranks = set(self.nic_out) | set(self.nic_in) | set(self.nvl_out) | set(self.nvl_in)
        worst = 0.0
        for r in ranks:
            t = max(max(self.nic_out.get(r, 0), self.nic_in.get(r, 0)) / nic,
                    max(self.nvl_out.get(r, 0), self.nvl_in.get(r, 0)) / nvl)
            t += topo.msg_latency_s * self.msgs.get(r, 0) + 2 * self.packed.get(r, 0) / topo.hbm_bw
            worst = max(worst, t)
        return worst

    def summary(self):
        def mx(d):
            return max(d.values(), default=0)
        return {"nic_bytes": sum(self.nic_out.values()), "nvlink_bytes": sum(self.nvl_out.values()),
                "max_nic_out": mx(self.nic_out), "max_nic_in": mx(self.nic_in),
                "max_nvlink_out": mx(self.nvl_out), "max_nvlink_in": mx(self.nvl_in),
                "max_messages_per_rank": mx(self.msgs)}


def _ref_payload(m):
    return sum(c.nbytes for c in m.entries)


def REF_predict(plan, topo):
    rounds = defaultdict(RefTraffic)
    total = RefTraffic()
    for m in plan.messages:
        n, staged = _ref_payload(m), not getattr(m, "unstaged", False)
        rounds[m.round].add(topo, m.src, m.dst, n, staged=staged)
        total.add(topo, m.src, m.dst, n, staged=staged)
    local = defaultdict(int)
    for c in plan.local_copies:
        local[c.dst] += c.nbytes
    local_s = max((2 * b / topo.hbm_bw for b in local.values()), default=0.0)
    per_round = [rounds[k].time(topo) + topo.round_latency_s for k in sorted(rounds)]
    return {"seconds": local_s + sum(per_round), "local_s": local_s, "rounds": len(per_round), "round_s": per_round,
            "link_bound_s": REF_link_bound(plan, topo), **total.summary()}


def REF_link_bound(plan, topo):
    t = RefTraffic()
    for m in plan.messages:
        t.add(topo, m.src, m.dst, _ref_payload(m))
    return t.link_time(topo)


def REF_gather_broadcast_bytes(plan):
    need = {}
    for c in list(plan.local_copies) + [c for m in plan.messages for c in m.entries]:
        need.setdefault(c.dst, set()).add(c.tensor)
    from mcore_reshard.core.layout import itemsize
    total = 0
    for r, names in need.items():
        for n in names:
            meta = plan.tensors[n]
            numel = 1
            for d in meta["shape"]:
                numel *= d
            total += numel * itemsize(meta["src_dtype"])
    return total


def REF_heatmap(plan):
    grid = defaultdict(int)
    for m in plan.messages:
        grid[(m.src, m.dst)] += sum(c.nbytes for c in m.entries)
    for c in plan.local_copies:
        grid[(c.src, c.dst)] += c.nbytes
    return dict(grid)


# ----------------------------------------------------------------------------------- comparisons

KEYS = ("seconds", "local_s", "rounds", "round_s", "link_bound_s", "nic_bytes", "nvlink_bytes", "max_nic_out",
        "max_nic_in", "max_nvlink_out", "max_nvlink_in", "max_messages_per_rank")


def _layouts(src: str, dst: str, colocated: bool, cfg=None):
    cfg = cfg or small_config()
    s, d = layout_strings.parse(src), layout_strings.parse(dst)
    return (layout_strings.build(s, cfg, 0, "bfloat16"),
            layout_strings.build(d, cfg, 0 if colocated else s.world(), "bfloat16"))


def _no_copies(monkeypatch) -> None:
    """A templated plan whose messages or local copies are asked for fails the test."""
    def made(self):
        pytest.fail("the report made the templated plan's copies")
    monkeypatch.setattr(TemplatedPlan, "messages", property(made))
    monkeypatch.setattr(TemplatedPlan, "local_copies", property(made))


def test_cli_plan_makes_no_copy_of_a_templated_plan(monkeypatch, capsys):
    from mcore_reshard.tools.cli import main
    _no_copies(monkeypatch)
    assert main(["plan", "--model", "dsv3-tiny", "--src", "tp=1,pp=2,ep=2,etp=1", "--dst", "vllm:tp=2,dp=2,ep"]) == 0
    out = capsys.readouterr().out
    assert "gather+broadcast" in out and "predicted refit" in out and "templates" not in out


def _new_report(plan, vectorised=None) -> dict:
    """What the CLI computes now, before anything has made the plan's copies (``vectorised``: as
    :func:`costmodel.predict`; the CLI, numpy not imported, loops on plans of up to PYTHON_PARTS parts)."""
    traffic = plan_traffic(plan)
    pairs = traffic.pair_bytes()
    out = {"gb": _gather_broadcast_bytes(plan, traffic),
           "heat": {k: pairs.get(k, 0) + traffic.local_bytes.get(k, 0) for k in set(pairs) | set(traffic.local_bytes)}}
    for name in sorted(costmodel.PRESETS):
        p = costmodel.predict(plan, costmodel.preset(name), traffic=traffic, with_paced=False, vectorised=vectorised)
        out[name] = {k: p[k] for k in KEYS}
    return out


def _ref_report(plan) -> dict:
    out = {"gb": REF_gather_broadcast_bytes(plan), "heat": REF_heatmap(plan)}
    for name in sorted(costmodel.PRESETS):
        p = REF_predict(plan, costmodel.preset(name))
        out[name] = {k: p[k] for k in KEYS}
    return out


@pytest.mark.parametrize("src,dst,colocated,topology", [
    ("tp=1,pp=4,ep=4,etp=1,dp=4,first=1,last=1", "vllm:tp=4,dp=4,ep", False, None),        # bench "small"
    ("tp=1,pp=4,ep=4,etp=1,dp=4,first=1,last=1", "vllm:tp=4,dp=4,ep", False, 8),           # two-level: forwarded, unstaged
    ("tp=2,pp=2,ep=4,etp=1", "sglang:tp=4,dp=4,ep=4,dpattn,replicas=2", True, None),        # local copies, replicas
    ("tp=2,pp=2,ep=4,etp=1", "vllm:tp=2,dp=2", True, 4),
])
def test_report_from_totals_equals_the_per_message_reference(src, dst, colocated, topology, monkeypatch):
    s, d = _layouts(src, dst, colocated)
    plan = make_plan(s, d, budget_bytes=1 << 20, ignore_unused=True, topology=topology)
    if topology is None:
        assert isinstance(plan, TemplatedPlan)
        plan.summary()                      # what the CLI prints first (it makes the padding view)
        with monkeypatch.context() as m:    # the totals make no copy
            _no_copies(m)
            new = _new_report(plan)
    else:
        new = _new_report(plan)
        assert any(m.unstaged for m in plan.messages) and any(m.forward for m in plan.messages)
    if colocated:
        assert plan.stats["local_bytes"] > 0
    ref = _ref_report(plan)
    assert new == ref                       # floats included: bit for bit
    traffic = plan_traffic(plan)            # without numpy: loops over the parts, the same floats
    for name in sorted(costmodel.PRESETS):
        topo = costmodel.preset(name)
        assert costmodel.predict(plan, topo, traffic=traffic, with_paced=False, vectorised=False) == \
            costmodel.predict(plan, topo, traffic=traffic, with_paced=False, vectorised=True)


# The per-message reference (``REF_*``) run on the full-size ``nccl_m2n`` (it makes the templated plan's
# ~3.5 M copies: 20 s, too slow to repeat here): its values, which the totals must give exactly.
NCCL_M2N_HASH = "5fb4dcd70e6d33dc766cbe40cfb87c35ce8583e5e4f917c7b215129fb94f5a0d"
NCCL_M2N_REFERENCE = {
    "gb": 171782767116288,
    "dgx_h100": {"seconds": 0.5015588761695522, "link_bound_s": 0.42799177728, "local_s": 0.0, "rounds": 90,
                 "nic_bytes": 2658682273792, "nvlink_bytes": 0, "max_nic_out": 21399588864, "max_nic_in": 20770955264,
                 "max_nvlink_out": 0, "max_nvlink_in": 0, "max_messages_per_rank": 296},
    "gb200_nvl72": {"seconds": 0.49315403788799994, "link_bound_s": 0.42799177728, "local_s": 0.0, "rounds": 90,
                    "nic_bytes": 2532138213376, "nvlink_bytes": 126544060416, "max_nic_out": 21399588864,
                    "max_nic_in": 20770955264, "max_nvlink_out": 15906763776, "max_nvlink_in": 9146904576,
                    "max_messages_per_rank": 296},
    "gb200_nvl72_800g": {"seconds": 0.25412741952, "link_bound_s": 0.21399588864, "local_s": 0.0, "rounds": 90,
                         "nic_bytes": 2532138213376, "nvlink_bytes": 126544060416, "max_nic_out": 21399588864,
                         "max_nic_in": 20770955264, "max_nvlink_out": 15906763776, "max_nvlink_in": 9146904576,
                         "max_messages_per_rank": 296},
}


NCCL_M2N_ROUND_S = {"dgx_h100": "90596a9a9e6726e2", "gb200_nvl72": "eda402e9ee71b375",
                    "gb200_nvl72_800g": "95ad2c84eadbb86d"}      # sha256 of json.dumps(round_s), first 16


def test_full_size_report_from_totals_equals_the_reference_values():
    """BENCHMARKS A's ``nccl_m2n`` as the CLI builds it (``--model dsv3-671b --src
    tp=1,pp=4,ep=16,etp=1,dp=32,first=16,last=15 --dst vllm:tp=8,dp=16,ep --dtype bfloat16``)."""
    from mcore_reshard.targets import dsv3_671b
    s, d = _layouts("tp=1,pp=4,ep=16,etp=1,dp=32,first=16,last=15", "vllm:tp=8,dp=16,ep", False, dsv3_671b())
    plan = make_plan(s, d, ignore_unused=True)
    assert plan.hash == NCCL_M2N_HASH          # the plan the reference values are of
    plan.summary()
    for vectorised in (True, False):            # numpy, and the loop the CLI takes on this plan
        with pytest.MonkeyPatch.context() as m:
            _no_copies(m)
            new = _new_report(plan, vectorised)
        assert new["gb"] == NCCL_M2N_REFERENCE["gb"]
        for name in sorted(costmodel.PRESETS):
            got = {k: v for k, v in new[name].items() if k != "round_s"}
            assert got == NCCL_M2N_REFERENCE[name], (name, vectorised)
            digest = hashlib.sha256(json.dumps(new[name]["round_s"]).encode()).hexdigest()[:16]
            assert digest == NCCL_M2N_ROUND_S[name], (name, vectorised)    # every round's time, to the last bit
    parts = sum(len(g.src) * len(g.copies) for g in plan_traffic(plan).groups)
    assert 0 < parts <= costmodel.PYTHON_PARTS          # so the CLI, numpy not imported, takes the loop


def test_the_cli_plan_imports_no_numpy_on_a_plan_the_loop_serves(tmp_path):
    """``mcore-reshard plan`` on ``nccl_m2n``: the report's numbers without importing numpy (~0.2 s CPU,
    as much as the plan's own build on this configuration)."""
    code = ("import sys, runpy; sys.argv = ['mcore-reshard', '--progress', 'never', 'plan', '--model', 'dsv3-671b', "
            "'--src', 'tp=1,pp=4,ep=16,etp=1,dp=32,first=16,last=15', '--dst', 'vllm:tp=8,dp=16,ep', '--dtype', "
            "'bfloat16']\ntry:\n    runpy.run_module('mcore_reshard.tools.cli', run_name='__main__')\n"
            "except SystemExit as e:\n    assert not e.code, e.code\nprint('numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "predicted refit    0.502 s on dgx_h100 (link-bound limit 0.428 s)" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "False"
