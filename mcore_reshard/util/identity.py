"""Where bound tensors live in their modules, re-checked cheaply at every refit.

A refit binds tensors (``nn.Parameter`` objects and their storage).  The model they came from can
change around them: the trainer merges LoRA and puts a new module in place
(``model.decoder.layers[1].mlp = new_mlp``), re-wraps a submodule, replaces a parameter object
(``module.weight = nn.Parameter(...)``), an engine swaps a layer, a list of model chunks gets a new
chunk.  The bound tensors then still exist, but the model no longer computes with them: a refit
that reads / writes them is silently wrong.  :class:`ModuleIdentity` records, for every bound name,
the objects along its path from a *holder* (the list of model chunks, the engine's model runner)
to the tensor, and :meth:`ModuleIdentity.check` walks that record (one attribute read per recorded
module edge and per tensor, ~1 us each)::

    rank | given                                   | check() after model.decoder.layers[1].mlp = new_mlp
    0    | names {"decoder.layers.1.mlp.fc1.weight": | new_mlp has the same parameters (names, shapes,
         |   ("decoder.layers.1.mlp.fc1.weight")}    |  dtypes): followed -> owners {name: new_mlp.fc1.weight}
         |                                           | other parameters (LoRA adapters, ...): problems

A module (or model chunk) replaced by one whose parameters and buffers have the same names, shapes
and dtypes is *followed*: ``check`` returns the new tensor objects for the bound names, and the
executor re-binds to their storage (:meth:`~mcore_reshard.core.executor.Resharder.watch`).  Any
other replacement -- other names, shapes or dtypes, a module removed, a bound tensor no longer a
tensor -- is a *problem* naming the rank, side, module path, both classes and the differences; the
refit is then refused on every rank before a byte moves.  With ``follow=False`` (a binding that
cannot be re-made in place: an engine's post-load buffers, the FP8 path) every replacement is a
problem.

:class:`TrackedTensors` is a ``dict`` of tensors that carries its :class:`ModuleIdentity`: the
readers that take tensors from modules (``read_layout``, ``read_hf_layout``, ``live_tensors``)
return one, and the integrations that bind them attach it (``join_refit``, ``MegatronRefit``).  A
dict rebuilt from it (a comprehension, ``dict(...)``) is a plain dict: its tensors are then checked
at the tensor level only (``param.data`` rebound).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch


@dataclass(eq=False)
class _Node:
    """A recorded object (a module, or the tensor at a leaf) and the edges below it that lead to bound tensors."""
    obj: Any
    path: str                                     # dotted, from the holder ("chunk 0: decoder.layers.1")
    children: dict = field(default_factory=dict)  # key -> _Node (modules)
    leaves: dict = field(default_factory=dict)    # key -> (bound name, tensor)


@dataclass(eq=False)
class _Root:
    holder: Any          # a list / tuple of modules, or an object with an attribute holding the module
    key: Any             # int: holder[key]; str: getattr(holder, key)
    prefix: str          # bound names under this root start with it
    node: _Node


def _get(obj, key):
    if key is None:          # a root given as the module itself
        return obj
    if isinstance(key, int):
        try:
            return obj[key]
        except (IndexError, KeyError, TypeError):
            return None
    return getattr(obj, key, None)


def _label(root: _Root) -> str:
    if root.key is None:
        return root.prefix.rstrip(".") or "model"
    return f"[{root.key}]" if isinstance(root.key, int) else str(root.key)


def signature(module: torch.nn.Module) -> dict[str, tuple]:
    """Every parameter and buffer under ``module``: name -> (kind, shape, dtype)."""
    out = {n: ("parameter", tuple(p.shape), p.dtype) for n, p in module.named_parameters(remove_duplicate=False)}
    out.update((n, ("buffer", tuple(b.shape), b.dtype)) for n, b in module.named_buffers(remove_duplicate=False))
    return out


def signature_diff(old: torch.nn.Module, new: torch.nn.Module, limit: int = 6) -> str | None:
    """What differs between the parameters and buffers of two modules (None: same names, kinds, shapes, dtypes)."""
    a, b = signature(old), signature(new)
    if a == b:
        return None
    parts = []
    missing, extra = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    other = sorted(n for n in set(a) & set(b) if a[n] != b[n])
    if missing:
        parts.append(f"missing {', '.join(missing[:limit])}" + (" ..." if len(missing) > limit else ""))
    if extra:
        parts.append(f"new {', '.join(f'{n} {list(b[n][1])}' for n in extra[:limit])}" + (" ..." if len(extra) > limit else ""))
    if other:
        parts.append("changed " + ", ".join(f"{n} {list(a[n][1])} {str(a[n][2]).removeprefix('torch.')} -> "
                                            f"{list(b[n][1])} {str(b[n][2]).removeprefix('torch.')}" for n in other[:limit]))
    return "; ".join(parts)


def _flatten(roots: list) -> tuple[list, list]:
    """Every recorded edge of ``roots`` (:class:`_Root`) as ``(mapping, key, object)``: the dict of its
    parent module that holds it (``_modules`` / ``_parameters`` / ``_buffers``, what ``named_parameters``
    walks) -- the fast list --, and ``(holder, key, object)`` read generically (roots, attributes
    outside those dicts)."""
    fast: list[tuple] = []
    generic: list[tuple] = [(r.holder, r.key, r.node.obj) for r in roots]

    def edges(node: _Node) -> None:
        m = node.obj
        slots = [getattr(m, "_modules", {}), getattr(m, "_parameters", {}), getattr(m, "_buffers", {})]
        items = [(k, c.obj) for k, c in node.children.items()] + [(k, t) for k, (_, t) in node.leaves.items()
                                                                  if t is not None]
        for key, obj in items:
            where = next((d for d in slots if d.get(key) is obj), None)
            if where is not None:
                fast.append((where, key, obj))
            else:
                generic.append((m, key, obj))
        for c in node.children.values():
            edges(c)
    for r in roots:
        edges(r.node)
    return fast, generic


def _below(node: _Node, rel: str = "", tensors: bool = False):
    """(bound name, path below ``node`` -- or the tensor, with ``tensors``) of every leaf under ``node``."""
    for key, (name, t) in node.leaves.items():
        yield name, (t if tensors else f"{rel}{key}")
    for key, child in node.children.items():
        yield from _below(child, f"{rel}{key}.", tensors)


class ModuleIdentity:
    """The objects along each bound tensor's path, checked at every refit (see the module doc).

    ``roots``: ``[(holder, key, prefix)]`` -- ``holder[key]`` (an int key), ``getattr(holder, key)``
    (a str key) or ``holder`` itself (key None) is a root module, and the bound names under it start
    with ``prefix``; a holder lets a replaced root be seen (a list of model chunks, an engine's model
    runner); ``names``: bound name ->
    dotted path of the tensor below its root (``"decoder.layers.1.mlp.linear_fc1.weight"``);
    ``side`` / ``rank`` for messages; ``follow``: whether a replaced module with the same parameters
    may be followed (else every replacement is a problem); ``leaves=False``: the modules along the
    paths only, not the tensor objects (a binding whose tensors are not the modules' own: an engine's
    loader-format buffers, whose parameters the engine re-registers)."""

    def __init__(self, roots: Iterable[tuple], names: Mapping[str, str], *, side: str, rank: int, follow: bool = True,
                 leaves: bool = True):
        self.side, self.rank, self.follow, self.leaves = side, rank, follow, leaves
        self._flat: list | None = None
        self.roots: list[_Root] = []
        for holder, key, prefix in roots:
            module = _get(holder, key)
            if not isinstance(module, torch.nn.Module):
                raise TypeError(f"{side} root {key!r}: not a torch.nn.Module ({type(module).__name__})")
            self.roots.append(_Root(holder, key, prefix, _Node(module, "")))
        self.names: dict[str, str] = {}
        for name, path in names.items():
            root = self._root_of(name)
            if root is not None and self._record(root.node, name, path, self.leaves):
                self.names[name] = path

    def _root_of(self, name: str) -> _Root | None:
        best = None
        for root in self.roots:
            if name.startswith(root.prefix) and (best is None or len(root.prefix) > len(best.prefix)):
                best = root
        return best

    @staticmethod
    def _record(node: _Node, name: str, path: str, leaves: bool = True) -> bool:
        """Record the objects from ``node`` down to the tensor at ``path`` (``leaves=False``: down to
        its module); False if it is not there."""
        *mods, leaf = path.split(".")
        for key in mods:
            child = node.children.get(key)
            if child is None:
                obj = _get(node.obj, key)
                if not isinstance(obj, torch.nn.Module):
                    return False
                child = node.children[key] = _Node(obj, f"{node.path}.{key}".lstrip("."))
            node = child
        t = _get(node.obj, leaf) if leaves else None
        if leaves and not isinstance(t, torch.Tensor):
            return False
        node.leaves[leaf] = (name, t)      # t None: the module only
        return True

    def restricted(self, names: Iterable[str], *, side: str | None = None, follow: bool | None = None,
                   rank: int | None = None) -> "ModuleIdentity":
        """The same roots, recording only ``names`` (the tensors a binding kept); ``side`` / ``follow`` /
        ``rank`` replaced when given."""
        keep = set(names)
        return ModuleIdentity([(r.holder, r.key, r.prefix) for r in self.roots],
                              {n: p for n, p in self.names.items() if n in keep},
                              side=side or self.side, rank=self.rank if rank is None else rank,
                              follow=self.follow if follow is None else follow, leaves=self.leaves)

    def check(self, *, follow: bool | None = None) -> tuple[list[str], dict[str, torch.Tensor]]:
        """``(problems, followed)``: what cannot be followed (each naming rank, side, module path and
        why), and bound name -> the tensor object that now holds it, for every bound tensor whose
        module or parameter object was replaced by one the refit can follow.  ``follow=False``: this
        check follows nothing (every replacement is a problem, the record unchanged).

        Cost: one dict lookup and identity compare per recorded edge while nothing changed (the
        common case); the full walk below only when one differs."""
        if self._flat is None:
            self._flat = _flatten(self.roots)
        fast, generic = self._flat
        if all(d.get(k) is o for d, k, o in fast) and all(_get(h, k) is o for h, k, o in generic):
            return [], {}
        self._flat = None          # something moved: walk, then record the edges again
        if follow is not None and follow != self.follow:
            kept, self.follow = self.follow, follow
            try:
                return self.check()
            finally:
                self.follow = kept
        problems: list[str] = []
        followed: dict[str, torch.Tensor] = {}
        for root in self.roots:
            now = _get(root.holder, root.key)
            if now is not root.node.obj:
                self._replaced(root.node, now, f"model chunk {_label(root)}", problems, followed, root)
            else:
                self._walk(root.node, _label(root), problems, followed)
        return problems, followed

    def _walk(self, node: _Node, where: str, problems: list, followed: dict) -> None:
        for key, child in node.children.items():
            now = _get(node.obj, key)
            if now is not child.obj:
                self._replaced(child, now, f"{where}: {child.path}", problems, followed, None)
            else:
                self._walk(child, where, problems, followed)
        for key, (name, t) in node.leaves.items():
            if t is None:
                continue
            now = _get(node.obj, key)
            if now is t:
                continue
            what = f"{self.side} tensor {name} ({where}: {f'{node.path}.{key}'.lstrip('.')})"
            if not isinstance(now, torch.Tensor):
                problems.append(f"rank {self.rank}: {what} is no longer a tensor of its module "
                                f"({type(now).__name__}): the model does not compute with the bound tensor")
            elif not self.follow:
                problems.append(f"rank {self.rank}: {what} was replaced by another tensor object after binding; this "
                                "binding cannot follow it: bind again")
            else:
                node.leaves[key] = (name, now)
                followed[name] = now

    def _replaced(self, node: _Node, now, where: str, problems: list, followed: dict, root: _Root | None) -> None:
        """The module recorded at ``node`` is now ``now``: follow it (same parameters) or say why not."""
        old = node.obj
        head = f"rank {self.rank}: {self.side} module {where} ({type(old).__name__}) was replaced after binding"
        if not isinstance(now, torch.nn.Module):
            problems.append(f"{head} by {type(now).__name__}: its bound tensors are not in the model any more")
            return
        diff = signature_diff(old, now)
        if diff is not None:
            problems.append(f"{head} by a {type(now).__name__} with other parameters ({diff}): the refit cannot "
                            "write them; bind again for the new module")
            return
        if not self.follow:
            problems.append(f"{head} by a {type(now).__name__}; this binding cannot follow a replaced module: bind again")
            return
        fresh = _Node(now, node.path)
        lost = []
        for name, rel in _below(node):
            if not self._record(fresh, name, rel, self.leaves):
                lost.append(name)
        if lost:
            problems.append(f"{head} by a {type(now).__name__} in which {', '.join(lost[:4])} cannot be found")
            return
        node.obj, node.children, node.leaves = fresh.obj, fresh.children, fresh.leaves
        if root is not None:
            root.node = node
        for name, t in _below(node, tensors=True):
            if t is not None:
                followed[name] = t


class TrackedTensors(dict):
    """A ``dict`` of tensors taken from modules, carrying their :class:`ModuleIdentity` (``identity``)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], identity: ModuleIdentity | None):
        super().__init__(tensors)
        self.identity = identity

    def subset(self, names: Iterable[str]) -> "TrackedTensors":
        """The tensors of ``names`` only, still carrying the identity."""
        keep = set(names)
        return TrackedTensors({n: t for n, t in self.items() if n in keep}, self.identity)


