"""``paused_gc``: the cyclic garbage collector paused while layouts or plans are built.

Building a full-size layout or plan allocates millions of small acyclic objects (boxes, pieces,
buffers, copy tuples); every few hundred allocations the collector rescans the young objects, and
every so often the whole (large, long-lived) heap, for nothing: 15-55% of a full-size layout build
(BENCHMARKS.md A.2).  Nothing here makes cycles, so pausing loses nothing; the collector's
state is restored on exit (it nests: an inner pause leaves an outer one in place)."""
from __future__ import annotations

import functools
import gc


class paused_gc:
    """Context manager and decorator: ``with paused_gc(): ...`` or ``@paused_gc()``."""

    def __enter__(self):
        self.was = gc.isenabled()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self.was:
            gc.enable()
        return False

    def __call__(self, fn):
        @functools.wraps(fn)
        def run(*a, **kw):
            with paused_gc():
                return fn(*a, **kw)
        return run
