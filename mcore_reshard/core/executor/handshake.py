"""Collective control messages (tensors, never pickle): :func:`agree` (handshake / retry), the
refit confirmation's exchange (:func:`exchange`) and :func:`all_gather_json` (metadata)."""
from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from .common import bounded_wait, group_device
from .errors import ReshardError

_MSG_BYTES = 1024
_OPT_BYTES = 64

# control messages (handshake, retry handshake, confirmation) share one fixed size and carry their
# kind, so ranks at different protocol steps are detected instead of exchanging mismatched bytes
_KIND = {1: "handshake", 2: "retry handshake", 3: "confirmation"}
_C_KIND, _C_OK, _C_VER, _C_DIGEST, _C_OPT, _C_TEXT = 0, 1, 2, 10, 42, 42 + _OPT_BYTES
_C_SIZE = _C_TEXT + _MSG_BYTES


def _put(payload: torch.Tensor, at: int, data: bytes, limit: int) -> None:
    data = data[:limit]
    if data:
        payload[at:at + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)


def exchange(group, kind: int, *, digest: str = "", version: int = 0, ok: bool = True, options: str = "",
             text: str = "", timeout: float | None = None) -> list[dict]:
    """All-gather one fixed-size control message per rank (tensors, never pickle)."""
    world = dist.get_world_size(group)
    payload = torch.zeros(_C_SIZE, dtype=torch.uint8)
    payload[_C_KIND] = kind
    payload[_C_OK] = 1 if ok else 0
    _put(payload, _C_VER, int(version).to_bytes(8, "little", signed=True), 8)
    _put(payload, _C_DIGEST, bytes.fromhex(digest) if digest else b"", 32)
    _put(payload, _C_OPT, options.encode(), _OPT_BYTES)
    _put(payload, _C_TEXT, text.encode(), _MSG_BYTES)
    payload = payload.to(group_device(group))
    gathered = [torch.empty_like(payload) for _ in range(world)]
    bounded_wait(dist.all_gather(gathered, payload, group=group, async_op=True), timeout)
    out = []
    for g in gathered:
        b = bytes(g.cpu().tolist())
        out.append({"kind": b[_C_KIND], "ok": bool(b[_C_OK]),
                    "version": int.from_bytes(b[_C_VER:_C_VER + 8], "little", signed=True),
                    "digest": b[_C_DIGEST:_C_DIGEST + 32].hex(),
                    "options": b[_C_OPT:_C_TEXT].rstrip(b"\0").decode(errors="replace"),
                    "text": b[_C_TEXT:].rstrip(b"\0").decode(errors="replace")})
    return out


def step_mismatch(msgs: list[dict], kind: int) -> str | None:
    """None when every rank sent a control message of ``kind``, else who is at which step."""
    if all(m["kind"] == kind for m in msgs):
        return None
    by: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        by.setdefault(f"{_KIND.get(m['kind'], 'unknown step %d' % m['kind'])} (refit {m['version']})", []).append(r)
    return "ranks are at different protocol steps: " + "; ".join(f"ranks {rs} in {k}" for k, rs in sorted(by.items()))


def _by_value(values: list[str]) -> dict[str, list[int]]:
    by: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        by.setdefault(v, []).append(r)
    return by


def agree(group, digest: str, errors: list[str], *, options: str = "", timeout: float | None = None,
          kind: int = 1, version: int = 0) -> None:
    """Collective: exchange plan digest, options and local errors; raise :class:`ReshardError` on
    every rank if any rank reported an error or the digests or options differ.  Never pickles.
    ``timeout`` bounds the wait (a rank that never joins makes the others raise after it)."""
    rank = dist.get_rank(group)
    t0 = time.monotonic()
    try:
        msgs = exchange(group, kind, digest=digest, version=version, ok=not errors, options=options,
                        text="; ".join(errors), timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a peer that died or never joined
        raise ReshardError(f"reshard {_KIND[kind]} failed on rank {rank} after {time.monotonic() - t0:.1f} s "
                           f"(a peer died, never joined, or the process group is broken): {type(e).__name__}: {e}"
                           + (f" | this rank's own problems: {'; '.join(errors)}" if errors else "")) from e
    problems = []
    step = step_mismatch(msgs, kind)
    if step:
        problems.append(step)
    hashes = [m["digest"] for m in msgs]
    if len(set(hashes)) > 1:
        by_hash = _by_value([h[:12] for h in hashes])
        problems.append("plan hashes differ between ranks: " + "; ".join(f"{h} on ranks {rs}" for h, rs in sorted(by_hash.items())))
    opt_texts = [m["options"] for m in msgs]
    if not step and len(set(opt_texts)) > 1:
        by_opt = _by_value(opt_texts)
        problems.append("options differ between ranks: " + "; ".join(f"{o or '(none)'} on ranks {rs}" for o, rs in sorted(by_opt.items())))
    texts: dict[str, list[int]] = {}
    for r, m in enumerate(msgs):
        if not m["ok"]:
            texts.setdefault(m["text"] or f"rank {r} failed its checks", []).append(r)
    for text, rs in texts.items():
        problems.append(text if len(rs) == 1 or text.startswith("rank ") else f"ranks {rs}: {text}")
    versions = sorted({m["version"] for m in msgs})
    if kind == 2 and not step and len(versions) > 1:
        problems.append(f"ranks retry different refit versions {versions}")
    if problems:
        head = "reshard refused before any transfer: " if kind == 1 else f"refit {version} retry refused: "
        raise ReshardError(head + " | ".join(problems))


def all_gather_json(obj, group=None, timeout: float | None = None) -> list:
    """Every rank's JSON-able ``obj``, in rank order (metadata exchange; never pickle)."""
    data = json.dumps(obj, sort_keys=True).encode()
    device = group_device(group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(world)]
    bounded_wait(dist.all_gather(sizes, size, group=group, async_op=True), timeout)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(longest, dtype=torch.uint8)
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(device)
    out = [torch.empty_like(buf) for _ in range(world)]
    bounded_wait(dist.all_gather(out, buf, group=group, async_op=True), timeout)
    return [json.loads(bytes(o[:int(n)].cpu().tolist()).decode()) for o, n in zip(out, sizes)]
