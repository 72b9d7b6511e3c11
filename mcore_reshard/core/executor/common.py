"""Dtype names, wire constants, the group's device and bounded waits (shared by every executor unit)."""
from __future__ import annotations

import datetime
import math
import numbers
import time

import torch
import torch.distributed as dist

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int64": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_CS_BYTES = 16          # per-entry checksum trailer in verify mode: two int64
_DIRECT_MIN = 256 << 10   # entries of at least this many bytes get their own P2P operation (binding.parts)
# batched path: a message goes in chunks (rounds.windows): the first _CHUNK_MIN bytes, then doubling up to _CHUNK_MAX
_CHUNK_MIN = 1 << 20
_CHUNK_MAX = 16 << 20
_LOCAL_SLICE = 4 << 20    # local copies run in slices of about this many bytes between waits (transfer.LocalCopies)


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


_FALLBACK_TIMEOUT = 1800.0
_MAX_TIMEOUT = 1e9           # ~31 years: larger ones overflow torch's timeouts (a raw OverflowError)   # torch's own default for non-NCCL process groups


def check_timeout(value, what: str = "timeout") -> float | None:
    """``value`` as seconds (None stays None: the group's timeout); ValueError unless a finite
    positive real number."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value))
            or not 0 < float(value) <= _MAX_TIMEOUT):
        raise ValueError(f"{what}={value!r}: must be a finite number of seconds > 0 and <= {_MAX_TIMEOUT:.0e} "
                         "(or None: the process group's timeout)")
    return float(value)


def _own_timeout(pg) -> float | None:
    for dev in (torch.device("cpu"), torch.device("cuda")):
        try:
            t = pg._get_backend(dev).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options
            continue
        if t is not None and t.total_seconds() > 0:
            return float(t.total_seconds())
    return None


def group_timeout(group) -> float:
    """The finite bound of ``timeout=None``: the process group's own timeout (what
    ``new_group(timeout=)`` set), or the default group's (``init_process_group(timeout=)``) when
    that is shorter -- a ``new_group()`` made without ``timeout=`` gets torch's 30 min default, not
    the default group's -- else torch's default."""
    found = []
    for pg in (group if group is not None else dist.group.WORLD, dist.group.WORLD):
        try:
            t = _own_timeout(pg)
        except Exception:  # noqa: BLE001
            t = None
        if t is not None:
            found.append(t)
    return min(found) if found else _FALLBACK_TIMEOUT


#: seconds between two ``is_completed()`` polls on backends whose ``wait`` does not block the host
POLL_S = 0.0005


def bounded_wait(work, timeout: float | None, group=None, blocking: bool | None = None) -> None:
    """Wait for ``work`` at most ``timeout`` seconds (None: the group's timeout; never unbounded).
    ``blocking``: whether the group's ``wait`` blocks the host (:func:`waits_block`; None: looked
    up here, ~25 us per call -- a refit's hundreds of waits pass it in).

    gloo: ``work.wait(timeout)`` blocks the host and raises on timeout.  Every other backend
    (NCCL): ``wait`` only makes the current stream wait, so the host polls ``is_completed()``
    against the deadline; past it the communicator is aborted (its pending operations can never
    complete: the group must be replaced, see ``Resharder.rebind``) and ``TimeoutError`` raised."""
    if timeout is None:
        timeout = group_timeout(group)
    timeout = max(timeout, 0.001)
    if waits_block(group) if blocking is None else blocking:
        work.wait(datetime.timedelta(seconds=timeout))
        return
    deadline = time.monotonic() + timeout
    while not work.is_completed():
        if time.monotonic() > deadline:
            abort_group(group)
            raise TimeoutError(f"Timed out waiting {timeout * 1000:.0f}ms (host-side deadline; communicator aborted)")
        time.sleep(POLL_S)
    work.wait()   # completed: raises the backend's error if the operation failed


def waits_block(group) -> bool:
    """Whether ``work.wait(timeout)`` of ``group`` blocks the host until done or timed out (gloo)."""
    try:
        return dist.get_backend(group) == "gloo"
    except Exception:  # noqa: BLE001 - not a real group (tests): wait blocks
        return True


def abort_group(group) -> None:
    """Abort ``group``'s communicator (NCCL) so that no operation of it stays pending on the GPU."""
    try:
        from torch.distributed.distributed_c10d import _abort_process_group
        _abort_process_group(group)
    except Exception:  # noqa: BLE001 - nothing to abort (gloo, or already gone)
        pass
