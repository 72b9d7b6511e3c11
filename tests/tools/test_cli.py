"""The command line (``mcore-reshard plan`` / ``explain``, ``--progress``, errors) and the layout-string
grammar it and the synthetic model share (``tools.layout_strings``, ``tools.synthetic.parse_parallel``)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

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
    assert res.stderr.splitlines()[-1].startswith(
        "mcore-reshard plan: error: --src 'tp=1,pp=4,ep=16': 61 layers do not divide over pp=4 x vpp=1 (dsv3-671b); "
        "what fits (first= / last=: layers on the first / last pipeline stage): 'tp=1,pp=4,ep=16,first=16' "
        "(stages 16/15x3)")


# ----------------------------------------------------------------------------------- layout-string grammar
# docs/layout-strings.md / layout_strings.GRAMMAR: "hf" | [engine ":"] item *("," item); item = key "=" N | flag;
# N = ASCII digits, >= 1; no whitespace, no empty item, every key at most once, keys known to the engine.
# Each malformed string: exit 2, one error line naming the option, the string and (the fragment) its bad part.
MALFORMED = [
    ("", "empty layout string"),
    (" ", "whitespace at character 1 (' ')"),
    (" tp=2", "whitespace at character 1"),
    ("tp=2 ", "whitespace at character 5"),
    ("tp=2, pp=2", "whitespace at character 6"),
    ("tp =2", "whitespace at character 3"),
    ("tp=\t2", "whitespace at character 4 ('\\t')"),
    ("tp=2\n", "whitespace at character 5 ('\\n')"),
    (",", "empty item at the start"),
    ("tp=2,", "empty item at the end"),
    (",tp=2", "empty item at the start"),
    ("tp=2,,pp=2", "empty item at character 6"),
    ("tp=2,,pp", "empty item at character 6"),
    ("vllm:tp=8,,ep", "empty item at character 11"),
    ("tp=", "'tp=' has no value"),
    ("pp=2,tp=", "'tp=' has no value"),
    ("=2", "'=2' has no key"),
    ("=", "'=' has no key"),
    ("tp==2", "bad size 'tp==2': '=2' is not a whole number >= 1"),
    ("tp=2=3", "bad size 'tp=2=3'"),
    ("tp=2,tp=4", "'tp' given twice ('tp=2' and 'tp=4')"),
    ("vllm:tp=8,ep,ep", "'ep' given twice"),
    ("xx=2", "unknown key 'xx' in 'xx=2'; megatron keys: tp=N pp=N"),
    ("TP=2", "unknown key 'TP'"),
    ("tp=2,replicas=2", "unknown key 'replicas'"),
    ("vllm:tp=8,dpattn", "unknown key 'dpattn' in 'dpattn'; vllm keys"),
    ("sglang:tp=8,legacy", "unknown key 'legacy'"),
    ("pp", "'pp' needs a value: pp=N"),
    ("megatron:tp=2,ep", "'ep' needs a value"),
    ("vllm:tp=8,ep=2", "'ep=2': 'ep' is a flag of vllm layouts (enable_expert_parallel) and takes no value"),
    ("sglang:tp=8,dpattn=1", "'dpattn' is a flag of sglang layouts"),
    ("tp=0", "bad size 'tp=0': '0' is not a whole number >= 1"),
    ("tp=-2", "bad size 'tp=-2'"),
    ("tp=+2", "bad size 'tp=+2'"),
    ("tp=2.5", "bad size 'tp=2.5'"),
    ("tp=two", "bad size 'tp=two'"),
    ("tp=0x10", "bad size 'tp=0x10'"),
    ("tp=1e3", "bad size 'tp=1e3'"),
    ("tp=\u0663", "bad size 'tp=\u0663'"),           # ARABIC-INDIC DIGIT THREE: a digit, not ASCII
    ("tp=\u00b2", "bad size 'tp=\u00b2'"),           # SUPERSCRIPT TWO
    ("first=0", "bad size 'first=0'"),
    ("trt:tp=2", "unknown engine 'trt'; engines: megatron, vllm, sglang, hf"),
    ("VLLM:tp=8", "unknown engine 'VLLM'"),
    (":tp=2", "unknown engine ''"),
    ("vllm:", "nothing after 'vllm:'"),
    ("megatron:", "nothing after 'megatron:'"),
    ("hf:", "'hf' takes no keys"),
    ("hf:tp=2", "'hf' takes no keys"),
    ("vllm:tp=8:dp=2", "bad size 'tp=8:dp=2'"),
    ("sglang:tp=8,fuse,nofuse", "'fuse' and 'nofuse' contradict each other"),
    ("tp=1,dp=100000000", "100,000,000 ranks; this tool plans at most 65,536"),
]
WELL_FORMED = {"hf": ("hf", {}), "tp=2": ("megatron", {"tp": 2}), "megatron:tp=2,pp=16,ep=64,first=3,last=2":
               ("megatron", {"tp": 2, "pp": 16, "ep": 64, "first": 3, "last": 2}),
               "vllm:tp=8,dp=2,ep,legacy,pp=2,replicas=4": ("vllm", {"tp": 8, "dp": 2, "ep": 1, "legacy": 1, "pp": 2,
                                                                     "replicas": 4}),
               "sglang:tp=16,dp=16,ep=16,dpattn,nofuse": ("sglang", {"tp": 16, "dp": 16, "ep": 16, "dpattn": 1,
                                                                      "nofuse": 1}),
               "tp=010": ("megatron", {"tp": 10})}


@pytest.mark.parametrize("text,bad", MALFORMED, ids=[repr(t) for t, _ in MALFORMED])
def test_cli_refuses_a_malformed_layout_string(text, bad, capsys):
    for option, args in (("--src", ["--src", text, "--dst", "tp=4"]), ("--dst", ["--src", "tp=2", "--dst", text])):
        assert main(["--progress", "never", "plan", "--model", "dsv3-tiny", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.count("error:") == 1, err
        assert err.startswith(f"mcore-reshard plan: error: {option} {text!r}: ") and bad in err, err


@pytest.mark.parametrize("text", list(WELL_FORMED))
def test_layout_string_grammar_accepts(text):
    from mcore_reshard.tools import layout_strings
    spec = layout_strings.parse(text)
    assert (spec.engine, spec.sizes) == WELL_FORMED[text]


def test_cli_demo_and_explain_refuse_malformed_strings_before_anything_runs(capsys):
    assert main(["demo", "--src", "tp=2,,pp"]) == 2          # no process launched
    assert capsys.readouterr().err == ("mcore-reshard demo: error: --src 'tp=2,,pp': empty item at character 6 (two "
                                       "commas in a row, or a comma at either end): items are separated by single "
                                       "commas\n")
    assert main(["demo", "--dst", "vllm:tp=2"]) == 2          # the synthetic model: Megatron strings only
    assert "--dst 'vllm:tp=2': bad parallel sizes 'vllm:tp=2'" in capsys.readouterr().err
    assert main(["explain", "x", "--src", "tp=2", "--dst", "tp=2,tp=2"]) == 2
    assert "--dst 'tp=2,tp=2': 'tp' given twice" in capsys.readouterr().err


def test_console_script_refuses_a_malformed_layout_string():
    """Once through the installed ``mcore-reshard`` script, as a user types it."""
    import shutil
    script = shutil.which("mcore-reshard", path=os.path.dirname(sys.executable)) or shutil.which("mcore-reshard")
    if script is None:
        pytest.skip("no mcore-reshard console script (pip install -e . makes it)")
    res = subprocess.run([script, "plan", "--src", "tp=2,,pp", "--dst", "tp=4"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.splitlines() == ["mcore-reshard plan: error: --src 'tp=2,,pp': empty item at character 6 (two "
                                       "commas in a row, or a comma at either end): items are separated by single "
                                       "commas"]


# ----------------------------------------------------------------------------------- errors that name the fix

def _error(capsys, argv) -> str:
    """The one error line of ``mcore-reshard --progress never ARGV`` (steps done before it are logged)."""
    assert main(["--progress", "never", *argv]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if not x.startswith("[mcore-reshard] ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_uneven_pipeline_error_names_first_last_that_work(capsys):
    """61 layers over pp=15: the fix is the first= / last= form, with numbers that split DeepSeek-V3's layers."""
    from mcore_reshard.sources.megatron_spec import stage_layers
    from mcore_reshard.tools import layout_strings
    err = _error(capsys, ["plan", "--model", "dsv3-671b", "--src", "tp=1,pp=15,ep=16", "--dst", "vllm:tp=8"])
    offered = re.findall(r"'(tp=1,pp=15,ep=16,[^']*)' \(stages ([0-9x/]+)\)", err)
    assert [o for o, _ in offered] == ["tp=1,pp=15,ep=16,first=5", "tp=1,pp=15,ep=16,last=5",
                                       "tp=1,pp=15,ep=16,first=5,last=4"], err
    for text, stages in offered:
        split = stage_layers(61, layout_strings.megatron_sizes(layout_strings.parse(text)))
        assert sum(map(len, split)) == 61 and len(split) == 15 and max(map(len, split)) == 5, (text, stages)
    # NeMo RL's published split is the first offer for pp=16
    err = _error(capsys, ["plan", "--model", "dsv3-671b", "--src", "tp=1,pp=16,ep=16", "--dst", "vllm:tp=8"])
    assert "'tp=1,pp=16,ep=16,first=3,last=2' (stages 3/4x14/2)" in err
    err = _error(capsys, ["plan", "--model", "dsv3-671b", "--src", "tp=1,pp=4,first=20,last=20", "--dst", "hf"])
    assert "61 layers cannot be split as first=20 last=20 over pp=4" in err and "'tp=1,pp=4,first=16'" in err
    err = _error(capsys, ["plan", "--model", "dsv3-671b", "--src", "pp=64", "--dst", "hf"])
    assert "pp at most 61" in err
    # on a model small enough to plan here: the first offer plans
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=1,pp=3", "--dst", "vllm:tp=2"])
    (fix,) = re.findall(r"what fits .*?: '([^']+)'", err)
    assert main(["--progress", "never", "plan", "--model", "dsv3-tiny", "--src", fix, "--dst", "vllm:tp=2"]) == 0


