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

import os
import sys

HELPERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers")
if HELPERS_DIR not in sys.path:
    sys.path.insert(0, HELPERS_DIR)
