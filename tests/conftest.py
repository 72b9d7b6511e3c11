"""The one place that makes tests/helpers importable by plain module name (``import workers``,
``from partial_launch import launch``) from every test folder.

Test folders have no ``__init__.py`` and pytest runs in its default ("prepend") import mode: each test
module is imported under its basename with its own folder on ``sys.path``, so test basenames are unique
across the whole tree (pytest refuses a second ``test_x.py`` with "import file mismatch"), and test
modules of one folder import each other (``from test_planner_properties import check_plan``).  Worker
functions handed to spawned gloo processes are pickled by module name (``workers.executor_scenarios``);
the children inherit this ``sys.path``, so they find the same modules.  Scripts started as their own
program (tests/engines/engine_worker.py under torchrun, vllm_engine_e2e.py) put tests/helpers on their
path themselves (see :mod:`repo_paths`)."""
from __future__ import annotations

import json
import os
import sys

import pytest

HELPERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS_DIR not in sys.path:
    sys.path.insert(0, HELPERS_DIR)


@pytest.fixture(scope="module")
def counts(request):
    """``counts(*keys, verdict)`` tallies one case's verdict in a nested dict; the tally is printed once
    the module has run, headed by the module's ``COUNTS_LABEL`` (a summary for RELIABILITY.md's
    tables, not a test: the generated contract suites and the fault matrix use it)."""
    tally: dict = {}

    def count(*keys_and_verdict: str) -> None:
        *keys, verdict = keys_and_verdict
        node = tally
        for k in keys:
            node = node.setdefault(k, {})
        node[verdict] = node.get(verdict, 0) + 1
    yield count
    if tally:
        label = getattr(request.module, "COUNTS_LABEL", request.module.__name__)
        with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
            print(f"\n{label}:", json.dumps(tally, sort_keys=True))
