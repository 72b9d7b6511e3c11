"""A process's tensors mapped into another process on the same device, without a copy: the
same-device transport's memory (CUDA IPC on a GPU, shared memory on a CPU).

The owner *exports* the storages its tensors live in, once (:func:`export_tensors`); the other
process *maps* them (:func:`map_tensors`) and reads the tensors in place::

    process | storage of its tensors            | what crosses to the peer (once, at bind)
    owner   | CPU: moved into shared memory     | one file descriptor per storage (SCM_RIGHTS)
            |      in place (share_memory_())   |   + the views (storage, offset, shape, strides)
            | CUDA: the caching allocator's     | one IPC handle per storage
            |       block, as it is            |
    peer    | -                                 | maps each storage once; closes each fd after mmap

On a CPU the owner's storage object stays the same (every view of it, e.g. Megatron's contiguous
DDP buffers, follows), only its memory becomes a shared-memory object with no name in the file
system (torch's ``file_descriptor`` strategy: created and unlinked at once, so nothing is left behind
when a process dies).  The peer's mapping lives as long as the tensors made from it.

One storage is exported whole even when only some of its bytes are bound: mapping is not copying,
and the peer reads only the bound views."""
from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass
from typing import Mapping

import torch

from .common import dtype_name
from .errors import ReshardError

_DTYPES = {dtype_name(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                                      torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
                                      torch.float8_e4m3fn, torch.float8_e5m2)}


@dataclass(frozen=True)
class StorageRecord:
    """One exported storage: its index in the export, device type, bytes, and, on CUDA, the IPC handle
    (as the hex of torch's handle fields); on CPU the file descriptor travels beside the message."""
    index: int
    device: str
    nbytes: int
    cuda_handle: list | None = None


@dataclass(frozen=True)
class ViewRecord:
    """One bound tensor as a view of an exported storage (element offset, shape, strides, dtype)."""
    name: str
    storage: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@dataclass
class Export:
    """What :func:`export_tensors` produced: records to send as JSON, the CPU descriptors to pass
    with them (one per CPU storage, in ``storages`` order), and the storage pointers at export
    (what :meth:`moved` compares)."""
    storages: list[StorageRecord]
    views: list[ViewRecord]
    fds: list[int]
    pointers: dict[str, tuple[int, int]]

    def to_json(self) -> dict:
        return {"storages": [asdict(s) for s in self.storages], "views": [asdict(v) for v in self.views]}


def _pointer(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.storage_offset()


def tensor_problem(name: str, t) -> str | None:
    """Why ``t`` cannot be exported (None when it can)."""
    if not isinstance(t, torch.Tensor):
        return f"{name}: a {type(t).__name__}, not a tensor"
    if t.layout != torch.strided or t.is_nested or t.device.type not in ("cpu", "cuda") or t.is_meta:
        return f"{name}: a {t.layout} tensor on {t.device} (only strided CPU / CUDA tensors can be mapped)"
    if dtype_name(t.dtype) not in _DTYPES:
        return f"{name}: dtype {t.dtype} cannot be mapped"
    return None


def export_tensors(tensors: Mapping[str, torch.Tensor]) -> Export:
    """Exports the storages of ``tensors`` (see the module docstring); a :class:`ReshardError`
    naming every tensor that cannot be exported (sparse, nested, meta, on another device type)."""
    problems = [p for n, t in tensors.items() if (p := tensor_problem(n, t)) is not None]
    if problems:
        raise ReshardError("colocated export: " + "; ".join(problems[:8]) + (" ..." if len(problems) > 8 else ""))
    by_ptr: dict[tuple[str, int], int] = {}
    storages, views, fds = [], [], []
    for name in sorted(tensors):
        t = tensors[name].detach()
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in by_ptr and st.nbytes() > 0:
            index = len(storages)
            if t.device.type == "cpu":
                fd, size = st._share_fd_cpu_()          # in place: the storage object stays, its memory is shared
                fds.append(fd)
                storages.append(StorageRecord(index, "cpu", int(size)))
            else:
                torch.cuda.synchronize(t.device)
                handle = st._share_cuda_()
                storages.append(StorageRecord(index, str(t.device), st.nbytes(), cuda_handle=[_hexable(x) for x in handle]))
            key = (str(t.device), st.data_ptr())    # on a CPU the storage's memory moved into shared memory
            by_ptr[key] = index
        views.append(ViewRecord(name, by_ptr.get(key, -1), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
                                dtype_name(t.dtype)))
    return Export(storages, views, fds, {n: _pointer(tensors[n]) for n in tensors})


def _hexable(x):
    if isinstance(x, bytes):
        return {"bytes": x.hex()}
    if isinstance(x, torch.device):
        return {"device": x.index}
    return x


def _unhex(x):
    if isinstance(x, dict) and "bytes" in x:
        return bytes.fromhex(x["bytes"])
    if isinstance(x, dict) and "device" in x:
        return x["device"]
    return x


def moved(export: Export, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of ``tensors`` whose storage is not the one exported (``param.data = new``, an
    optimizer offload that freed and reallocated the buffer): they must be exported again."""
    return sorted(n for n, t in tensors.items() if export.pointers.get(n) != _pointer(t))


class MappedStorages:
    """The peer's side: every storage of an export mapped once, and the views on it.

    ``tensors`` holds one tensor per view; ``nbytes`` the bytes mapped.  :meth:`close` drops the
    mappings (they are unmapped once no tensor made from them is left)."""

    def __init__(self, export_json: Mapping, fds: list[int], device: torch.device | None = None):
        self.nbytes = 0
        self.tensors: dict[str, torch.Tensor] = {}
        bases: dict[int, torch.Tensor] = {}
        cpu_fds = iter(fds)
        try:
            for rec in export_json["storages"]:
                rec = StorageRecord(**rec)
                if rec.device == "cpu":
                    fd = next(cpu_fds)
                    try:
                        mm = mmap.mmap(fd, rec.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
                    finally:
                        os.close(fd)
                    bases[rec.index] = torch.frombuffer(mm, dtype=torch.uint8)
                else:
                    handle = [_unhex(x) for x in rec.cuda_handle]
                    storage = torch.UntypedStorage._new_shared_cuda(*handle)
                    bases[rec.index] = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
                self.nbytes += rec.nbytes
        finally:
            for fd in cpu_fds:            # descriptors of storages not reached (an error above)
                os.close(fd)
        for v in export_json["views"]:
            v = ViewRecord(**{**v, "shape": tuple(v["shape"]), "stride": tuple(v["stride"])})
            dtype = _DTYPES[v.dtype]
            if v.storage < 0:             # an empty storage: an empty tensor
                self.tensors[v.name] = torch.empty(v.shape, dtype=dtype)
                continue
            base = bases[v.storage]
            usable = base.numel() - base.numel() % torch.empty(0, dtype=dtype).element_size()
            self.tensors[v.name] = base[:usable].view(dtype).as_strided(v.shape, v.stride, v.offset)

    def close(self) -> None:
        self.tensors = {}
        self.nbytes = 0
