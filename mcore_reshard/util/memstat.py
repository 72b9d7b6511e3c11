"""Resident memory of this process from ``/proc/self/status`` (Linux), for the benchmarks.

``reset_peak()`` sets the high-water mark (VmHWM) back to the current resident set, so that
``peak_bytes() - rss_bytes()`` taken before a call is the memory that call added at its peak::

    ok = reset_peak(); before = rss_bytes(); work(); added = peak_bytes() - before if ok else None
"""
from __future__ import annotations


def status_kb(key: str) -> int:
    """The ``key:`` line of ``/proc/self/status`` in kB (-1 when absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return -1


def rss_bytes() -> int:
    return status_kb("VmRSS") * 1024


def peak_bytes() -> int:
    return status_kb("VmHWM") * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
