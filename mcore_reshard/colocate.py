"""Colocated refits: the trainer rank and the engine worker of one device in two processes, no process
group between them (:mod:`mcore_reshard.core.devices` says which group rank each process has).

The engine worker *proxies* its device's trainer rank: the trainer exports the storages of its
bound tensors once (:class:`ColocatedTrainer`; CPU shared memory / CUDA IPC, see
:mod:`mcore_reshard.core.executor.shared_storage`), the worker maps them (:func:`accept_trainer`)
and joins the refit's group with that trainer rank's layout part as its own source part.  The plan
then makes every same-device byte a local copy out of the mapped memory and sends only what crosses
devices over the group.  Per refit, over the pair's Unix-socket channel::

    trainer process (not a group member)       | engine worker (group rank r)
    refit(v): identity checked, moved storages | refit: its watcher waits for "ready" (half the
      exported again; "ready" (refusals)  ---> |   timeout), follows remapped storages or refuses
      waits for "done" (the timeout)           |   on every rank before a byte moves; local copies
                                        <---   |   + the group's rounds; "done" (ok or the error)
    returns; may now write its weights         |

The trainer blocks in :meth:`ColocatedTrainer.refit` until the worker has finished reading, so its
buffers are never changed under the copy.  A trainer process that dies or never starts its refit is
reported by its worker to every rank of the group (refused before a byte moves); a worker that dies
makes the trainer's ``refit`` raise at once (the socket closes), one that stalls within the timeout;
each error names the device and the peer's pid.

Example, trainer TP2 on devices a, b; engine TP=1 on a (``DeviceMap(["a", "b"], ["a"])``: trainer
rank 1 is group rank 0, the worker group rank 1)::

    trainer rank 0: t = ColocatedTrainer.megatron(chunks, 0, channel=path_a, device="a")
                    t.refit()                                       # after each optimizer step
    trainer rank 1: r = MegatronRefit(chunks, [], group=g)          # g: {trainer 1, worker}
    worker:         r = MegatronRefit([], dst_chunks, group=g, colocated={"channel": path_a, "device": "a"})
"""
from __future__ import annotations

import os
import time
from typing import Mapping

import torch

from .core.executor.errors import ReshardError, TransferError
from .core.executor.local_channel import Channel, ChannelClosed, ChannelError, Listener, connect
from .core.executor.shared_storage import MappedStorages, export_tensors, moved
from .core.layout import Layout
from .util.identity import identity_of

DEFAULT_TIMEOUT = 120.0


def check_colocated(value, what: str = "colocated") -> dict | None:
    """``None`` or ``{"channel": socket path, "device": device key}`` (ValueError / TypeError naming the
    argument otherwise)."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{what}={value!r:.80}: a dict {{'channel': path, 'device': key}} or None")
    extra = set(value) - {"channel", "device"}
    if extra or not {"channel", "device"} <= set(value):
        raise ValueError(f"{what}={dict(value)!r:.120}: keys 'channel' (a socket path) and 'device' (a device key), "
                         f"{'unknown: ' + str(sorted(extra)) if extra else 'both required'}")
    for k in ("channel", "device"):
        if not isinstance(value[k], str) or not value[k]:
            raise ValueError(f"{what}[{k!r}]={value[k]!r}: a non-empty string")
    if len(value["channel"].encode()) > 100:
        raise ValueError(f"{what}['channel']={value['channel']!r}: a socket path of at most 100 bytes")
    return dict(value)


def worker_colocated(value, worker: int, workers: int, what: str = "colocated") -> dict | None:
    """An engine's ``colocated=`` argument, read for engine worker ``worker`` of ``workers`` (the
    same value reaches every worker: ``collective_rpc`` / an init info): ``None`` (no worker
    proxies a trainer rank), one ``{"channel", "device"}`` dict (a one-worker engine), or a list of
    one entry per worker, ``None`` where no trainer rank shares the worker's device
    (:func:`pair_specs` builds it).  ValueError / TypeError naming the argument otherwise."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if workers != 1:
            raise ValueError(f"{what}: one {{'channel', 'device'}} dict but the engine has {workers} workers: "
                             f"pass a list of one entry (or None) per worker")
        return check_colocated(value, what)
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{what}={value!r:.80}: None, a {{'channel', 'device'}} dict, or a list of one per worker")
    if len(value) != workers:
        raise ValueError(f"{what}: {len(value)} entries for an engine of {workers} workers (one per worker, "
                         f"None where no trainer rank shares its device)")
    specs = [check_colocated(v, f"{what}[{j}]") for j, v in enumerate(value)]
    for k in ("channel", "device"):
        seen = [s[k] for s in specs if s is not None]
        if len(set(seen)) != len(seen):
            raise ValueError(f"{what}: two workers declare the same {k} ({seen}): one trainer rank per device")
    return specs[worker]


