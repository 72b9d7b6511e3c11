"""Dtype names, wire constants, the group's device and bounded waits (shared by every executor unit)."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int64": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_CS_BYTES = 16          # per-entry checksum trailer in verify mode: two int64
_DIRECT_MIN = 256 << 10   # overlapped path: entries of at least this many bytes get their own P2P operation


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a plan dtype name (``"bfloat16"`` -> ``torch.bfloat16``)."""
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The plan dtype name of a torch dtype (``torch.bfloat16`` -> ``"bfloat16"``)."""
    return str(dtype).removeprefix("torch.")


def group_device(group) -> torch.device:
    """The device a group's communication buffers live on (CUDA for NCCL, else CPU)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_ranks_hint(world: int) -> str:
    """``0..world-1`` for messages."""
    return f"0..{world - 1}" if world else "none"


def bounded_wait(work, timeout: float | None) -> None:
    """Wait for ``work``, at most ``timeout`` seconds (None: unbounded)."""
    if timeout is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=max(timeout, 0.001)))
