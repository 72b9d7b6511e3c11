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


_DEVICES = ("cpu", "cuda", "meta")     # meta: refused with its own message by the device check


def kind_problem(t) -> str | None:
    """Why a refit cannot move the bytes of tensor ``t`` in place (None: it can).

    Closed-world: accepted are plain strided dense tensors with storage of their own on the CPU or
    a CUDA device -- ``torch.Tensor``, ``nn.Parameter`` and its subclasses that leave dispatch alone
    (vLLM's and SGLang's parameter classes) -- and a DTensor through its local shard when that shard
    is one.  Everything else is named and refused: sparse layouts (COO, CSR, CSC, BSR, BSC: no
    strided storage), nested tensors, quantized tensors (their bytes are not their values), functional
    wrappers, tensors with a lazy conjugate / negative bit, any other tensor subclass (a wrapper with
    its own ``__torch_dispatch__`` -- FakeTensor, FP8 wrappers -- or one the executor cannot prove
    writes land in), other devices."""
    if is_dtensor(t):
        why = kind_problem(t.to_local())
        return None if why is None else f"a DTensor whose local shard is {why}"
    cls = type(t)
    if cls.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        return (f"a {cls.__module__}.{cls.__qualname__}, a tensor subclass with its own __torch_dispatch__ (a wrapper: "
                "its bytes are not one strided storage)")
    if cls is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        return (f"a {cls.__module__}.{cls.__qualname__}, a tensor subclass (only torch.Tensor, nn.Parameter and "
                "DTensor are moved; pass the plain tensor, e.g. t.as_subclass(torch.Tensor))")
    if t.layout != torch.strided:
        return f"a {str(t.layout).removeprefix('torch.')} tensor (no strided storage: pass a dense tensor)"
    if t.is_nested:
        return "a nested tensor (no single strided storage)"
    if t.is_quantized:
        return f"a quantized {str(t.dtype).removeprefix('torch.')} tensor (its bytes are not its values)"
    if torch._is_functional_tensor(t):
        return "a functional tensor wrapper (no storage of its own: functionalization / tracing)"
    if t.is_conj() or t.is_neg():
        return "a tensor with a lazy conjugate / negative bit (its bytes are not its values)"
    if t.device.type not in _DEVICES:
        return f"on device {t.device} (refits move CPU and CUDA tensors)"
    return None


def shape_text(t: torch.Tensor) -> str:
    """``[4, 8] float32`` (a nested tensor, which has no sizes: ``(nested) float32``)."""
    try:
        shape = str(list(t.shape))
    except RuntimeError:
        shape = "(nested)"
    return f"{shape} {dtype_name(t.dtype)}"


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
    if kind_problem(t) is not None:
        return f"{shape_text(t)} {type(t).__name__} {str(t.layout).removeprefix('torch.')} on {t.device}"
    return f"0x{t.data_ptr():x} {list(t.shape)} {dtype_name(t.dtype)} strides {list(t.stride())} on {t.device}"


class Owners:
    """Every bound tensor of one rank (:class:`Record`), checked at each refit by :meth:`changed`."""

    def __init__(self, records: list[Record]):
        self.records = records
        self._split()

    def _split(self) -> None:
        self._plain = [(rec, rec.owner) for rec in self.records if not is_dtensor(rec.owner)]
        self._dtensors = [(rec, rec.owner) for rec in self.records if is_dtensor(rec.owner)]

    def replace(self, side: str, name: str, owner) -> bool:
        """``owner`` now owns the buffer ``name`` of ``side`` (its module or parameter object was replaced:
        :meth:`Resharder.watch`); the next :meth:`changed` compares its storage with the recorded one.
        False when no such buffer is bound."""
        for rec in self.records:
            if rec.side == side and rec.name == name:
                if rec.owner is not owner:
                    rec.owner = owner
                    self._split()
                return True
        return False

    def changed(self) -> list[tuple[Record, torch.Tensor]]:
        """``(record, the owner's current storage)`` of every owner whose storage is not the
        recorded one (pointer, shape, strides, dtype or device differ)."""
        out = []
        for rec, t in self._plain:
            try:
                same = t.data_ptr() == rec.ptr and t.shape == rec.shape and t.stride() == rec.stride and t.dtype == rec.dtype
            except RuntimeError:     # no strided storage any more (rebound to a sparse tensor): not followed
                same = False
            if not same:
                out.append((rec, t.detach()))
        for rec, t in self._dtensors:
            loc = t.to_local()
            if loc.data_ptr() != rec.ptr or loc.shape != rec.shape or loc.stride() != rec.stride:
                out.append((rec, loc.detach()))
        return out

    @staticmethod
    def why_not_followed(rec: Record, now: torch.Tensor) -> str | None:
        """None when ``now`` can replace the recorded storage (same shape, strides, dtype, device,
        and a kind a refit moves: :func:`kind_problem`)."""
        kind = kind_problem(now)
        if kind is not None:
            return f"the new tensor is {kind}"
        if (tuple(now.shape), tuple(now.stride()), now.dtype, now.device) == (rec.shape, rec.stride, rec.dtype, rec.device):
            return None
        return ("the plan was bound to " + f"{list(rec.shape)} {dtype_name(rec.dtype)} strides {list(rec.stride)} on "
                f"{rec.device}; bind a new Resharder for the new tensor")

    @staticmethod
    def followed(changed: list[tuple[Record, torch.Tensor]]) -> None:
        """The storages of :meth:`changed` are bound now (the Resharder followed them)."""
        for rec, now in changed:
            rec.ptr = now.data_ptr()