def pair_specs(devices, directory: str) -> dict:
    """The ``colocated=`` arguments of a whole deployment from its
    :class:`~mcore_reshard.core.devices.DeviceMap`: ``{"trainer": [spec or None per trainer rank],
    "engine": [spec or None per engine worker]}``, one socket ``directory/pair-<k>.sock`` per
    colocated pair (``directory``: local, short: a socket path holds at most 100 bytes)::

        DeviceMap(["a", "b"], ["a", "c"])  ->  trainer [{"channel": ".../pair-0.sock", "device": "a"}, None]
                                               engine  [{"channel": ".../pair-0.sock", "device": "a"}, None]"""
    trainer: list = [None] * len(devices.trainer)
    engine: list = [None] * len(devices.engine)
    for k, (i, j) in enumerate(sorted(devices.proxies.items())):
        spec = check_colocated({"channel": os.path.join(directory, f"pair-{k}.sock"), "device": devices.trainer[i]})
        trainer[i], engine[j] = spec, dict(spec)
    return {"trainer": trainer, "engine": engine}


def _timeout(t) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise ValueError(f"timeout={t!r}: a positive number of seconds")
    return float(t)


def _sync(tensors) -> None:
    devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)


class ColocatedTrainer:
    """The trainer process of a colocated pair: exports ``tensors`` (this rank's part ``layout``,
    buffer name -> tensor) to the engine worker listening on ``channel`` and gates every refit
    (module docstring).  ``config``: the model facts the worker's planner needs (``MegatronRefit``'s
    ``model_config``).  What was bound is re-checked at every refit: a storage moved since
    (``param.data = new``, an optimizer offload that reallocated the buffer) or a module replaced by
    one with the same parameters is exported again and followed; anything else is refused on every
    rank before a byte moves."""

    def __init__(self, layout: Layout, tensors: Mapping[str, torch.Tensor], *, channel: str, device: str, rank: int,
                 config: dict | None = None, timeout: float = DEFAULT_TIMEOUT):
        if not isinstance(layout, Layout):
            raise TypeError(f"layout={layout!r:.60}: a Layout (this rank's part)")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank={rank!r}: this trainer rank (an integer >= 0)")
        spec = check_colocated({"channel": channel, "device": device}, "channel/device")
        self.timeout = _timeout(timeout)
        names = set(layout.buffers.get(rank, {}))
        if set(tensors) != names or set(layout.buffers) - {rank}:
            raise ValueError(f"tensors: must be exactly rank {rank}'s buffers of layout (missing "
                             f"{sorted(names - set(tensors))[:4]}, extra {sorted(set(tensors) - names)[:4]}, "
                             f"other ranks {sorted(set(layout.buffers) - {rank})})")
        self.rank, self.device, self.channel_path = rank, spec["device"], spec["channel"]
        self._identity = identity_of(tensors, "src", rank=rank)
        self._owners = dict(tensors)
        self._export = export_tensors(self._owners)
        self._seq = 0
        self.last: dict = {}
        who = f"the colocated engine worker on device {self.device!r} ({self.channel_path})"
        self._ch: Channel | None = connect(self.channel_path, self.timeout, who)
        try:
            self._ch.send({"kind": "hello", "pid": os.getpid(), "device": self.device, "rank": rank,
                           "layout": layout.to_json(), "config": config or {}, "export": self._export.to_json()},
                          self._export.fds)
            reply, _ = self._ch.recv(self.timeout)
        except BaseException:
            self.close()
            raise
        if reply.get("kind") != "bound" or not reply.get("ok"):
            self.close()
            raise ReshardError(f"colocated trainer rank {rank} on device {self.device!r}: the engine worker refused "
                               f"the binding: {reply.get('error')}")
        self.peer_pid = reply.get("pid")
        self._ch.peer = f"the colocated engine worker (pid {self.peer_pid}) on device {self.device!r}"

    @classmethod
    def megatron(cls, chunks, rank: int, *, channel: str, device: str, timeout: float = DEFAULT_TIMEOUT):
        """This trainer rank's Megatron-Core model chunks (``read_layout``)."""
        from .sources.megatron_model import model_config, read_layout
        layout, tensors = read_layout(chunks, rank)
        return cls(layout, tensors, channel=channel, device=device, rank=rank, config=model_config(chunks),
                   timeout=timeout)

    def _changes(self) -> tuple[list[str], dict, list[int]]:
        refusal: list[str] = []
        if self._identity is not None:
            problems, replaced = self._identity.check()
            refusal += problems
            self._owners.update(replaced)
        names = moved(self._export, self._owners)
        if not names or refusal:
            return refusal, {}, []
        sub = export_tensors({n: self._owners[n] for n in names})
        old = {v.name: v for v in self._export.views}
        for v in sub.views:
            o = old[v.name]
            if (v.shape, v.stride, v.dtype) != (o.shape, o.stride, o.dtype):
                refusal.append(f"trainer rank {self.rank} on device {self.device!r}: {v.name} is now {v.dtype}"
                               f"{list(v.shape)} strides {list(v.stride)}, bound as {o.dtype}{list(o.shape)} "
                               f"strides {list(o.stride)}: bind again")
        if refusal:                       # (the descriptors stay the storages' own)
            return refusal, {}, []
        self._export.pointers.update(sub.pointers)
        return [], sub.to_json(), sub.fds

    def refit(self, version: int | None = None) -> dict:
        """Hands this rank's weights to its worker's refit (which must run meanwhile) and returns once
        the worker has read them: ``{"version", "rank", "device", "remapped", "seconds"}``."""
        if self._ch is None:
            raise ReshardError(f"colocated trainer rank {self.rank}: closed")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 1 << 63):
            raise ValueError(f"version={version!r}: an integer in [0, 2**63) or None")
        t0 = time.perf_counter()
        self._seq += 1
        refusal, remap, fds = self._changes()
        _sync(self._owners)
        try:
            self._ch.send({"kind": "ready", "seq": self._seq, "version": version, "refusal": refusal,
                           "remap": remap or None}, fds)
            done = self._recv("done")
        except ChannelError as e:
            raise TransferError(f"colocated trainer rank {self.rank}: {e}", version=version or 0) from None
        if not done.get("ok"):
            cls = TransferError if done.get("transfer") else ReshardError
            kw = {"version": done.get("version") or 0} if cls is TransferError else {}
            raise cls(f"colocated trainer rank {self.rank} on device {self.device!r}: the engine worker's refit "
                      f"failed: {done.get('error')}", **kw)
        self.last = {"version": done.get("version"), "rank": self.rank, "device": self.device,
                     "remapped": len(remap.get("views", [])) if remap else 0,
                     "seconds": time.perf_counter() - t0}
        return dict(self.last)

    def _recv(self, kind: str) -> dict:
        while True:
            msg, fds = self._ch.recv(self.timeout)
            for fd in fds:
                os.close(fd)
            if msg.get("kind") == kind and msg.get("seq") == self._seq:
                return msg

    def close(self) -> None:
        """Leaves: the worker drops its mappings (idempotent)."""
        if self._ch is not None:
            try:
                self._ch.send({"kind": "leave"})
            except ChannelError:
                pass
            self._ch.close()
            self._ch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ColocatedPeer:
    """The engine worker's side of a colocated pair (made by :func:`accept_trainer`): ``layout`` (the
    trainer rank's part, on this worker's group rank) and ``tensors`` (mapped, read in place) to bind
    as this worker's source part; :meth:`check` as the binding's source watcher; :meth:`run` around
    every refit."""

    def __init__(self, ch: Channel, hello: dict, fds: list[int], rank: int, timeout: float):
        self._ch = ch
        self.timeout = timeout
        self.device = hello["device"]
        self.trainer_rank = int(hello["rank"])
        self.pid = int(hello["pid"])
        self.config = dict(hello.get("config") or {})
        self._maps = [MappedStorages(hello["export"], fds)]
        self.tensors = dict(self._maps[0].tensors)
        self.layout = Layout.from_json(hello["layout"]).offset_ranks(rank - self.trainer_rank)
        self.rank = rank
        self._seq = 0
        self._pending: dict | None = None
        self.who = f"the colocated trainer rank {self.trainer_rank} (pid {self.pid}) on device {self.device!r}"
        ch.peer = self.who

    @property
    def mapped_bytes(self) -> int:
        return sum(m.nbytes for m in self._maps)

    def check(self) -> tuple[list[str], dict]:
        """The source watcher (:meth:`Resharder.watch`): waits up to half the timeout for the trainer's
        "ready"; its refusals, or a silence / death, become this rank's problems (every rank refuses);
        storages it moved are mapped and returned as the new owners (followed)."""
        self._seq += 1
        try:
            msg, fds = self._ready(self.timeout / 2)
        except ChannelError as e:
            return [f"rank {self.rank}: {e} (its refit must run beside this one)"], {}
        self._pending = None
        problems = [f"{p}" for p in msg.get("refusal") or []]
        replaced = {}
        if msg.get("remap"):
            m = MappedStorages(msg["remap"], fds)
            self._maps.append(m)
            replaced = dict(m.tensors)
            self.tensors.update(replaced)
        else:
            for fd in fds:
                os.close(fd)
        return problems, replaced

    def _ready(self, timeout: float):
        while True:
            msg, fds = self._ch.recv(timeout)
            if msg.get("kind") == "leave":
                raise ChannelClosed(f"{self.who} left")
            if msg.get("kind") == "ready" and msg.get("seq") == self._seq:
                return msg, fds
            for fd in fds:
                os.close(fd)

    def run(self, refit):
        """``refit()`` (this worker's refit), then tells the trainer it has finished reading (ok, or the
        error) so that the trainer may write its weights again."""
        seq = self._seq + 1
        try:
            out = refit()
            _sync(self.tensors)           # on a GPU: every read of the trainer's memory has completed
        except BaseException as e:
            self._done(seq, False, f"{type(e).__name__}: {e}", transfer=isinstance(e, TransferError))
            raise
        self._done(seq, True, None, version=(out or {}).get("version"))
        return out

    def _done(self, seq: int, ok: bool, error: str | None, *, version=None, transfer: bool = False) -> None:
        if self._seq < seq:               # the refit ended before its watcher ran: consume the "ready"
            self._seq = seq
            try:
                msg, fds = self._ready(self.timeout / 2)
                for fd in fds:
                    os.close(fd)
            except ChannelError:
                return
        try:
            self._ch.send({"kind": "done", "seq": seq, "ok": ok, "error": error, "version": version,
                           "transfer": transfer})
        except ChannelError:
            pass

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps = []
        self.tensors = {}
        self._ch.close()


