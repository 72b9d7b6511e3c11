"""Third-party notices a user cannot act on, kept out of their way: written to a log file instead
of stderr.  Every other warning shows as usual.

A notice is known by its category and the module that issues it (and the start of its message):
:data:`KNOWN` for :mod:`warnings`, :data:`KNOWN_LOGS` for :mod:`logging` records.  Nothing else is
touched: no filter is added to :mod:`warnings`, only its ``showwarning`` is wrapped, and an
unknown warning (a deprecation in this package, a warning the user's own code raises) is shown
as before.  Example, importing megatron-core on a machine without a GPU::

    with captured() as c:           # the CLI runs every command so; the ranks it launches inherit it
        import megatron.core        # 4 x "Transformer Engine and Apex are not installed", absl: to the log
    c.summary()  ->  "5 third-party notices (nothing to act on) kept in /tmp/mcore-reshard-0/notices-4242.log"

The log (one per run, made on the first notice: a quiet run leaves none) is named by the process
that captures; processes it starts append to the same file (``MCORE_RESHARD_NOTICES_LOG``: a
launched rank calls :func:`capture`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass

ENV = "MCORE_RESHARD_NOTICES_LOG"


@dataclass(frozen=True)
class Notice:
    """A known third-party notice: its ``category``, the ``module`` issuing it (regex on the dotted
    name), the start of its ``message`` (regex) and ``why`` no one can act on it here."""
    category: type
    module: str
    message: str
    why: str

    def matches(self, category: type, module: str, message: str) -> bool:
        return (issubclass(category, self.category) and re.fullmatch(self.module, module) is not None
                and re.match(self.message, message) is not None)


@dataclass(frozen=True)
class LogNotice:
    """A known third-party :mod:`logging` record: its ``logger``, ``level`` and the start of its ``message``."""
    logger: str
    level: int
    message: str
    why: str


KNOWN = (
    Notice(UserWarning, r"megatron\.core(\..+)?", r"Transformer Engine and Apex are not installed",
           "megatron-core falls back to its own kernels: there are no fused GPU kernels on this machine to install"),
    Notice(UserWarning, r"megatron\.core(\..+)?", r"Apex is not installed\. Falling back to Torch Norm",
           "the same fallback, for layer norms"),
    Notice(UserWarning, r"megatron\.core\.hyper_comm_grid", r"absl\.logging is not installed",
           "megatron-core logs through Python's logging instead: nothing is lost"),
)
KNOWN_LOGS = (
    LogNotice("torch.utils.cpp_extension", logging.WARNING, r"No CUDA runtime is found",
              "a CPU machine: the CUDA extensions torch looks for are not needed"),
)


def log_path() -> str:
    """This run's log file (made by the first notice)."""
    path = os.environ.get(ENV)
    if not path:
        import tempfile
        folder = os.path.join(tempfile.gettempdir(), f"mcore-reshard-{os.getuid() if hasattr(os, 'getuid') else 0}")
        path = os.path.join(folder, f"notices-{os.getpid()}.log")
    return path


def _module_of(filename: str) -> str:
    """The dotted module name of a source file, from the longest ``sys.path`` entry holding it."""
    filename = os.path.abspath(filename)
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or ".")
        if filename.startswith(root + os.sep) and len(root) > len(best):
            best = root
    rel = filename[len(best) + 1:] if best else os.path.basename(filename)
    rel = rel[:-3] if rel.endswith(".py") else rel
    mod = rel.replace(os.sep, ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


class _Capture:
    """The installed hook: known notices written to the log, counted; the rest to the previous ``showwarning``."""

    def __init__(self, path: str):
        self.path = path
        self.count = 0
        self.shown = warnings.showwarning

    def write(self, line: str) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:      # one short append: whole lines from every rank
            f.write(line.rstrip("\n").replace("\n", " ") + "\n")
        self.count += 1

    def showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        module = _module_of(filename)
        text = str(message)
        if file is None and any(k.matches(category, module, text) for k in KNOWN):
            self.write(f"{module}:{lineno}: {category.__name__}: {text}")
            return
        self.shown(message, category, filename, lineno, file, line)


class _LogFilter(logging.Filter):
    def __init__(self, capture: _Capture, notice: LogNotice):
        super().__init__()
        self.capture, self.notice = capture, notice

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == self.notice.level and re.match(self.notice.message, record.getMessage()):
            self.capture.write(f"{record.name}: {logging.getLevelName(record.levelno)}: {record.getMessage()}")
            return False
        return True


class Captured:
    """Known notices of this process (and of those it starts, through ``MCORE_RESHARD_NOTICES_LOG``)
    going to ``path`` while installed (:func:`captured`, :func:`capture`)."""

    def __init__(self, path: str):
        self.hook = _Capture(path)
        self.path = path
        self.filters = [(logging.getLogger(n.logger), _LogFilter(self.hook, n)) for n in KNOWN_LOGS]
        self.env = os.environ.get(ENV)

    def install(self) -> "Captured":
        os.environ[ENV] = self.path
        warnings.showwarning = self.hook.showwarning
        for logger, f in self.filters:
            logger.addFilter(f)
        return self

    def uninstall(self) -> None:
        if warnings.showwarning == self.hook.showwarning:
            warnings.showwarning = self.hook.shown
        for logger, f in self.filters:
            logger.removeFilter(f)
        if self.env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self.env

    def summary(self) -> str | None:
        """One line saying how many notices the log holds and where, or None when there are none."""
        if not os.path.exists(self.path):
            return None
        with open(self.path, encoding="utf-8") as f:
            n = sum(1 for _ in f)
        return f"{n} third-party notice{'s' if n != 1 else ''} (nothing to act on) kept in {self.path}"


@contextlib.contextmanager
def captured(path: str | None = None):
    """``with captured() as c: ...``: known notices go to the log while inside (``c.summary()`` says
    how many and where); on leaving, everything is as it was."""
    c = Captured(path or log_path()).install()
    try:
        yield c
    finally:
        c.uninstall()


_installed: Captured | None = None


def capture(path: str | None = None) -> Captured:
    """:func:`captured` for the rest of this process (a launched rank); idempotent."""
    global _installed
    if _installed is None:
        _installed = Captured(path or log_path()).install()
    return _installed


__all__ = ["ENV", "KNOWN", "KNOWN_LOGS", "Captured", "LogNotice", "Notice", "capture", "captured", "log_path"]
