"""The examples run end to end at a small size (as a user would start them)."""
from __future__ import annotations

import subprocess
import sys

import pytest
from repo_paths import ROOT

pytestmark = [pytest.mark.megatron, pytest.mark.multiproc]


def _run(*args):
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out.stdout


@pytest.mark.parametrize("flags", [[], ["--colocated"]], ids=["disaggregated", "colocated"])
def test_rl_refit_loop(flags):
    out = _run("examples/rl_refit_loop.py", "--steps", "2", *flags)
    assert "inference logits follow the trainer" in out
    assert out.count(" step ") == (8 if flags else 4)   # every inference rank reports every step


def test_convert_parallel():
    out = _run("examples/convert_parallel.py")
    assert "tp=2,pp=2 -> tp=1,ep=4,etp=1: 83 tensors" in out
