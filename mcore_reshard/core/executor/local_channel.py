"""The control channel between two processes on one device: a Unix socket carrying small JSON
messages and, with them, file descriptors (``SCM_RIGHTS``: the shared-memory storages).

The listening side owns the socket file while it listens: :class:`Listener` refuses a path another
live process listens on (:class:`ChannelBusy` naming it), removes a stale one a crashed process
left, and removes its own on :meth:`Listener.close`.  Every wait is
bounded: a peer that dies closes the socket (``EOF``: :class:`ChannelClosed`), a peer that stalls
past the deadline raises :class:`ChannelTimeout`; both name the peer."""
from __future__ import annotations

import json
import os
import socket
import struct
import time

from .errors import ReshardError

_HEADER = struct.Struct("!II")          # JSON bytes, descriptors that follow
_FDS_PER_MESSAGE = 200


class ChannelError(ReshardError):
    """The channel's peer is gone or did not answer in time."""


class ChannelClosed(ChannelError):
    pass


class ChannelTimeout(ChannelError):
    pass


class ChannelBusy(ReshardError):
    """Another live process listens on the path."""


def _recv_exact(sock: socket.socket, n: int, deadline: float, who: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelTimeout(f"{who} sent nothing within the timeout")
        sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(out))
        except socket.timeout:
            raise ChannelTimeout(f"{who} sent nothing within the timeout") from None
        except OSError as e:
            raise ChannelClosed(f"{who} closed the channel ({e})") from None
        if not chunk:
            raise ChannelClosed(f"{who} closed the channel (its process ended or left)")
        out += chunk
    return bytes(out)


class Channel:
    """One connected end: :meth:`send` a JSON-able object (and descriptors), :meth:`recv` the next."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock = sock
        self.peer = peer

    def send(self, obj, fds: list[int] = ()) -> None:
        data = json.dumps(obj).encode()
        try:
            self.sock.settimeout(None)
            self.sock.sendall(_HEADER.pack(len(data), len(fds)) + data)
            for i in range(0, len(fds), _FDS_PER_MESSAGE):
                part = list(fds[i:i + _FDS_PER_MESSAGE])
                socket.send_fds(self.sock, [b"F"], part)
        except OSError as e:
            raise ChannelClosed(f"{self.peer} closed the channel ({e})") from None

    def recv(self, timeout: float) -> tuple[object, list[int]]:
        deadline = time.monotonic() + timeout
        size, nfds = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size, deadline, self.peer))
        obj = json.loads(_recv_exact(self.sock, size, deadline, self.peer))
        fds: list[int] = []
        while len(fds) < nfds:
            want = min(_FDS_PER_MESSAGE, nfds - len(fds))
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                msg, got, _flags, _addr = socket.recv_fds(self.sock, 1, want)
            except socket.timeout:
                _close_all(fds)
                raise ChannelTimeout(f"{self.peer} sent {len(fds)} of {nfds} descriptors within the timeout") from None
            if not msg:
                _close_all(fds + list(got))
                raise ChannelClosed(f"{self.peer} closed the channel while sending descriptors")
            fds += list(got)
        return obj, fds

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _close_all(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Listener:
    """Listens on ``path`` (owned while listening, see the module docstring)."""

    def __init__(self, path: str):
        if not isinstance(path, str) or not path or len(path.encode()) > 100:
            raise ValueError(f"channel={path!r}: a socket path of at most 100 bytes")
        self.path = path
        if os.path.exists(path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(path)
            except OSError:               # nobody listens: a crashed process's left-over
                os.unlink(path)
            else:
                raise ChannelBusy(f"channel {path}: another live process listens on it (two colocated pairs "
                                  f"given one channel?); give each pair its own")
            finally:
                probe.close()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self._ino = os.stat(path).st_ino
        self.sock.listen(1)

    def accept(self, timeout: float, who: str) -> Channel:
        self.sock.settimeout(timeout)
        try:
            conn, _ = self.sock.accept()
        except socket.timeout:
            raise ChannelTimeout(f"{who} did not connect to {self.path} within {timeout:g} s") from None
        return Channel(conn, who)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            try:
                if os.stat(self.path).st_ino == self._ino:     # ours, not a successor's
                    os.unlink(self.path)
            except OSError:
                pass


def connect(path: str, timeout: float, who: str) -> Channel:
    """Connects to the listener at ``path``, retrying until ``timeout`` (it may not listen yet)."""
    if not isinstance(path, str) or not path or len(path.encode()) > 100:
        raise ValueError(f"channel={path!r}: a socket path of at most 100 bytes")
    deadline = time.monotonic() + timeout
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            return Channel(sock, who)
        except OSError as e:
            sock.close()
            if time.monotonic() >= deadline:
                raise ChannelTimeout(f"{who} was not listening on {path} within {timeout:g} s ({e})") from None
            time.sleep(0.05)