def test_unknown_family_error_names_the_families(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "gpt2", "hidden_size": 64}))
    err = _error(capsys, ["plan", "--config", str(cfg), "--src", "tp=1", "--dst", "hf"])
    assert f"--config {cfg}: model_type 'gpt2' is of no family this tool knows; the families there are: " \
           "deepseek_v3 (model_type deepseek_v3, deepseek_v2), llama (model_type llama, qwen2, mistral, qwen3), " \
           "qwen3_moe (model_type qwen3_moe)" in err
    cfg.write_text(json.dumps({"model_type": "mistral", "hidden_size": 64, "vocab_size": 0}))
    err = _error(capsys, ["plan", "--config", str(cfg), "--src", "tp=1", "--dst", "hf"])
    assert "num_hidden_layers missing, vocab_size 0, num_attention_heads missing" in err
    cfg.write_text("[1, 2]")
    assert "a JSON list, not a config object" in _error(capsys, ["plan", "--config", str(cfg), "--src", "tp=1",
                                                                 "--dst", "hf"])


def test_size_that_does_not_fit_names_the_sizes_that_do(capsys):
    """dsv3-tiny: 4 heads, 8 experts, vocabulary 128.  Each offered size plans."""
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=3", "--dst", "vllm:tp=2"])
    assert err.startswith("mcore-reshard plan: error: --src 'tp=3': ") and \
        err.endswith("sizes that fit dsv3-tiny (one changed, the others as given): tp=1|2|4"), err
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=1,ep=3", "--dst", "vllm:tp=2"])
    assert "ep=1|2|4|8" in err
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "vllm:tp=3,dp=2,ep"])
    assert err.startswith("mcore-reshard plan: error: --dst 'vllm:tp=3,dp=2,ep': ") and "tp=1|2|4" in err, err
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=2", "--dst", "sglang:tp=4,dp=3,dpattn"])
    assert "dp=3 must divide tp=4" in err and "dp=1|2|4" in err
    # expert parallelism against the world: the dp values that fit (or none: the smallest)
    err = _error(capsys, ["plan", "--model", "dsv3-tiny", "--src", "tp=1,pp=2,ep=4,dp=3", "--dst", "hf"])
    assert "world 6 = tp*pp*cp*dp is not a multiple of etp*ep*pp = 1*4*2; fits: dp=4|8|12|16... (multiples of 4" \
        in err and "or no dp= (it defaults to the smallest, 4)" in err
    for src, dst in (("tp=4", "vllm:tp=2"), ("tp=1,ep=8", "vllm:tp=2"), ("tp=2", "vllm:tp=4,dp=2,ep"),
                     ("tp=2", "sglang:tp=4,dp=2,dpattn"), ("tp=1,pp=2,ep=4,dp=4", "hf"),
                     ("tp=1,pp=2,ep=4,dp=12", "hf")):
        assert main(["--progress", "never", "plan", "--model", "dsv3-tiny", "--src", src, "--dst", dst]) == 0
    capsys.readouterr()


