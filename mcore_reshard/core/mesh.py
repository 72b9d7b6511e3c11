"""Named device meshes and Megatron-Core's rank <-> coordinate mapping.

A :class:`Mesh` lists its axes fastest-varying first: ``rank = offset + sum(coord[a] * stride[a])``
with ``stride`` the running product of the sizes before ``a``.  This is exactly Megatron-Core's
``RankGenerator`` (``generate_masked_orthogonal_rank_groups``) for an order string such as the
default ``"tp-cp-ep-dp-pp"``.  Example, ``tp=2, pp=2`` on 4 ranks (dense mesh tp-cp-dp-pp)::

    rank | tp | dp | pp
    0    | 0  | 0  | 0
    1    | 1  | 0  | 0
    2    | 0  | 0  | 1
    3    | 1  | 0  | 1

Megatron builds two meshes over the same ranks: the dense one (axes tp, cp, dp, pp with ``ep=1``)
and the expert one (axes etp, ep, edp, pp; ``cp=1``), both from the same order string.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Iterable, Mapping, Sequence


class MeshError(ValueError):
    """A rank, axis or coordinate that the mesh does not have."""


@dataclass(frozen=True)
class Mesh:
    axis_names: tuple[str, ...]   # fastest-varying first
    axis_sizes: tuple[int, ...]
    rank_offset: int = 0

    def __post_init__(self):
        if len(self.axis_names) != len(self.axis_sizes):
            raise ValueError(f"mesh axes {self.axis_names} and sizes {self.axis_sizes} differ in length")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"repeated mesh axis in {self.axis_names}")
        if any(s < 1 for s in self.axis_sizes):
            raise ValueError(f"mesh axis sizes must be >= 1: {dict(zip(self.axis_names, self.axis_sizes))}")

    @staticmethod
    def of(axes: Mapping[str, int] | Sequence[tuple[str, int]], rank_offset: int = 0) -> "Mesh":
        items = list(axes.items()) if isinstance(axes, Mapping) else list(axes)
        return Mesh(tuple(a for a, _ in items), tuple(int(s) for _, s in items), rank_offset)

    @property
    def size(self) -> int:
        return prod(self.axis_sizes)

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.size)

    def axis_size(self, axis: str) -> int:
        return self.axis_sizes[self._index(axis)] if axis in self.axis_names else 1

    def _index(self, axis: str) -> int:
        try:
            return self.axis_names.index(axis)
        except ValueError:
            raise MeshError(f"mesh has no axis {axis!r}; axes are {self.axis_names}") from None

    def _strides(self) -> list[int]:
        strides, s = [], 1
        for size in self.axis_sizes:
            strides.append(s)
            s *= size
        return strides

    def coord(self, rank: int) -> dict[str, int]:
        """Coordinates of a global rank; MeshError names the rank when it is outside the mesh."""
        local = rank - self.rank_offset
        if not 0 <= local < self.size:
            raise MeshError(f"rank {rank} is outside the mesh {self} (ranks {self.ranks.start}..{self.ranks.stop - 1})")
        out = {}
        for name, size in zip(self.axis_names, self.axis_sizes):
            out[name] = local % size
            local //= size
        return out

    def rank_of(self, coord: Mapping[str, int]) -> int:
        r = self.rank_offset
        for name, size, stride in zip(self.axis_names, self.axis_sizes, self._strides()):
            c = coord.get(name, 0)
            if not 0 <= c < size:
                raise MeshError(f"coordinate {name}={c} outside axis size {size}")
            r += c * stride
        return r

    def group(self, rank: int, axes: str | Iterable[str]) -> list[int]:
        """Ranks that share every coordinate of ``rank`` except those on ``axes`` (sorted)."""
        axes = [axes] if isinstance(axes, str) else list(axes)
        for a in axes:
            self._index(a)
        base = self.coord(rank)
        groups = [dict(base)]
        for a in axes:
            groups = [dict(g, **{a: i}) for g in groups for i in range(self.axis_size(a))]
        return sorted(self.rank_of(g) for g in groups)

    def groups(self, axes: str | Iterable[str]) -> list[list[int]]:
        """All groups along ``axes``, as Megatron lists them (each sorted, in order of first rank)."""
        seen, out = set(), []
        for r in self.ranks:
            g = self.group(r, axes)
            if g[0] not in seen:
                seen.add(g[0])
                out.append(g)
        return out

    def device_mesh_shape(self) -> tuple[list[str], list[int]]:
        """Dimension names and sizes of the equivalent ``DeviceMesh`` (slowest axis first), so that
        ``torch.arange(size).reshape(sizes) + rank_offset`` is the rank tensor."""
        return list(reversed(self.axis_names)), list(reversed(self.axis_sizes))

    def to_json(self) -> dict:
        return {"axes": [[a, s] for a, s in zip(self.axis_names, self.axis_sizes)], "rank_offset": self.rank_offset}

    @staticmethod
    def from_json(obj) -> "Mesh":
        return Mesh.of([(a, s) for a, s in obj["axes"]], obj.get("rank_offset", 0))

    def __str__(self) -> str:
        inner = ",".join(f"{a}={s}" for a, s in zip(self.axis_names, self.axis_sizes))
        return f"Mesh({inner}" + (f"; ranks from {self.rank_offset})" if self.rank_offset else ")")


DEFAULT_ORDER = "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class MegatronMeshes:
    """The two meshes Megatron-Core builds for one parallel config."""
    dense: Mesh    # axes tp, cp, dp, pp (ordered by the order string)
    expert: Mesh   # axes etp, ep, edp, pp


def megatron_meshes(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                    etp: int | None = None, order: str = DEFAULT_ORDER, rank_offset: int = 0) -> MegatronMeshes:
    """Meshes equal to ``megatron.core.parallel_state.initialize_model_parallel`` for these sizes.

    ``etp`` defaults to ``tp`` (Megatron's ``expert_tensor_parallel_size=None``).
    Raises ValueError, naming the sizes and the order, for every config Megatron-Core rejects:
    sizes that do not divide ``world_size``; an order string with an unknown or repeated token, or
    missing an axis whose size is > 1 (axes of size 1 may be left out; they are appended);
    pp > 1 with an order not ending in ``pp`` while the dense and expert data-parallel sizes differ;
    dense and expert pipeline groups that differ (e.g. ``tp=2, pp=2, ep=2, etp=1`` with
    ``order="tp-pp-cp-ep-dp"``: the layers of one pipeline stage would live on different ranks).
    """
    etp = tp if etp is None else etp
    for name, size in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("etp", etp)):
        if int(size) < 1:
            raise ValueError(f"parallel size {name}={size} must be >= 1")
    tokens = order.lower().split("-")
    known = ("tp", "cp", "ep", "dp", "pp")
    bad = [t for t in tokens if t not in known]
    if bad:
        raise ValueError(f"order {order!r} has unknown token(s) {bad}; known: {'-'.join(known)}")
    if len(set(tokens)) != len(tokens):
        raise ValueError(f"order {order!r} repeats a token")
    if world_size % (tp * pp * cp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp}")
    dp = world_size // (tp * pp * cp)
    if world_size % (etp * ep * pp):
        raise ValueError(f"world size {world_size} is not divisible by etp*ep*pp = {etp}*{ep}*{pp}")
    edp = world_size // (etp * ep * pp)
    dense_sizes = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    for mesh_name, sizes in (("dense", dense_sizes), ("expert", expert_sizes)):
        missing = [f"{t}={sizes[t]}" for t in known if t not in tokens and sizes[t] > 1]
        if missing:
            raise ValueError(f"order {order!r} leaves out {', '.join(missing)} of the {mesh_name} mesh "
                             f"(world {world_size}, tp={tp} pp={pp} cp={cp} ep={ep} etp={etp}); "
                             "only axes of size 1 may be left out")
    if pp > 1 and tokens[-1] != "pp" and dp != edp:   # Megatron checks the order as given
        raise ValueError(f"order {order!r} does not end with pp, so the dense and expert data-parallel sizes must be "
                         f"equal, but dp={dp} and edp={edp} (world {world_size}, tp={tp} pp={pp} cp={cp} ep={ep} etp={etp})")
    for t in known:
        if t not in tokens:
            tokens.append(t)
    expert_names = {"tp": "etp", "ep": "ep", "dp": "edp", "pp": "pp", "cp": "cp"}
    dense = Mesh.of([(t, dense_sizes[t]) for t in tokens if t != "ep"], rank_offset)
    expert = Mesh.of([(expert_names[t], expert_sizes[t]) for t in tokens if t != "cp"], rank_offset)
    if pp > 1:
        dense_pp, expert_pp = dense.groups("pp"), expert.groups("pp")
        if sorted(dense_pp) != sorted(expert_pp):
            raise ValueError(f"order {order!r} gives different pipeline groups to the dense and expert layers "
                             f"(world {world_size}, tp={tp} pp={pp} cp={cp} ep={ep} etp={etp}): dense {dense_pp[:4]}"
                             f"{' ...' if len(dense_pp) > 4 else ''} vs expert {expert_pp[:4]}{' ...' if len(expert_pp) > 4 else ''}")
    return MegatronMeshes(dense, expert)
