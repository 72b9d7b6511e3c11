"""The package's shape: each layer imports only the layers below it, the pure layers never import
torch, and only the executor moves bytes (static checks of the source, every import included,
also the lazy ones inside functions)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mcore_reshard"

# layer of each part of the package (a module may import its own part and lower layers only);
# parts of one layer are independent of each other
LAYERS = {
    "core": 0,
    "mapper": 1,
    "sources": 2, "targets": 2, "fp8": 2,
    "refit": 3, "dtensor_reshard": 3,
    "export": 4,
    "integrations": 4,
    "testing": 5,
    "tools": 6,
    "util": -1,
}
# order inside core: layout descriptors, then the planner and DTensor views, then the executor
CORE = {"box": 0, "mesh": 0, "layout": 1, "dtensor": 2, "planner": 2, "executor": 3}
# pure metadata: no torch at all (the planner layer and everything it reads)
PURE = ("core.box", "core.mesh", "core.layout", "core.planner", "mapper", "targets", "fp8.layout", "fp8.plan", "fp8.shared",
        "fp8.groups", "fp8.regions")
# the only places that call point-to-point operations: the executor, the benchmark's baseline, and the
# tiny test models' pipeline-parallel forward (activations, not weights)
P2P = ("core.executor", "tools.bench.live", "testing.tiny_models")   # + the tiny models' pipeline forward
# units still being split (must shrink to empty; each entry is a module or a function / class)
KNOWN_LONG = {"core.executor.resharder.Resharder"}
P2P_CALL = re.compile(r"\b(isend|irecv|batch_isend_irecv|P2POp)\b|\bdist\.(send|recv)\(")


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Package-relative names of every package module ``name`` imports (anywhere in the file)."""
    is_pkg = path.name == "__init__.py"
    pkg = name.split(".") if is_pkg else name.split(".")[:-1]
    if name == "":
        pkg = []
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom):
            if n.level:
                base = pkg[: len(pkg) - (n.level - 1)] if n.level > 1 else pkg
                tgt = ".".join(base + ([n.module] if n.module else []))
            elif (n.module or "").startswith("mcore_reshard"):
                tgt = n.module[len("mcore_reshard"):].lstrip(".")
            else:
                continue
            out.add(tgt)
            out.update(f"{tgt}.{a.name}".lstrip(".") for a in n.names)
        elif isinstance(n, ast.Import):
            out.update(a.name[len("mcore_reshard"):].lstrip(".") for a in n.names if a.name.startswith("mcore_reshard"))
    mods = _modules()
    return {t for t in out if t in mods and t != name and t != ""}


def _part(name: str) -> str:
    return name.split(".")[0]


def _rank(name: str) -> tuple[int, int]:
    part = _part(name)
    if part not in LAYERS:
        pytest.fail(f"module mcore_reshard.{name}: part {part!r} has no layer; add it to LAYERS in {__file__}")
    sub = CORE.get(name.split(".")[1], 0) if part == "core" and "." in name else 0
    return LAYERS[part], sub


def test_every_import_goes_down_the_layers():
    bad = []
    for name, path in _modules().items():
        if name == "":
            continue      # the package root re-exports the core
        me = _rank(name)
        for dep in _imports(name, path):
            if dep == "" or _part(dep) == "":
                continue
            other = _rank(dep)
            same_part = _part(dep) == _part(name)
            if same_part and _part(name) != "core":
                continue
            if other[0] > me[0] or (other[0] == me[0] and not same_part) or (same_part and other[1] > me[1]):
                bad.append(f"{name} (layer {me}) imports {dep} (layer {other})")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_between_modules():
    """Depth-first search over module imports (a package's ``__init__`` re-exporting its own
    submodules is not an edge back)."""
    graph = {n: sorted(d for d in _imports(n, p) if not d.startswith(n + ".")) for n, p in _modules().items() if n}
    done: set[str] = set()

    def visit(n: str, stack: list[str]) -> None:
        for d in graph.get(n, ()):
            if d in stack:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in done:
                visit(d, stack + [d])
        done.add(n)

    for n in graph:
        if n not in done:
            visit(n, [n])


@pytest.mark.parametrize("prefix", PURE)
def test_pure_layers_never_import_torch(prefix):
    for name, path in _modules().items():
        if name == prefix or name.startswith(prefix + "."):
            for n in ast.walk(ast.parse(path.read_text())):
                mods = [a.name for a in n.names] if isinstance(n, ast.Import) else \
                       [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
                assert not any(m == "torch" or m.startswith("torch.") for m in mods), \
                    f"mcore_reshard.{name} imports torch ({mods}): the planner layer is pure metadata"


def test_only_the_executor_moves_bytes():
    bad = [name for name, path in _modules().items()
           if P2P_CALL.search(path.read_text()) and not any(name == p or name.startswith(p + ".") for p in P2P)]
    assert not bad, f"point-to-point calls outside the executor: {bad}"


def test_no_module_or_unit_too_long():
    """The yardstick of the package's shape: no module over 650 lines, no function or class over 160."""
    long = []
    for name, path in _modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 650 and name not in KNOWN_LONG:
            long.append(f"module {name}: {len(text.splitlines())} lines")
        for n in ast.walk(ast.parse(text)):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.end_lineno - n.lineno >= 160 \
                    and f"{name}.{n.name}" not in KNOWN_LONG:
                long.append(f"{name}.{n.name}: {n.end_lineno - n.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_every_subpackage_is_installed():
    """A package missing from pyproject's list works in an editable checkout and breaks a real install."""
    try:
        import tomllib
    except ModuleNotFoundError:     # Python 3.10
        pytest.skip("tomllib needs Python >= 3.11")
    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("mcore_reshard", *p.parent.relative_to(PKG).parts)) for p in PKG.rglob("__init__.py")}
    assert found - listed == set(), f"subpackages not in pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
