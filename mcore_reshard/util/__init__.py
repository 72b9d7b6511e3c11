"""Utilities under every layer, with no resharding logic: they import nothing else of the package.

* :mod:`.progress` -- progress bars on stderr (``tqdm``) and the switch that controls them;
* :mod:`.memstat` -- resident memory and its peak from ``/proc/self/status`` (export and benchmarks);
* :mod:`.notices` -- third-party notices no one can act on (known by category and module) kept in a
  log file instead of on stderr (the CLI and the processes it launches).
"""