def identity_of(tensors, side: str, *, follow: bool | None = None, rank: int | None = None) -> ModuleIdentity | None:
    """The :class:`ModuleIdentity` a mapping of tensors carries (:class:`TrackedTensors`), restricted to
    its current names, for ``side`` (None: it carries none)."""
    ident = getattr(tensors, "identity", None)
    return ident.restricted(tensors, side=side, follow=follow, rank=rank) if isinstance(ident, ModuleIdentity) else None


def tracked(modules: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *, rank: int, side: str = "dst",
            follow: bool = True, leaves: bool = True) -> TrackedTensors:
    """``tensors`` (named ``prefix + parameter name`` under ``modules``: ``{prefix: module}``, or
    ``{prefix: (holder, key)}`` when a holder keeps the module, e.g. ``(model_runner, "model")``) with
    the identity of the modules they came from."""
    roots = [(*(m if isinstance(m, tuple) else (m, None)), prefix) for prefix, m in modules.items() if m is not None]
    names = {}
    for n in tensors:
        best = max((p for p in modules if n.startswith(p)), key=len, default=None)
        if best is not None:
            names[n] = n[len(best):]
    return TrackedTensors(tensors, ModuleIdentity(roots, names, side=side, rank=rank, follow=follow, leaves=leaves))


__all__ = ["ModuleIdentity", "TrackedTensors", "identity_of", "signature", "signature_diff", "tracked"]