def test_global_options_before_or_after_the_subcommand(monkeypatch, capsys):
    from mcore_reshard.util import progress
    args = ["--model", "dsv3-tiny", "--src", "tp=2", "--dst", "vllm:tp=2"]
    for argv in (["--progress", "always", "plan", *args], ["plan", *args, "--progress", "always"],
                 ["plan", "--progress", "always", *args]):
        monkeypatch.setattr(progress, "_mode", "never")
        monkeypatch.setenv("MCORE_RESHARD_PROGRESS", "never")
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert "plan: 100%" in err.replace("\r", "\n") and "[mcore-reshard]" not in err, (argv, err)
    for argv in (["--progress", "never", "plan", *args], ["plan", *args, "--progress", "never"]):
        monkeypatch.setattr(progress, "_mode", "always")
        assert main(argv) == 0
        assert "[mcore-reshard] summary" in capsys.readouterr().err, argv
    # given in both places, the one after the subcommand wins; not given after it, the one before stands
    monkeypatch.setattr(progress, "_mode", "always")
    assert main(["--progress", "always", "plan", *args, "--progress", "never"]) == 0
    assert "[mcore-reshard] summary" in capsys.readouterr().err


def test_synthetic_parser_shares_the_layout_string_grammar():
    import pytest

    from mcore_reshard.tools.synthetic import parse_parallel
    assert parse_parallel("tp=2,pp=2,ep=2") == {"tp": 2, "pp": 2, "cp": 1, "ep": 2, "dp": 1, "etp": 2}
    with pytest.raises(ValueError, match="bad size 'tp=0'"):
        parse_parallel("tp=0")
    with pytest.raises(ValueError, match=r"Megatron keys .* not \['vpp'\]"):
        parse_parallel("tp=2,vpp=2")
