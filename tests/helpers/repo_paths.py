"""Where things are in a repository checkout, for tests that launch scripts or read files by path.

    ROOT          the repository (examples/, benchmarks/, the engine venvs .venv-vllm, ...)
    TESTS_DIR     ROOT/tests
    HELPERS_DIR   ROOT/tests/helpers (this folder: workers, launchers, cases)
    ENGINES_DIR   ROOT/tests/engines (the real-engine launch scripts)
    EXAMPLES_DIR  ROOT/examples
"""
from __future__ import annotations

import os

HELPERS_DIR = os.path.dirname(os.path.abspath(__file__))
TESTS_DIR = os.path.dirname(HELPERS_DIR)
ROOT = os.path.dirname(TESTS_DIR)
ENGINES_DIR = os.path.join(TESTS_DIR, "engines")
EXAMPLES_DIR = os.path.join(ROOT, "examples")
