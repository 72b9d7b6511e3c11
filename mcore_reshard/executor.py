"""Executor: the only module that talks to ``torch.distributed``.

``Resharder(plan, src, dst, group)`` binds a plan to this rank's real tensors once; each
``refit()`` then moves the bytes: local copies directly, remote ones packed into one flat staging
buffer per message and exchanged with ``batch_isend_irecv`` round by round, unpacked with
``copy_`` into the existing destination storage (addresses never change).

Construction is collective over ``group``: every rank checks its tensors against the plan, then
all ranks exchange (plan hash, ok flag, error text) so that any mismatch makes *every* rank raise
the same :class:`ReshardError` before a byte moves, instead of leaving peers waiting.

Example (4 ranks, colocated): every rank builds the same plan from the same layouts, then::

    rank | src tensors               | dst tensors
    0    | {"w": w_tp0}              | {"w": w_full}
    1    | {"w": w_tp1}              | {}
    r = Resharder(plan, src, dst, group); r.refit()   # on every rank, after each training step
"""
from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from .planner import Plan

_DTYPES = {
    "float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int64": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_MSG_BYTES = 1024


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ReshardError(RuntimeError):
    """Raised on every rank together when any rank finds the plan or its tensors inconsistent."""


@dataclass
class _Round:
    sends: list   # (peer, staging slice, [(staging view, src view)])
    recvs: list   # (peer, staging slice, [(staging view, dst view)])


def _check_tensors(plan: Plan, rank: int, side: str, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    errors = []
    want = plan.buffers[side].get(rank, {})
    for name, (shape, dtype) in want.items():
        t = tensors.get(name)
        if t is None:
            errors.append(f"rank {rank}: {side} tensor {name} {shape} {dtype} is missing")
        elif list(t.shape) != list(shape) or dtype_name(t.dtype) != dtype:
            errors.append(f"rank {rank}: {side} tensor {name} is {list(t.shape)} {dtype_name(t.dtype)}, plan says {shape} {dtype}")
        elif side == "dst" and not t.is_contiguous():
            errors.append(f"rank {rank}: dst tensor {name} is not contiguous")
    return errors


def agree(group, digest: str, errors: list[str]) -> None:
    """Collective: exchange plan digest and local errors; raise on every rank if any disagree."""
    world = dist.get_world_size(group)
    payload = torch.zeros(32 + 1 + _MSG_BYTES, dtype=torch.uint8)
    payload[:32] = torch.frombuffer(bytearray(bytes.fromhex(digest)), dtype=torch.uint8)
    if errors:
        text = "; ".join(errors).encode()[:_MSG_BYTES]
        payload[32] = 1
        payload[33:33 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    device = _group_device(group)
    payload = payload.to(device)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(gathered, payload, group=group)
    gathered = [g.cpu() for g in gathered]
    problems = []
    hashes = [bytes(g[:32].tolist()).hex() for g in gathered]
    if len(set(hashes)) > 1:
        by_hash: dict[str, list[int]] = {}
        for r, h in enumerate(hashes):
            by_hash.setdefault(h[:12], []).append(r)
        problems.append("plan hashes differ between ranks: " + "; ".join(f"{h} on ranks {rs}" for h, rs in sorted(by_hash.items())))
    for r, g in enumerate(gathered):
        if int(g[32]):
            text = bytes(g[33:].tolist()).rstrip(b"\0").decode(errors="replace")
            problems.append(text or f"rank {r} failed its checks")
    if problems:
        raise ReshardError("reshard refused before any transfer: " + " | ".join(problems))


def _group_device(group) -> torch.device:
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Resharder:
    """Binds ``plan`` to this rank's tensors; ``refit()`` moves the weights (collective).

    ``src``/``dst`` map buffer names to this rank's real tensors (a rank may have either, both or
    none).  Source tensors are only read.  ``timeout`` bounds each round's wait.
    """

    def __init__(self, plan: Plan, src: Mapping[str, torch.Tensor], dst: Mapping[str, torch.Tensor],
                 group=None, *, timeout: float | None = None):
        self.plan = plan
        self.group = group
        self.rank = dist.get_rank(group)
        self.timeout = None if timeout is None else datetime.timedelta(seconds=timeout)
        self.src = dict(src)
        self.dst = dict(dst)
        errors = _check_tensors(plan, self.rank, "src", self.src) + _check_tensors(plan, self.rank, "dst", self.dst)
        if dist.get_world_size(group) < len(plan.ranks) or (plan.ranks and max(plan.ranks) >= dist.get_world_size(group)):
            errors.append(f"plan uses ranks {plan.ranks[0]}..{plan.ranks[-1]} but the group has {dist.get_world_size(group)} ranks")
        agree(group, plan.hash, errors)
        self._bind()

    def _bind(self) -> None:
        r, plan = self.rank, self.plan
        self.local = [(self.dst[c.dst_buffer][c.dst_local.slices()], self.src[c.src_buffer][c.src_local.slices()])
                      for c in plan.local_copies if c.dst == r]
        self.padding = [self.dst[b][box.slices()] for rr, b, box in plan.padding if rr == r]
        send_size = recv_size = 0
        per_round: dict[int, tuple[list, list]] = {}
        for m in plan.messages:
            if m.src == r:
                per_round.setdefault(m.round, ([], []))[0].append(m)
            if m.dst == r:
                per_round.setdefault(m.round, ([], []))[1].append(m)
        for sends, recvs in per_round.values():
            send_size = max(send_size, sum(m.nbytes for m in sends))
            recv_size = max(recv_size, sum(m.nbytes for m in recvs))
        device = self._device()
        self.send_staging = torch.empty(send_size, dtype=torch.uint8, device=device)
        self.recv_staging = torch.empty(recv_size, dtype=torch.uint8, device=device)
        self.rounds: list[_Round] = []
        for k in sorted(per_round):
            sends, recvs = per_round[k]
            rnd = _Round([], [])
            base = 0
            for m in sends:
                buf = self.send_staging[base:base + m.nbytes]
                pairs = [(self._view(buf, c), self.src[c.src_buffer][c.src_local.slices()]) for c in m.entries]
                rnd.sends.append((m.dst, buf, pairs))
                base += m.nbytes
            base = 0
            for m in recvs:
                buf = self.recv_staging[base:base + m.nbytes]
                pairs = [(self._view(buf, c), self.dst[c.dst_buffer][c.dst_local.slices()]) for c in m.entries]
                rnd.recvs.append((m.src, buf, pairs))
                base += m.nbytes
            self.rounds.append(rnd)

    def _device(self) -> torch.device:
        for t in list(self.dst.values()) + list(self.src.values()):
            return t.device
        return _group_device(self.group)

    def _view(self, staging: torch.Tensor, c) -> torch.Tensor:
        dtype = torch_dtype(self.plan.tensors[c.tensor]["src_dtype"])
        return staging[c.offset:c.offset + c.nbytes].view(dtype).view(c.src_local.sizes)

    @property
    def staging_bytes(self) -> int:
        return self.send_staging.numel() + self.recv_staging.numel()

    def refit(self) -> dict:
        """Move every byte of the plan once; returns counts (messages and bytes sent by this rank)."""
        for view in self.padding:
            view.zero_()
        for d, s in self.local:
            d.copy_(s.reshape(d.shape))
        sent = nmsg = 0
        for rnd in self.rounds:
            for _, _, pairs in rnd.sends:
                for stage, s in pairs:
                    stage.copy_(s)
            ops = [dist.P2POp(dist.isend, buf, group=self.group, group_peer=peer) for peer, buf, _ in rnd.sends]
            ops += [dist.P2POp(dist.irecv, buf, group=self.group, group_peer=peer) for peer, buf, _ in rnd.recvs]
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    if self.timeout is None:
                        work.wait()
                    else:
                        work.wait(self.timeout)
            for _, _, pairs in rnd.recvs:
                for stage, d in pairs:
                    d.copy_(stage.reshape(d.shape))
            nmsg += len(rnd.sends)
            sent += sum(b.numel() for _, b, _ in rnd.sends)
        return {"messages_sent": nmsg, "staged_bytes_sent": sent}


def all_gather_json(obj, group=None) -> list:
    """Every rank's JSON-able ``obj``, in rank order (metadata exchange; never pickle)."""
    data = json.dumps(obj, sort_keys=True).encode()
    device = _group_device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=group)
    return [json.loads(bytes(o[:int(n)].cpu().tolist()).decode()) for o, n in zip(out, sizes)]
