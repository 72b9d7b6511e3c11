"""Deprecated aliases for this release: the flat module paths of mcore-reshard 0.1.

``import mcore_reshard.planner`` (or ``from mcore_reshard.executor import Resharder``) still works and
gives the very module now at its new path (``mcore_reshard.core.planner``), with a
``DeprecationWarning``.  Nothing inside the package imports an old path; new code should not either.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

#: old flat module -> its home now (relative to ``mcore_reshard``)
ALIASES = {
    "box": "core.box", "mesh": "core.mesh", "layout": "core.layout", "dtensor": "core.dtensor",
    "planner": "core.planner", "executor": "core.executor",
    "family": "mapper.family",
    "megatron_model": "sources.megatron_model", "megatron_spec": "sources.megatron_spec",
    "megatron_dtensor": "sources.megatron_dtensor", "hf_model": "sources.hf_model",
    "fp8_layout": "fp8.layout", "fp8_plan": "fp8.plan", "fp8_refit": "fp8.refit",
    "cli": "tools.cli", "demo": "tools.demo", "synthetic": "tools.synthetic", "layout_strings": "tools.layout_strings",
    "costmodel": "tools.costmodel", "progress": "tools.progress", "memstat": "tools.memstat",
    "launch": "tools.launch", "bench": "tools.bench", "bench_live": "tools.bench.live",
}
_PREFIX = "mcore_reshard."


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``mcore_reshard.<old>`` to the module at ``mcore_reshard.<new>`` (same object)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX):] in ALIASES:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        old = spec.name[len(_PREFIX):]
        new = _PREFIX + ALIASES[old]
        warnings.warn(f"{spec.name} is deprecated: import {new}", DeprecationWarning, stacklevel=3)
        module = importlib.import_module(new)
        spec.loader_state = module.__spec__     # the import system overwrites __spec__ next: put it back
        return module

    def exec_module(self, module):
        module.__spec__ = module.__spec__.loader_state if module.__spec__.loader is self else module.__spec__


def install() -> None:
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
