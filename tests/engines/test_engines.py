"""The real engines in the loop: vLLM 0.33.0 and SGLang 0.5.23 model classes and loaders on CPU.

``./dev.sh test`` creates ``.venv-vllm`` / ``.venv-sglang`` (once, cached); each launch below runs
``tests/engines/engine_worker.py`` (or ``engine_refit.py``) as four gloo ranks of the engine venv's
Python (``rank_launch``: file-store rendezvous), many cases per launch (an engine import costs 15-40 s).
Without an engine venv the tests skip, except under CI (``CI=true``, or ``MCORE_RESHARD_REQUIRE_ENGINES=1`` as ``.ci/run`` sets), where a
missing engine venv fails.

* layouts: the engine's real model built from a ``config.json``, a random HF checkpoint loaded by
  the engine's own ``load_weights``; every parameter (names both ways, local shapes, contents, bit
  for bit) equals what ``vllm_layout`` / ``sglang_layout`` say, with the kwargs the integrations
  derive from the engine's config (``vllm_spec`` / ``sglang_spec``), and the layout probed from the
  engine's loader (``integrations.probe``) equals the hand-written one.
* refit: a Megatron-Core trainer and the real engine model joined by the protocol over gloo; the
  refit writes into the engine model's storage, and the result equals the engine's own
  ``load_weights`` of an HF export of the same Megatron weights.
"""
from __future__ import annotations

import json
import os

import engine_cases
import pytest
from rank_launch import run_ranks
from repo_paths import ENGINES_DIR, ROOT

VENVS = {"vllm": os.path.join(ROOT, ".venv-vllm"), "sglang": os.path.join(ROOT, ".venv-sglang")}
IN_CI = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
         or os.environ.get("MCORE_RESHARD_REQUIRE_ENGINES", "") == "1")
# a launch is bounded by its own timeout (killed whole, with every rank's stack in the failure)
pytestmark = [pytest.mark.engines, pytest.mark.multiproc, pytest.mark.timeout(1500)]


def engine_python(engine: str) -> str:
    venv = VENVS[engine]
    ok = os.path.exists(os.path.join(venv, ".mcore-reshard-ok"))
    if not ok:
        msg = f"{venv} is missing (./dev.sh engines creates it)"
        if IN_CI:
            pytest.fail(msg + " -- in CI the engine venvs are required")
        pytest.skip(msg)
    return os.path.join(venv, "bin")


def _final(path: str) -> bool:
    """A rank's report is whole: ``engine_worker.py`` writes it case by case and adds ``_total_s`` last;
    ``engine_refit.py`` writes it once, at the end."""
    try:
        with open(path) as f:
            rep = json.load(f)
    except (OSError, ValueError):
        return False
    return "_total_s" in rep or "_setup_s" not in rep


def _partial(path: str) -> dict:
    """Case id -> errors of what a rank had reported when its launch ended."""
    try:
        with open(path) as f:
            return {k: v.get("errors") for k, v in json.load(f).items() if isinstance(v, dict)}
    except (OSError, ValueError):
        return {}


def launch(engine: str, mode: str, cases: list, tmp, nproc: int = 4, script: str = "engine_worker.py",
           timeout: int = 600) -> dict:
    """One launch of ``nproc`` ranks (``rank_launch``: file-store rendezvous, no port to collide on);
    returns case id -> {rank: report}.  A rank without a final report fails the fixture with what every
    rank had reported case by case and the tails of the ranks' logs (with their stacks when the launch
    stalled and was killed).  Nothing is retried: what a launch does is the result."""
    bindir = engine_python(engine)
    job, out = os.path.join(tmp, f"{engine}-{mode}.json"), os.path.join(tmp, f"{engine}-{mode}-out")
    with open(job, "w") as f:
        json.dump(cases, f)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "PYTHONFAULTHANDLER": "1"}
    if engine == "vllm":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    ranks = run_ranks([os.path.join(bindir, "python"), os.path.join(ENGINES_DIR, script), engine, mode, job, out],
                      nproc, env, os.path.join(tmp, f"{engine}-{mode}-ranks"), timeout)
    missing = [r for r in range(nproc) if not _final(os.path.join(out, f"rank{r}.json"))]
    if missing:
        partial = {r: _partial(os.path.join(out, f"rank{r}.json")) for r in missing}
        how = f"stalled: killed after {timeout} s" if ranks.stalled else f"exit codes {ranks.returncodes}"
        logs = "\n".join(f"--- rank {r} log (tail) ---\n{ranks.tail(r, 3000)}" for r in range(nproc))
        raise AssertionError(f"{engine} {mode}: ranks {missing} wrote no final report ({how}); their reports "
                             f"so far: {partial}\n{logs}")
    reports = {}
    for r in range(nproc):
        path = os.path.join(out, f"rank{r}.json")
        with open(path) as f:
            for cid, rep in json.load(f).items():
                reports.setdefault(cid, {})[r] = rep
    return reports


def failures(reports: dict, cid: str, keys=("errors", "probe_errors")) -> list[str]:
    out = []
    for r, rep in sorted(reports[cid].items()):
        for k in keys:
            out += [f"rank {r} {k}: {e}" for e in rep.get(k, [])]
        if "traceback" in rep:
            out.append(f"rank {r}: {rep['traceback'][-1500:]}")
    return out


# ----------------------------------------------------------------------------------- layouts

@pytest.fixture(scope="module")
def vllm_layouts(tmp_path_factory):
    return launch("vllm", "layouts", engine_cases.VLLM_LAYOUTS, str(tmp_path_factory.mktemp("vllm")))


