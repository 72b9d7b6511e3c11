"""Layout analytics of a configuration: the element-wise lower bound of network bytes and the
gather + broadcast baseline (checkpoint unit by unit), both from the two layouts alone."""
from __future__ import annotations

from ...core.layout import Layout, itemsize

# ----------------------------------------------------------------------------------- layout analytics

def _tensor_index(lay: Layout):
    """tensor -> rank -> set of boxes (deduplicated)."""
    out: dict[str, dict[int, set]] = {}
    for r, bufs in lay.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                out.setdefault(p.tensor, {}).setdefault(r, set()).add(p.box)
    return out


def lower_bound(src: Layout, dst: Layout) -> dict:
    """Independent of the planner: bytes each destination rank needs and does not hold itself
    (source boxes of one tensor on one rank are disjoint in these layouts)."""
    sidx = _tensor_index(src)
    recv: dict[int, int] = {}
    for r, bufs in dst.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                isz = itemsize(src.tensors[p.tensor].dtype)
                have = sum(x.numel for s in sidx.get(p.tensor, {}).get(r, ()) if (x := s.intersect(p.box)) is not None)
                need = (p.box.numel - have) * isz
                if need:
                    recv[r] = recv.get(r, 0) + need
    return {"bytes": sum(recv.values()), "recv": recv}


def checkpoint_units(name: str, shape) -> list:
    """The tensors a gather + broadcast export moves one by one, as boxes of a canonical tensor: the
    Hugging Face checkpoint's tensors.  Stacked experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
    ``mlp.experts.down_proj`` ``[E, H, I]``) are ``experts.{e}.gate_proj`` / ``up_proj`` /
    ``down_proj``; everything else is one unit."""
    from ...core.box import Box
    if name.endswith("mlp.experts.gate_up_proj") and len(shape) == 3:
        E, I2, H = shape
        return [Box((e, k * (I2 // 2), 0), (1, I2 // 2, H)) for e in range(E) for k in (0, 1)]
    if name.endswith("mlp.experts.down_proj") and len(shape) == 3:
        E, H, I = shape
        return [Box((e, 0, 0), (1, H, I)) for e in range(E)]
    return [Box.full(shape)]


def _bins(boxes: dict, units: list) -> list[list]:
    """For each unit, the (box, ranks) entries that can touch it (by the leading index for experts)."""
    if len(units) == 1:
        return [list(boxes.items())]
    by_e: dict[int, list] = {}
    for box, ranks in boxes.items():
        for e in range(box.offsets[0], box.offsets[0] + box.sizes[0]):
            by_e.setdefault(e, []).append((box, ranks))
    return [by_e.get(u.offsets[0], []) for u in units]


def gather_broadcast(src: Layout, dst: Layout) -> dict:
    """The gather + broadcast baseline on these layouts (see the module docstring), one checkpoint
    tensor (:func:`checkpoint_units`) at a time: total bytes, per-rank sent / received bytes, and the
    per-unit items the cost model times."""
    s_boxes: dict[str, dict] = {}
    for r, bufs in src.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                s_boxes.setdefault(p.tensor, {}).setdefault(p.box, set()).add(r)
    d_boxes: dict[str, dict] = {}
    for r, bufs in dst.buffers.items():
        for b in bufs.values():
            for p in b.pieces:
                d_boxes.setdefault(p.tensor, {}).setdefault(p.box, set()).add(r)
    sent: dict[int, int] = {}
    recv: dict[int, int] = {}
    load: dict[int, int] = {}
    items = []
    gathered = broadcast = 0
    for name in sorted(dst.tensors):
        meta = src.tensors[name]
        isz = itemsize(meta.dtype)
        units = checkpoint_units(name, meta.shape)
        s_bins, d_bins = _bins(s_boxes[name], units), _bins(d_boxes.get(name, {}), units)
        for unit, s_bin, d_bin in zip(units, s_bins, d_bins):
            parts = [(x, ranks) for box, ranks in s_bin if (x := box.intersect(unit)) is not None]
            held: dict[int, int] = {}
            for x, ranks in parts:
                for r in ranks:
                    held[r] = held.get(r, 0) + x.numel
            root = min(held, key=lambda r: (-held[r], r))
            gather: dict[int, int] = {}
            for x, ranks in sorted(parts, key=lambda t: t[0]):
                if root in ranks:
                    continue
                h = min(ranks, key=lambda q: (load.get(q, 0), q))
                n = x.numel * isz
                load[h] = load.get(h, 0) + n
                gather[h] = gather.get(h, 0) + n
                sent[h] = sent.get(h, 0) + n
                recv[root] = recv.get(root, 0) + n
                gathered += n
            receivers = sorted({r for box, ranks in d_bin if box.intersect(unit) is not None for r in ranks} - {root})
            nbytes = unit.numel * isz
            for r in receivers:
                recv[r] = recv.get(r, 0) + nbytes
            if receivers:
                sent[root] = sent.get(root, 0) + nbytes * len(receivers)
            broadcast += nbytes * len(receivers)
            items.append({"nbytes": nbytes, "root": root, "gather": gather, "receivers": receivers})
    return {"bytes": gathered + broadcast, "gather_bytes": gathered, "broadcast_bytes": broadcast,
            "sent": sent, "recv": recv, "items": items, "units": len(items)}

