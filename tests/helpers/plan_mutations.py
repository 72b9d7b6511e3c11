"""Field-by-field tampering of a JSON plan, and an in-process mirror of what the executor does.

``mutate(pj, rnd)`` returns ``(label, mutated copy)``: one field of one copy / message / tensor /
buffer / padding entry / the plan header changed (ints off by one, doubled, zeroed, negative,
fractional; names swapped for other names or unknown ones; boxes shifted, resized, reshaped with
the same element count; dtypes relabelled).  ``rnd`` is a ``random.Random`` (hypothesis'
``st.randoms()`` in the property test, a seeded one for the multi-process batch).

``simulate(plan, S, D)`` applies a plan to per-rank tensor dicts the way the executor does (one
staging buffer per message, entries viewed at their byte offset as the source dtype and box,
unpacked with ``copy_`` after a reshape; zero padding), so that a tampered plan that passes every
check can be compared with the reference without processes.
"""
from __future__ import annotations

import copy

import torch

from mcore_reshard.core.executor import torch_dtype

DTYPES = ["float32", "int32", "bfloat16", "float16", "uint8", "bool", "float8_e4m3fn", "float64", "int64"]


def _int(rnd, x):
    return rnd.choice([x + 1, x - 1, 2 * x, 0, -1, x + 0.5, float(x), x + 16, 1 << 40, True])


def _box(rnd, box):
    offs, sizes = list(box[0]), list(box[1])
    kind = rnd.choice(["offset", "size", "reshape", "transpose", "ndim"])
    if not sizes:
        return [offs, sizes], "empty box kept"
    d = rnd.randrange(len(sizes))
    if kind == "offset":
        offs[d] = _int(rnd, offs[d])
    elif kind == "size":
        sizes[d] = _int(rnd, sizes[d])
    elif kind == "reshape" and len(sizes) >= 2:
        a, b = rnd.sample(range(len(sizes)), 2)
        if sizes[a] % 2 == 0:
            sizes[a] //= 2
            sizes[b] *= 2
    elif kind == "transpose" and len(sizes) >= 2:
        sizes = sizes[::-1]
        offs = offs[::-1]
    else:
        offs, sizes = offs + [0], sizes + [1]
    return [offs, sizes], f"{kind} dim {d}"


def _names(pj):
    t = sorted(pj["tensors"])
    b = sorted({n for side in pj["buffers"].values() for bufs in side.values() for n in bufs})
    return t, b


def _copy_field(rnd, pj, c, where):
    tensors, buffers = _names(pj)
    f = rnd.randrange(10)
    names = ["tensor", "box", "src", "src_buffer", "src_local", "dst", "dst_buffer", "dst_local", "nbytes", "offset"]
    if f in (0, 3, 6):
        pool = tensors if f == 0 else buffers
        c[f] = rnd.choice(pool + ["no.such.name"])
    elif f in (1, 4, 7):
        c[f], how = _box(rnd, c[f])
        return f"{where}.{names[f]} ({how})"
    else:
        c[f] = _int(rnd, c[f])
    return f"{where}.{names[f]}"


def mutate(pj: dict, rnd) -> tuple[str, dict]:
    q = copy.deepcopy(pj)
    target = rnd.choice(["local", "entry", "entry", "message", "tensor", "buffer", "padding", "header", "swap"])
    if target == "local" and q["local_copies"]:
        i = rnd.randrange(len(q["local_copies"]))
        return _copy_field(rnd, q, q["local_copies"][i], f"local_copies[{i}]"), q
    if target in ("entry", "swap") and q["messages"]:
        i = rnd.randrange(len(q["messages"]))
        m = q["messages"][i]
        if m["entries"]:
            j = rnd.randrange(len(m["entries"]))
            if target == "swap" and len(m["entries"]) > 1:
                k = (j + 1) % len(m["entries"])
                m["entries"][j][9], m["entries"][k][9] = m["entries"][k][9], m["entries"][j][9]
                return f"messages[{i}] entries {j},{k} offsets swapped", q
            return _copy_field(rnd, q, m["entries"][j], f"messages[{i}].entries[{j}]"), q
    if target == "message" and q["messages"]:
        i = rnd.randrange(len(q["messages"]))
        f = rnd.choice(["round", "src", "dst", "nbytes", "forward"])
        if f == "forward":
            q["messages"][i]["forward"] = rnd.choice([True, 1, "yes"]) if not q["messages"][i].get("forward") else False
            return f"messages[{i}].forward", q
        q["messages"][i][f] = _int(rnd, q["messages"][i][f])
        return f"messages[{i}].{f}", q
    if target == "tensor":
        n = rnd.choice(sorted(q["tensors"]))
        f = rnd.choice(["shape", "src_dtype", "dst_dtype", "both_dtypes"])
        if f == "shape":
            if q["tensors"][n]["shape"]:
                d = rnd.randrange(len(q["tensors"][n]["shape"]))
                q["tensors"][n]["shape"][d] = _int(rnd, q["tensors"][n]["shape"][d])
        elif f == "both_dtypes":
            q["tensors"][n]["src_dtype"] = q["tensors"][n]["dst_dtype"] = rnd.choice(DTYPES)
        else:
            q["tensors"][n][f] = rnd.choice(DTYPES)
        return f"tensors[{n}].{f}", q
    if target == "buffer":
        side = rnd.choice(sorted(q["buffers"]))
        ranks = sorted(q["buffers"][side])
        if ranks:
            r = rnd.choice(ranks)
            bufs = q["buffers"][side][r]
            if bufs:
                n = rnd.choice(sorted(bufs))
                if rnd.random() < 0.5 and bufs[n][0]:
                    d = rnd.randrange(len(bufs[n][0]))
                    bufs[n][0][d] = _int(rnd, bufs[n][0][d])
                    return f"buffers[{side}][{r}][{n}].shape", q
                bufs[n][1] = rnd.choice(DTYPES)
                return f"buffers[{side}][{r}][{n}].dtype", q
    if target == "padding" and q["padding"]:
        i = rnd.randrange(len(q["padding"]))
        q["padding"][i][2], how = _box(rnd, q["padding"][i][2])
        return f"padding[{i}] ({how})", q
    f = rnd.choice(["budget_bytes", "rounds"])
    q[f] = rnd.choice([float("nan"), q[f] + 0.5, -1, 0, str(q[f]), q[f] * 2])
    return f"header.{f}", q


def simulate(plan, S: dict, D: dict) -> None:
    """Mirror of ``Resharder.refit`` on per-rank dicts ``{rank: {buffer: tensor}}``."""
    for r, b, box in plan.padding:
        D[r][b][box.slices()].zero_()
    for c in plan.local_copies:
        d = D[c.dst][c.dst_buffer][c.dst_local.slices()]
        d.copy_(S[c.src][c.src_buffer][c.src_local.slices()].reshape(d.shape))
    for k in sorted({m.round for m in plan.messages}):
        for m in [m for m in plan.messages if m.round == k]:
            stage = torch.zeros(m.nbytes, dtype=torch.uint8)
            views = []
            have = D if getattr(m, "forward", False) else S     # a forward reads the sender's destination
            for c in m.entries:
                v = stage[c.offset:c.offset + c.nbytes].view(torch_dtype(plan.tensors[c.tensor]["src_dtype"])).view(c.src_local.sizes)
                v.copy_(have[c.src][c.src_buffer][c.src_local.slices()])
                views.append(v)
            for c, v in zip(m.entries, views):
                d = D[c.dst][c.dst_buffer][c.dst_local.slices()]
                d.copy_(v.reshape(d.shape))
