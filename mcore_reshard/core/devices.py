"""Which device every participant of a refit computes on, and the process group that follows.

Trainer rank ``i`` and engine worker ``j`` on the same device are a *colocated pair*: they are two
processes (NCCL refuses two ranks of one group on one GPU) that never share a process group.  The
engine worker *proxies* its colocated trainer rank: it maps that rank's storages (same-device
memory, :mod:`mcore_reshard.core.executor.shared_storage`) and holds its source part in the refit's
group.  So the group has one member per device: the trainer ranks on devices without an engine
worker (group ranks ``[0, rank_offset)``, in trainer rank order), then every engine worker
(``rank_offset + j``).  Example, trainer TP2 x EP2 on GPUs a..d, engine TP=2 on a and b::

    process          | device | group rank | proxied by
    trainer rank 0   | a      | -          | engine worker 0
    trainer rank 1   | b      | -          | engine worker 1
    trainer rank 2   | c      | 0          |
    trainer rank 3   | d      | 1          |
    engine worker 0  | a      | 2          | (proxies trainer rank 0)
    engine worker 1  | b      | 3          | (proxies trainer rank 1)

Only what crosses devices goes over the group; what a worker needs from its own device's trainer
rank is a local copy out of mapped memory.

Device keys: :func:`device_key` gives a GPU's UUID (``"GPU-8c1f..."``); on a CPU machine every
participant declares a key (any non-empty string; the tests use ``"cpu:0"``, ``"cpu:1"``, ...)."""
from __future__ import annotations

from dataclasses import dataclass


def device_key(device=None) -> str:
    """The key of a CUDA device (its UUID, the same in every process whatever ``CUDA_VISIBLE_DEVICES``
    says); on a CPU there is none to read: declare one (ValueError)."""
    import torch
    dev = torch.device(device) if device is not None else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu"))
    if dev.type != "cuda":
        raise ValueError(f"device={device!r}: a {dev.type} device has no key to read; declare one (any string "
                         f"naming the device, the same in both processes of a colocated pair)")
    return "GPU-" + str(torch.cuda.get_device_properties(dev).uuid)


def _keys(value, what: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"{what}={value!r:.80}: a list of device keys, one per process")
    keys = tuple(value)
    bad = [k for k in keys if not isinstance(k, str) or not k]
    if bad:
        raise ValueError(f"{what}: device keys must be non-empty strings, got {bad[:4]!r}")
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k in seen:
            raise ValueError(f"{what}: {what} {seen[k]} and {i} both declare device {k!r}; one process per device "
                             f"on each side")
        seen[k] = i
    return keys


@dataclass(frozen=True)
class DeviceMap:
    """``trainer[i]``: the device key of trainer rank ``i``; ``engine[j]``: of engine worker ``j``
    (see the module docstring for the group it implies)."""
    trainer: tuple[str, ...]
    engine: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "trainer", _keys(self.trainer, "trainer"))
        object.__setattr__(self, "engine", _keys(self.engine, "engine"))
        if not self.trainer or not self.engine:
            raise ValueError(f"DeviceMap needs at least one trainer rank and one engine worker "
                             f"(trainer={list(self.trainer)}, engine={list(self.engine)})")

    @property
    def proxies(self) -> dict[int, int]:
        """``{trainer rank: engine worker}`` of every colocated pair."""
        where = {k: j for j, k in enumerate(self.engine)}
        return {i: where[k] for i, k in enumerate(self.trainer) if k in where}

    @property
    def rank_offset(self) -> int:
        """The group rank of engine worker 0 (= trainer ranks that are group members)."""
        return len(self.trainer) - len(self.proxies)

    @property
    def group_size(self) -> int:
        return self.rank_offset + len(self.engine)

    def trainer_group_rank(self, rank: int) -> int | None:
        """Trainer rank ``rank``'s rank in the group, or None when an engine worker proxies it."""
        self._check(rank, len(self.trainer), "trainer rank")
        if rank in self.proxies:
            return None
        return sum(1 for i in range(rank) if i not in self.proxies)

    def engine_group_rank(self, worker: int) -> int:
        self._check(worker, len(self.engine), "engine worker")
        return self.rank_offset + worker

    def proxied_by(self, worker: int) -> int | None:
        """The trainer rank engine worker ``worker`` proxies (None: no trainer rank on its device)."""
        self._check(worker, len(self.engine), "engine worker")
        return next((i for i, j in self.proxies.items() if j == worker), None)

    @staticmethod
    def _check(i, n: int, what: str) -> None:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ValueError(f"{what} {i!r}: must be an integer in [0, {n})")

    def to_json(self) -> dict:
        return {"trainer": list(self.trainer), "engine": list(self.engine)}

    @staticmethod
    def from_json(obj) -> "DeviceMap":
        if not isinstance(obj, dict) or set(obj) != {"trainer", "engine"}:
            raise ValueError(f"a device map is {{'trainer': [...], 'engine': [...]}}, got {obj!r:.120}")
        return DeviceMap(obj["trainer"], obj["engine"])
