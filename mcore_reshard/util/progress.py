"""Progress bars for long CLI work (``tqdm`` on stderr), and the switch that controls them.

``mode`` is ``"auto"`` (bars only when stderr is a terminal), ``"always"`` or ``"never"``; the CLI
sets it from ``--progress`` (or ``MCORE_RESHARD_PROGRESS``); launched ranks inherit it.

Example::

    with bar(total=3, desc="plan") as b:      # [plan] 2/3 ... planning
        b.set_postfix_str("layouts"); b.update()
"""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from tqdm import tqdm

MODES = ("auto", "always", "never")
_mode = os.environ.get("MCORE_RESHARD_PROGRESS", "auto")


def set_mode(mode: str) -> None:
    """Set the mode here and for child processes (launched ranks inherit the environment)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: expected one of {', '.join(MODES)}")
    _mode = os.environ["MCORE_RESHARD_PROGRESS"] = mode


def enabled() -> bool:
    if _mode == "never":
        return False
    return _mode == "always" or sys.stderr.isatty()


def bar(iterable: Iterable | None = None, *, total: int | None = None, desc: str = "", unit: str = "it",
        leave: bool = True, unit_scale: bool = False) -> tqdm:
    """A tqdm bar on stderr, drawn only when :func:`enabled` (a disabled bar still counts)."""
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave, unit_scale=unit_scale,
                file=sys.stderr, disable=not enabled(), dynamic_ncols=True, mininterval=0.2)


class Steps:
    """A task made of ``total`` named steps: a bar advancing per step when bars are enabled, else
    one ``[mcore-reshard] text`` line on stderr per step (logs stay readable without a terminal)."""

    def __init__(self, total: int, desc: str):
        self.bar = bar(total=total, desc=desc, unit="step") if enabled() else None    # None: lines, no tqdm
        self.started = False

    def step(self, text: str) -> None:
        if self.started and self.bar is not None:
            self.bar.update(1)
        self.started = True
        if self.bar is None:
            print(f"[mcore-reshard] {text}", file=sys.stderr, flush=True)
        else:
            self.bar.set_postfix_str(text)

    def close(self) -> None:
        if self.bar is not None:
            if self.started:
                self.bar.update(1)
            self.bar.close()

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MODES", "Steps", "bar", "enabled", "set_mode"]