def accept_trainer(channel: str, *, device: str, rank: int, timeout: float = DEFAULT_TIMEOUT) -> ColocatedPeer:
    """Listens on ``channel`` (owned while listening, removed once the trainer connected) for the
    trainer process of ``device`` and maps what it exports; ``rank``: this worker's group rank.
    Raises :class:`ReshardError` (the trainer never came, or is on another device) -- inside the
    caller's error exchange, so that every rank of the group refuses."""
    spec = check_colocated({"channel": channel, "device": device}, "channel/device")
    timeout = _timeout(timeout)
    listener = Listener(spec["channel"])
    try:
        ch = listener.accept(timeout, f"the colocated trainer on device {device!r}")
    finally:
        listener.close()
    try:
        hello, fds = ch.recv(timeout)
        if hello.get("kind") != "hello":
            raise ReshardError(f"channel {channel}: expected the trainer's hello, got {hello.get('kind')!r}")
        if hello.get("device") != device:
            for fd in fds:
                os.close(fd)
            error = (f"the trainer (pid {hello.get('pid')}) declares device {hello.get('device')!r}, this worker "
                     f"(pid {os.getpid()}) {device!r}: a colocated pair is one device")
            ch.send({"kind": "bound", "ok": False, "error": error})
            raise ReshardError(error)
        peer = ColocatedPeer(ch, hello, fds, rank, timeout)
        ch.send({"kind": "bound", "ok": True, "pid": os.getpid()})
        return peer
    except BaseException:
        ch.close()
        raise


def try_accept(spec: dict | None, *, rank: int, timeout: float) -> tuple[ColocatedPeer | None, str | None]:
    """:func:`accept_trainer` for an engine's join: ``(peer, None)``, ``(None, None)`` without a
    ``spec``, or ``(None, error)``: the error goes into the protocol's join, so that every rank of
    the group refuses (not only this worker)."""
    if spec is None:
        return None, None
    try:
        return accept_trainer(spec["channel"], device=spec["device"], rank=rank, timeout=timeout), None
    except Exception as e:  # noqa: BLE001 - reported to every rank by the join
        return None, f"rank {rank}: colocated trainer on device {spec['device']!r}: {type(e).__name__}: {e}"
