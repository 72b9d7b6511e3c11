"""The planner's first fit in C: :mod:`._cfit`, built with the package where a C compiler is at
hand (an optional extension: without one the package installs and plans the same, slower).

``cfit`` is the loaded module, or None: then callers run the Python reference
(:class:`.rounds.RoundFill`, :func:`.placement._fit`), which gives the same rounds item for item
(tests/core/planner/test_planner_cfit.py compares the two).  ``MCORE_RESHARD_PURE_PYTHON=1`` always uses the
Python; a build of another version of the kernel than this code expects (a stale in-place build)
is not used.  An input out of the kernel's ranges (ranks below 2**24, 2**20 instances or messages
of a template, 2**21 rounds, 2 GiB of per-(rank, round) staging counts) raises, and the caller
falls back (:data:`FALLBACK`) to the Python, which plans it the same way."""
from __future__ import annotations

import os

VERSION = 1                 # _cfit.c's CFIT_VERSION
FALLBACK = (ValueError, OverflowError, MemoryError)


def _load():
    if os.environ.get("MCORE_RESHARD_PURE_PYTHON", "") not in ("", "0"):
        return None
    try:
        from . import _cfit
    except ImportError:
        return None
    return _cfit if getattr(_cfit, "VERSION", None) == VERSION else None


cfit = _load()
