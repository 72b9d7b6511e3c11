"""A directory written by one writer at a time, left complete or absent: the export's output.

``OwnedDirectory(path).acquire()`` takes an exclusive lock next to ``path`` (``.<name>.lock``, an
``flock`` the kernel releases when the process dies, so a crashed writer never leaves it held) and
hands out a fresh staging directory beside it (``.<name>.staging-<token>``, same file system).  The
writer fills the staging directory; ``commit()`` moves the files of ``path`` that the writer does
not own (a tokenizer, a README) into it as hard links, then swaps it into place with two renames
(``path`` -> ``.<name>.old-<token>``, staging -> ``path``) and removes the old one.  ``abort()``
removes the staging directory.  Either way the lock is released.

What a reader of ``path`` can see, whatever happens to the writer (SIGKILL included):

    moment                         path holds
    before commit                  the previous contents (or nothing), untouched
    between the two renames        nothing (absent) -- a few microseconds
    after commit                   the new contents, complete

A second writer, while the first holds the lock, gets :class:`DirectoryBusy` naming the directory
and the owner (pid, host, since when, what).  Left-overs of a crashed writer (a staging directory,
an ``.old-`` one whose swap was cut between the renames) are cleaned, or the old contents put back,
by the next writer once it holds the lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import socket
import time
from typing import Callable


class DirectoryBusy(RuntimeError):
    """Another writer owns the directory."""


class OwnedDirectory:
    """Exclusive, all-or-nothing writing of the directory ``path`` (see the module docstring).

    ``owned(name)``: True for the entries of ``path`` that belong to the writer (an earlier writer's
    files that this one does not write again are dropped, not carried over); every other entry of
    ``path`` is carried over into the new contents.  ``what``: a line saying who writes (shown to a
    second writer)."""

    def __init__(self, path: str | os.PathLike, owned: Callable[[str], bool] | None = None, what: str = ""):
        self.path = os.path.abspath(os.fspath(path))
        self.parent, self.name = os.path.split(self.path)
        self.owned = owned
        self.what = what
        self.lock_path = os.path.join(self.parent, f".{self.name}.lock")
        self.staging: str | None = None
        self._fd: int | None = None

    # ------------------------------------------------------------------ lock

    def acquire(self) -> "OwnedDirectory":
        """Take the lock, clean a crashed writer's left-overs, create the staging directory.
        :class:`DirectoryBusy` if another writer holds the lock; OSError if the parent cannot be written."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise NotADirectoryError(errno.ENOTDIR, f"{self.path} exists and is not a directory")
        os.makedirs(self.parent, exist_ok=True)
        while True:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                raise DirectoryBusy(f"{self.path} is being written by another writer ({owner}); wait for it to "
                                    "finish, or write elsewhere") from None
            except BaseException:
                os.close(fd)
                raise
            # the holder before us may have removed the lock file after we opened it: lock the file at the path
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                                      "what": self.what}).encode(), 0)
            self._recover()
            self.staging = os.path.join(self.parent, f".{self.name}.staging-{secrets.token_hex(6)}")
            os.mkdir(self.staging)
        except BaseException:
            self._release()
            raise
        return self

    def _release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.lock_path)     # while still holding it: a writer that opened it re-opens (inode check)
        except FileNotFoundError:
            pass
        os.close(self._fd)                # releases the flock
        self._fd = None

    def _recover(self) -> None:
        """Left-overs of a crashed writer (only the lock holder gets here): a swap cut between its two
        renames is finished backwards (the old contents put back), staging directories are removed."""
        for entry in sorted(os.listdir(self.parent)):
            full = os.path.join(self.parent, entry)
            if entry.startswith(f".{self.name}.old-"):
                if not os.path.exists(self.path):
                    os.rename(full, self.path)
                else:
                    shutil.rmtree(full, ignore_errors=True)
            elif entry.startswith(f".{self.name}.staging-"):
                shutil.rmtree(full, ignore_errors=True)

    # ------------------------------------------------------------------ the end

    def commit(self) -> None:
        """Swap the staging directory into place (carrying over what the writer does not own), release."""
        if self.staging is None or self._fd is None:
            raise RuntimeError(f"{self.path}: commit() without acquire()")
        try:
            written = set(os.listdir(self.staging))
            for f in written:
                _fsync(os.path.join(self.staging, f))
            old = None
            if os.path.isdir(self.path):
                self._carry_over(written)
                old = os.path.join(self.parent, f".{self.name}.old-{secrets.token_hex(6)}")
                os.rename(self.path, old)
            _fsync(self.staging)
            try:
                os.rename(self.staging, self.path)
            except BaseException:
                if old is not None:
                    os.rename(old, self.path)      # the previous contents back
                raise
            _fsync(self.parent)
            self.staging = None
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            self.abort()

    def _carry_over(self, written: set[str]) -> None:
        for entry in os.listdir(self.path):
            if entry in written or (self.owned is not None and self.owned(entry)):
                continue
            src, dst = os.path.join(self.path, entry), os.path.join(self.staging, entry)
            if os.path.isdir(src) and not os.path.islink(src):
                shutil.copytree(src, dst, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(src, dst)

    def abort(self) -> None:
        """Remove the staging directory (``path`` keeps its previous contents) and release the lock."""
        if self.staging is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        self._release()

    def __enter__(self) -> "OwnedDirectory":
        return self.acquire() if self._fd is None else self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _read_owner(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "owner unknown"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    what = f", {info['what']}" if info.get("what") else ""
    return f"pid {info.get('pid')} on host {info.get('host')} since {since}{what}"


def _link_or_copy(src: str, dst: str) -> str:
    try:
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _fsync(path: str) -> None:
    """Flush a file or a directory to disk (a power cut after the rename then still finds the data)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["DirectoryBusy", "OwnedDirectory"]
