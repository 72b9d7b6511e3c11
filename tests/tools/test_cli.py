"""The command line (``mcore-reshard plan`` / ``explain``, ``--progress``, errors) and the layout-string
grammar it and the synthetic model share (``tools.layout_strings``, ``tools.synthetic.parse_parallel``)."""
from __future__ import annotations

import json
import subprocess
import sys

from mcore_reshard.tools.cli import main


def test_cli_help_explains_itself():
    out = subprocess.run([sys.executable, "-m", "mcore_reshard.tools.cli", "--help"], capture_output=True, text=True, check=True).stdout
    for word in ("demo", "plan", "tp=2,pp=2,ep=2", "bit for bit", "lower bound"):
        assert word in out
    out = subprocess.run([sys.executable, "-m", "mcore_reshard.tools.cli", "demo", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--colocated" in out and "--budget-mib" in out


def test_cli_plan_writes_json(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", "--src", "tp=2,pp=2", "--dst", "tp=4", "--out", str(path)]) == 0
    text = capsys.readouterr().out
    plan = json.loads(path.read_text())
    assert plan["stats"]["network_bytes"] == plan["stats"]["lower_bound_bytes"]
    assert f"bytes over network {plan['stats']['network_bytes']:,}" in text


def test_cli_plan_heatmap(capsys, tmp_path):
    import pytest
    pytest.importorskip("matplotlib")   # in the test extra on Python 3.12; the 3.11 core run has no plotting
    png = tmp_path / "heat.png"
    assert main(["plan", "--model", "dsv3-tiny", "--src", "tp=2,pp=2", "--dst", "vllm:tp=2,dp=2,ep", "--heatmap", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"traffic heatmap written to {png}" in capsys.readouterr().out


def test_cli_plan_presets_and_engines(capsys):
    assert main(["plan", "--model", "dsv3-tiny", "--src", "tp=2,pp=2", "--dst", "vllm:tp=2,dp=2,ep", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "predicted refit" in out and "on dgx_h100 (link-bound limit" in out
    assert "4 ranks) -> destination vllm:tp=2,dp=2,ep (4 ranks, disaggregated)" in out
    assert "not in target      20 source tensors" in out      # the MTP layer: no draft model requested
    assert main(["explain", "model.layers.1.mlp.gate.e_score_correction_bias", "--model", "dsv3-tiny",
                 "--src", "tp=2,ep=2,etp=1", "--dst", "sglang:tp=2,dp=2,ep=2,dpattn", "--colocated"]) == 0
    out = capsys.readouterr().out
    # replicated fp32 bias, 8 elements: one local copy on each of the 2 SGLang ranks, nothing sent
    assert "shape [8]  float32 -> float32" in out and out.count("local ") == 2 and "send" not in out
    assert main(["explain", "nope", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "hf"]) == 2


def test_layout_strings():
    from mcore_reshard.tools import layout_strings
    spec = layout_strings.parse("tp=2,pp=16,ep=64")
    # etp defaults to tp: etp*ep*pp = 2048 ranks, so dp is made 64 to fit the experts
    assert spec.engine == "megatron" and layout_strings.megatron_sizes(spec).dp == 64
    assert spec.world() == 2 * 16 * 64
    assert layout_strings.parse("sglang:tp=16,dp=16,ep=16,dpattn").sizes == {"tp": 16, "dp": 16, "ep": 16, "dpattn": 1}
    assert layout_strings.parse("hf").world() == 1
    import pytest
    with pytest.raises(ValueError, match="unknown engine 'trt'"):
        layout_strings.parse("trt:tp=2")
    with pytest.raises(ValueError, match="bad size 'tp=0'"):
        layout_strings.parse("vllm:tp=0")


def test_cli_progress_bar_and_plain_lines():
    """--progress always draws a tqdm bar over the plan's steps; never prints one line per step."""
    cmd = [sys.executable, "-m", "mcore_reshard.tools.cli"]
    args = ["plan", "--model", "dsv3-tiny", "--src", "tp=2,pp=2", "--dst", "vllm:tp=2"]
    bar = subprocess.run(cmd + ["--progress", "always"] + args, capture_output=True, text=True, check=True).stderr
    frames = bar.replace("\r", "\n")
    assert "plan: 100%" in frames and "4/4" in frames and "[mcore-reshard]" not in bar
    plain = subprocess.run(cmd + ["--progress", "never"] + args, capture_output=True, text=True, check=True).stderr
    assert plain.splitlines() == ["[mcore-reshard] source layout tp=2,pp=2 of dsv3-tiny",
                                  "[mcore-reshard] destination layout vllm:tp=2",
                                  "[mcore-reshard] planning 83 tensors, 4 -> 2 ranks",
                                  "[mcore-reshard] summary"]


def test_cli_bad_layout_is_one_clear_line():
    cmd = [sys.executable, "-m", "mcore_reshard.tools.cli", "--progress", "never", "plan", "--model", "dsv3-671b",
           "--src", "tp=1,pp=4,ep=16", "--dst", "vllm:tp=8"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.splitlines()[-1] == "mcore-reshard plan: error: 61 layers do not divide over pp=4 x vpp=1"


def test_synthetic_parser_shares_the_layout_string_grammar():
    import pytest

    from mcore_reshard.tools.synthetic import parse_parallel
    assert parse_parallel("tp=2,pp=2,ep=2") == {"tp": 2, "pp": 2, "cp": 1, "ep": 2, "dp": 1, "etp": 2}
    with pytest.raises(ValueError, match="bad size 'tp=0'"):
        parse_parallel("tp=0")
    with pytest.raises(ValueError, match=r"Megatron keys .* not \['vpp'\]"):
        parse_parallel("tp=2,vpp=2")
