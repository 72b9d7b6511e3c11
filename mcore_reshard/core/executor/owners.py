"""What a :class:`~.resharder.Resharder` was given: the tensor objects (``nn.Parameter``, plain
tensor or DTensor: the *owners*) and the storage each one used at bind time, so that every refit
can check, before a byte moves, that it still writes / reads the storage the owner uses now.

An owner's storage can change behind the Resharder's back: ``param.data = new_tensor`` (engines do
it in post-load processing, optimizers and user code on the trainer side) leaves the bound views
on the old storage.  :meth:`Owners.changed` finds that (a loop of pointer / shape / stride
compares, a few microseconds per hundred tensors); the Resharder then follows the new storage
when its shape, strides, dtype and device are those bound, and refuses the refit on every rank
otherwise."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import dtype_name


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
        return DTensor
    except Exception:  # noqa: BLE001 - torch without DTensor
        return None


_DTENSOR = _dtensor_type()


def is_dtensor(t) -> bool:
    return _DTENSOR is not None and isinstance(t, _DTENSOR)


def storage_of(owner) -> torch.Tensor:
    """The plain tensor a refit reads / writes for ``owner``: its local shard for a DTensor, else
    itself, detached (refits run without autograd; ``nn.Parameter`` leaves stay as they are)."""
    if is_dtensor(owner):
        return owner.to_local().detach()
    return owner.detach()


@dataclass
class Record:
    """One bound tensor: its owner and what its storage was at bind (or at the last followed rebinding)."""
    side: str
    name: str
    owner: object
    ptr: int
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device


def record(side: str, name: str, owner, t: torch.Tensor) -> Record:
    return Record(side, name, owner, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device)


def describe(t: torch.Tensor) -> str:
    return f"0x{t.data_ptr():x} {list(t.shape)} {dtype_name(t.dtype)} strides {list(t.stride())} on {t.device}"


class Owners:
    """Every bound tensor of one rank (:class:`Record`), checked at each refit by :meth:`changed`."""

    def __init__(self, records: list[Record]):
        self.records = records
        self._plain = [(rec, rec.owner) for rec in records if not is_dtensor(rec.owner)]
        self._dtensors = [(rec, rec.owner) for rec in records if is_dtensor(rec.owner)]

    def changed(self) -> list[tuple[Record, torch.Tensor]]:
        """``(record, the owner's current storage)`` of every owner whose storage is not the
        recorded one (pointer, shape, strides, dtype or device differ)."""
        out = []
        for rec, t in self._plain:
            if t.data_ptr() != rec.ptr or t.shape != rec.shape or t.stride() != rec.stride or t.dtype != rec.dtype:
                out.append((rec, t.detach()))
        for rec, t in self._dtensors:
            loc = t.to_local()
            if loc.data_ptr() != rec.ptr or loc.shape != rec.shape or loc.stride() != rec.stride:
                out.append((rec, loc.detach()))
        return out

    @staticmethod
    def why_not_followed(rec: Record, now: torch.Tensor) -> str | None:
        """None when ``now`` can replace the recorded storage (same shape, strides, dtype, device)."""
        if (tuple(now.shape), tuple(now.stride()), now.dtype, now.device) == (rec.shape, rec.stride, rec.dtype, rec.device):
            return None
        return ("the plan was bound to " + f"{list(rec.shape)} {dtype_name(rec.dtype)} strides {list(rec.stride)} on "
                f"{rec.device}; bind a new Resharder for the new tensor")

    @staticmethod
    def followed(changed: list[tuple[Record, torch.Tensor]]) -> None:
        """The storages of :meth:`changed` are bound now (the Resharder followed them)."""
        for rec, now in changed:
            rec.ptr = now.data_ptr()
