"""The contract suite at the integration level, generated from tests/helpers/integration_contract_cases.py:
each public argument of ``hf_config`` and its helpers, ``integrations.protocol``, the vLLM worker
extension and weight-transfer engine (their own validation, on a stand-in worker), the SGLang
loader and the CLI x each class of bad value that applies, in process; ``export_hf``, ``join_refit``
and FP8 in transit (``Fp8Resharder``) in one 2-rank gloo launch (tests/helpers/collective_contract_workers.py).
Closed-world, generated from the tables themselves: every ``TransformerConfig`` / ``MLATransformerConfig``
setting the transformers mapping does not read, set to another value (refused naming it, or the same config),
and every field of the transformers configs the layouts' reader (``targets.from_hf_config``) meets.

A case passes when it is ``refused`` (the library's own error types, or a ValueError / TypeError
naming the argument; the CLI: exit code 2 and a message naming the option, no traceback) or
``ok`` (a value the contract accepts, with a result; ``strict`` cases: the library's own error must name the
argument too; ``must_accept`` cases: any error fails); a raw KeyError / IndexError /
AttributeError / torch error, a message naming nothing, or a bad value accepted (``silent``)
fails it.  A module fixture prints the counts per API once the module has run (RELIABILITY.md, "Generated contract suite").
"""
from __future__ import annotations

import os
import subprocess
import sys

import integration_contract_cases as ic
import pytest

COUNTS_LABEL = "integration contract suite"
TMP = "/tmp/mcore-reshard-contract-never"     # file:// stores no case may reach (every join is refused first)


def _table(factory):
    try:
        return factory()
    except ImportError as e:      # megatron-core / transformers missing: the tables that need them are skipped
        pytest.skip(f"needs {e.name}")


def _ids(cases):
    return [f"{c.api}-{c.argument}-{c.kind}".replace(" ", "_") for c in cases]


def _check(case, count):
    o = ic.record(case.run)
    verdict = ic.judge(o, case.argument.split("[")[-1].rstrip("]"), case.must_refuse, case.strict, case.must_accept)
    count(case.api, verdict)
    assert verdict in ("refused", "ok"), (verdict, o)


HF = ic.hf_config_cases()
HF_FIELDS = ic.hf_field_cases()
PROTO = ic.protocol_cases(TMP)
ENGINES = ic.engine_cases(TMP)


@pytest.mark.parametrize("case", HF, ids=_ids(HF))
def test_hf_config(case, counts):
    _check(case, counts)


@pytest.mark.parametrize("case", HF_FIELDS, ids=_ids(HF_FIELDS))
def test_hf_config_reader(case, counts):
    _check(case, counts)


@pytest.mark.parametrize("case", PROTO, ids=_ids(PROTO))
def test_protocol(case, counts):
    _check(case, counts)


@pytest.mark.parametrize("case", ENGINES, ids=_ids(ENGINES))
def test_engine_entry_points(case, counts):
    _check(case, counts)


@pytest.mark.parametrize("case", ic.CLI_CASES, ids=["-".join(c[:3]) for c in ic.CLI_CASES])
def test_cli(case, tmp_path, counts):
    command, option, kind, argv = case
    not_json = tmp_path / "config.json"
    not_json.write_text("{not json")
    o = ic.run_cli(argv, str(not_json))
    verdict = ic.judge_cli(o, option)
    counts(f"mcore-reshard {command}" if command != "-" else "mcore-reshard", verdict)
    assert verdict == "refused", (verdict, o)


def test_cli_entry_point_help_and_a_bad_value(counts):
    """The installed entry point itself (a new process): --help exits 0, a bad value exits 2 naming it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ok = subprocess.run([sys.executable, "-m", "mcore_reshard.tools.cli", "--help"], capture_output=True, text=True,
                        env=env, timeout=120)
    assert ok.returncode == 0 and "usage: mcore-reshard" in ok.stdout, ok.stderr[-500:]
    bad = subprocess.run([sys.executable, "-m", "mcore_reshard.tools.cli", "plan", "--budget-mib", "nan"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "budget" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-800:]
    counts("mcore-reshard (process)", "refused")


@pytest.fixture(scope="module")
def collective_results():
    import collective_contract_workers as cw
    from partial_launch import spawn_ok
    return spawn_ok(cw.collective_cases, 2, timeout=600, pg_timeout=120)


def _collective_table():
    try:
        import collective_contract_workers as cw
    except ImportError as e:      # pragma: no cover - megatron-core missing
        pytest.skip(f"needs {e.name}")
    return cw.TABLE


COLLECTIVE = _collective_table()
# values the contract accepts: an fp32 source of FP8 in transit (documented: BF16 or fp32 sources), and a
# source tensor the plan never reads (sources are only read: a model's MTP weights when MTP is not refit)
COLLECTIVE_ACCEPTED = {("Fp8Resharder", "src", "wrong_dtype"), ("Fp8Resharder", "src", "extra"),
                       ("export_hf", "memory_bytes", "one")}     # documented: one shard per tensor


@pytest.mark.multiproc
@pytest.mark.parametrize("case", COLLECTIVE, ids=lambda c: "-".join(c))
def test_collective(collective_results, case, counts):
    """export_hf / join_refit / Fp8Resharder: every rank passes the same bad value; refused on every rank,
    alike, before a destination byte changed (export: no index written)."""
    api, arg, kind = case
    outcomes = [r["|".join(case)] for r in collective_results]
    verdicts = set()
    for o in outcomes:
        v = ic.judge(o, arg, case not in COLLECTIVE_ACCEPTED)
        if v == "refused" and not o["dst_untouched"]:
            v = "late"
        verdicts.add(v)
    v = "/".join(sorted(verdicts))
    counts(api, v)
    assert v in ("refused", "ok"), (v, outcomes)