@pytest.fixture(scope="module")
def sglang_layouts(tmp_path_factory):
    """SGLang builds its groups over the whole world (world == tp): one launch per TP size."""
    out = {}
    for tp in sorted({c["par"]["tp"] for c in engine_cases.SGLANG_LAYOUTS}):
        cases = [c for c in engine_cases.SGLANG_LAYOUTS if c["par"]["tp"] == tp]
        out.update(launch("sglang", "layouts", cases, str(tmp_path_factory.mktemp(f"sglang-tp{tp}")), nproc=tp))
    return out


@pytest.mark.parametrize("cid", [c["id"] for c in engine_cases.VLLM_LAYOUTS])
def test_vllm_layout_equals_real_loader(vllm_layouts, cid):
    assert not failures(vllm_layouts, cid), "\n".join(failures(vllm_layouts, cid))
    for r, rep in vllm_layouts[cid].items():
        assert rep["params"] > 0 and not rep.get("unwritten"), (r, rep.get("unwritten"))


def test_vllm_round_robin_only_where_vllm_applies_it(vllm_layouts):
    """vLLM keeps round-robin only with several expert groups and no DP all-to-all (defect 1)."""
    # (contents are checked by test_vllm_layout_equals_real_loader: these say which placement that was)
    assert vllm_layouts["dsv3-tp2-ep-roundrobin"][1]["experts"] == [1, 3, 5, 7]          # kept: 2 groups
    assert vllm_layouts["dsv3-tp2-ep"][1]["experts"] == [4, 5, 6, 7]
    fallback = {"dsv3-1group-tp2-ep-roundrobin": [4, 5, 6, 7], "dsv3-dp2-tp2-ep-roundrobin": [2, 3],
                "qwen3moe-tp2-ep-roundrobin": [4, 5, 6, 7]}
    for cid, want in fallback.items():
        assert not failures(vllm_layouts, cid)
        assert vllm_layouts[cid][1]["kwargs"]["expert_placement"] == "round_robin"   # configured,
        assert vllm_layouts[cid][1]["experts"] == want                                # but linear


def test_vllm_sequence_parallel_moe_shared_experts_whole(vllm_layouts):
    """DP2 x TP2 with EP: vLLM's sequence-parallel MoE keeps the shared experts whole (defect 4)."""
    shapes = vllm_layouts["dsv3-dp2-tp2-ep"][0]["shapes"]
    assert shapes["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == [64, 64]


def test_vllm_pp_stages_agree_on_names(vllm_layouts):
    """PP2 with a first stage without MoE layers: every stage derives the same names (defect 3)."""
    names = {rep["kwargs"]["names"] for rep in vllm_layouts["dsv3-tp2-pp2"].values()}
    assert names == {"current"}


@pytest.mark.parametrize("cid", [c["id"] for c in engine_cases.SGLANG_LAYOUTS])
def test_sglang_layout_equals_real_loader(sglang_layouts, cid):
    assert not failures(sglang_layouts, cid), "\n".join(failures(sglang_layouts, cid))
    for r, rep in sglang_layouts[cid].items():
        assert rep["params"] > 0 and not rep.get("unwritten"), (r, rep.get("unwritten"))


# ----------------------------------------------------------------------------------- live refit

@pytest.fixture(scope="module")
def vllm_refits(tmp_path_factory):
    return launch("vllm", "refit", engine_cases.VLLM_REFITS, str(tmp_path_factory.mktemp("vllm-refit")),
                  script="engine_refit.py")


@pytest.fixture(scope="module")
def sglang_refits(tmp_path_factory):
    return launch("sglang", "refit", engine_cases.SGLANG_REFITS, str(tmp_path_factory.mktemp("sglang-refit")),
                  script="engine_refit.py")


@pytest.mark.parametrize("cid", [c["id"] for c in engine_cases.VLLM_REFITS])
def test_vllm_live_refit_equals_engine_load_weights(vllm_refits, cid):
    bad = failures(vllm_refits, cid, keys=("errors",))
    assert not bad, "\n".join(bad)
    engine_ranks = [rep for rep in vllm_refits[cid].values() if rep.get("role") == "engine"]
    assert engine_ranks and all(rep["checked"] > 0 and rep["same_storage"] for rep in engine_ranks)


def test_vllm_weight_transfer_backend_lifecycle_and_draft(vllm_refits):
    """The backend went through vLLM's factories and lifecycle, the MTP draft model through the draft update."""
    reps = vllm_refits["weight-transfer-backend"]
    assert reps[0]["calls"] == ["init", "start", "update", "finish", "reset_prefix_cache", "start_draft", "update",
                                "finish"]
    assert reps[0]["prefix_cache_reset"] is True
    for rep in (r for r in reps.values() if r.get("role") == "engine"):
        assert rep["backend"] == "McoreReshardWeightTransferEngine"
        assert rep["draft_checked"] > 0 and rep["draft_same_storage"]


@pytest.mark.parametrize("cid", [c["id"] for c in engine_cases.SGLANG_REFITS])
def test_sglang_live_refit_equals_engine_load_weights(sglang_refits, cid):
    """Every parameter, and every tensor SGLang's post-load step derives outside them (MLA ``w_kc`` /
    ``w_vc`` of each layer: the hook's ``post_load_weights`` after the refit against the reference's
    own ``load_weights`` + ``post_load_weights``), bit for bit."""
    bad = failures(sglang_refits, cid, keys=("errors",))
    assert not bad, "\n".join(bad)
    engine_ranks = [rep for rep in sglang_refits[cid].values() if rep.get("role") == "engine"]
    assert engine_ranks and all(rep["checked"] > 0 and rep["same_storage"] for rep in engine_ranks)
    for rep in engine_ranks:
        assert rep["derived"].get("w_kc", 0) >= 4 and rep["derived"].get("w_kc") == rep["derived"].get("w_vc"), rep["derived"]
