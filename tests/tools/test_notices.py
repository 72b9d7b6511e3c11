"""Third-party notices no one can act on (util/notices.py: known by category and module) go to a log
file, with one line saying where; every other warning still shows -- in the CLI, in the ranks it
launches and in the set-up (dev.sh: pip / setuptools output, the last import check)."""
from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
import warnings

import pytest
from repo_paths import ROOT

from mcore_reshard.util import notices

TE_APEX = "Transformer Engine and Apex are not installed. Falling back to Torch optimizers."
SITE = sysconfig.get_paths()["purelib"]


def _warn_from(module: str, message: str, category=UserWarning) -> None:
    """``message`` as if ``module`` (a file under site-packages) had warned it."""
    warnings.warn_explicit(message, category, os.path.join(SITE, *module.split(".")) + ".py", 25)


def emit_known_notice(rank: int, world: int) -> int:
    """A launched rank: a known notice (megatron-core's) and one it must not swallow."""
    _warn_from("megatron.core.optimizer.clip_grads", "Transformer Engine and Apex are not installed. (rank)")
    _warn_from("megatron.core.optimizer.clip_grads", "act on me (rank)")
    return rank


def test_known_notices_go_to_the_log_every_other_warning_shows(tmp_path):
    log = tmp_path / "notices.log"
    shown = []
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, category, *a, **k: shown.append((category, str(message)))
        with notices.captured(str(log)) as kept:
            assert os.environ[notices.ENV] == str(log)
            _warn_from("megatron.core.optimizer", TE_APEX)                                    # known: logged
            _warn_from("megatron.core.hyper_comm_grid", "absl.logging is not installed. Using logging")
            _warn_from("megatron.core.optimizer", TE_APEX, DeprecationWarning)                # other category
            _warn_from("thirdparty.module", TE_APEX)                                          # other module
            _warn_from("megatron.core.optimizer", "learning rate 1e9 looks wrong")            # other message
            _warn_from("megatron.core.models.gpt.gpt_layer_specs", "Apex is not installed. Falling back to Torch Norm")
            cpp = logging.getLogger("torch.utils.cpp_extension")
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            cpp.addHandler(handler)
            try:
                cpp.warning("No CUDA runtime is found, using CUDA_HOME='/usr/local'")         # known: logged
                cpp.warning("building extension foo")                                          # shows
            finally:
                cpp.removeHandler(handler)
        assert [r.getMessage() for r in records] == ["building extension foo"]
        assert shown == [(DeprecationWarning, TE_APEX), (UserWarning, TE_APEX),
                         (UserWarning, "learning rate 1e9 looks wrong")]
        assert warnings.showwarning is not before            # the test's recorder again, the hook gone
    assert notices.ENV not in os.environ or os.environ[notices.ENV] != str(log)
    lines = log.read_text().splitlines()
    assert lines == [f"megatron.core.optimizer:25: UserWarning: {TE_APEX}",
                     "megatron.core.hyper_comm_grid:25: UserWarning: absl.logging is not installed. Using logging",
                     "megatron.core.models.gpt.gpt_layer_specs:25: UserWarning: Apex is not installed. Falling back "
                     "to Torch Norm",
                     "torch.utils.cpp_extension: WARNING: No CUDA runtime is found, using CUDA_HOME='/usr/local'"]
    assert kept.summary() == f"4 third-party notices (nothing to act on) kept in {log}"
    assert notices.Captured(str(tmp_path / "none.log")).summary() is None      # a quiet run: no log, no line


@pytest.mark.multiproc
def test_cli_keeps_known_notices_of_its_ranks_in_the_log_and_says_where(tmp_path, monkeypatch, capfd):
    """The demo's path: ``mcore-reshard`` runs the command, the command launches ranks; their known
    notices go to one log, the unknown ones show, the last line says where the log is."""
    from mcore_reshard.tools import cli
    from mcore_reshard.tools.launch import spawn
    log = tmp_path / "notices.log"
    monkeypatch.setenv(notices.ENV, str(log))

    def command(args) -> int:
        _warn_from("megatron.core.optimizer.optimizer", TE_APEX)
        _warn_from("megatron.core.optimizer.optimizer", "act on me (parent)")
        assert spawn(emit_known_notice, 1, timeout=300) == [0]
        return 0
    monkeypatch.setattr(cli, "cmd_demo", command)
    with pytest.warns(UserWarning) as seen:           # what this process shows (pytest records it)
        assert cli.main(["--progress", "never", "demo"]) == 0
    assert [str(w.message) for w in seen] == ["act on me (parent)"]
    err = capfd.readouterr().err                      # the rank's stderr too
    assert "Transformer Engine" not in err and "UserWarning: act on me (rank)" in err, err
    assert err.splitlines()[-1] == f"[mcore-reshard] 2 third-party notices (nothing to act on) kept in {log}"
    assert [x.split(": ", 2)[2] for x in log.read_text().splitlines()] == [
        TE_APEX, "Transformer Engine and Apex are not installed. (rank)"]


def _fake_venv(tmp_path, pip_exit: int = 0):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    pip = venv / "bin" / "pip"
    pip.write_text("#!/bin/sh\necho '  DEPRECATION: Legacy editable install of mcore-reshard (setuptools)'\n"
                   "echo 'WARNING: Location' >&2\nexit %d\n" % pip_exit)
    pip.chmod(0o755)
    python = venv / "bin" / "python"            # this interpreter, as the venv's (its own site-packages)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return venv


def _dev_sh(script: str, venv) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", f"source ./dev.sh && {script}"], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "V": str(venv)}, timeout=300)


def test_setup_keeps_pip_output_in_its_log_and_says_where(tmp_path):
    venv = _fake_venv(tmp_path)
    res = _dev_sh('pip_logged "$V" install -q -e . && log_line "$V"', venv)
    assert res.returncode == 0 and res.stdout == ""
    assert res.stderr == f"[dev.sh] set-up output (pip, setuptools, third-party notices): {venv}/setup.log\n"
    assert "DEPRECATION: Legacy editable install" in (venv / "setup.log").read_text()
    failing = _fake_venv(tmp_path / "f", pip_exit=3)
    res = _dev_sh('pip_logged "$V" install -q -e .', failing)
    assert res.returncode == 3
    assert res.stderr.startswith(f"[dev.sh] pip install -q -e . failed (exit 3); the end of {failing}/setup.log:\n")
    assert "DEPRECATION: Legacy editable install" in res.stderr       # shown when pip fails


@pytest.mark.megatron
def test_setup_check_keeps_megatron_notices_in_its_log(tmp_path):
    """The set-up's last step imports megatron-core: its 'Transformer Engine and Apex are not installed'
    (x4), absl and torch's 'No CUDA runtime' go to the log; a warning someone can act on still shows."""
    if importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    venv = _fake_venv(tmp_path)
    (tmp_path / "act_on_me.py").write_text("import warnings\nwarnings.warn('act on me: set X')\n")
    env_path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run(["bash", "-c", 'source ./dev.sh && check_imports "$V" megatron.core, act_on_me'], cwd=ROOT,
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "V": str(venv), "PYTHONPATH": env_path})
    assert res.returncode == 0, res.stderr
    for noise in ("Transformer Engine", "Apex", "absl", "No CUDA runtime"):
        assert noise not in res.stderr, res.stderr
    assert "UserWarning: act on me: set X" in res.stderr
    kept = (venv / "setup.log").read_text()
    assert kept.count("Transformer Engine and Apex are not installed") == 4 and "absl.logging" in kept, kept
