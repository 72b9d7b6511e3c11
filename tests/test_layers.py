"""The package's shape: the project's one numbering of its layers (the same table as README.md "The
layers"), every import pointing down it, the pure layers never importing torch, and only the executor
moving bytes (static checks of the source, every import included, also the lazy ones inside functions)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "mcore_reshard"

# The layers, by number and name.  Each layer is a list of tiers, each tier a tuple of units; a unit is a
# package or module of mcore_reshard (a module belongs to the longest unit its name starts with) and its
# modules import each other freely.  A unit may import: units of lower layers, units of earlier tiers of
# its own layer, and UNDER -- never a sibling of its own tier, a later tier, a higher layer, or anything
# OUTSIDE the library.  Two modules of sources/ sit where what they use puts them: hf_config reads the
# family tables (mapper), megatron_dtensor gathers over the world and builds DTensors (next to
# dtensor_reshard).
LAYERS = {
    1: ("layout descriptors", [("core.box", "core.mesh", "core.devices"), ("core.layout",), ("core.dtensor",), ("sources",)]),
    2: ("mapper", [("mapper", "targets"), ("fp8.quant_layout", "sources.hf_config")]),
    3: ("planner", [("core.planner",), ("fp8.regions",), ("fp8.groups",), ("fp8.shared",), ("fp8.quant_plan",)]),
    4: ("executor", [("core.executor",), ("fp8.quant_resharder",)]),
    5: ("integrations", [("colocate",), ("refit", "dtensor_reshard", "integrations", "sources.megatron_dtensor"), ("export",)]),
}
# under every layer, importing nothing of the package: utilities with no resharding logic, and the
# packages that span layers (their __init__ only documents)
UNDER = ("util", "core.gcpause", "core", "fp8")
# not the library: may import it, never imported by it; testing never imports tools
OUTSIDE = ("tools", "testing")
# pure metadata: no torch at all (the planner layer and everything it reads)
PURE = ("core.box", "core.mesh", "core.layout", "core.planner", "mapper", "targets", "fp8.quant_layout", "fp8.quant_plan", "fp8.shared",
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


def _unit(name: str) -> str:
    """The longest unit (of LAYERS, UNDER or OUTSIDE) that module ``name`` belongs to."""
    units = [u for _, tiers in LAYERS.values() for tier in tiers for u in tier] + list(UNDER) + list(OUTSIDE)
    found = [u for u in units if name == u or name.startswith(u + ".")]
    if not found:
        pytest.fail(f"module mcore_reshard.{name} has no layer: add it to LAYERS (or UNDER / OUTSIDE) in {__file__}")
    unit = max(found, key=len)
    if unit in ("core", "fp8") and name != unit:
        pytest.fail(f"module mcore_reshard.{name} has no layer: add it to LAYERS in {__file__}")
    return unit


def _place(unit: str) -> tuple[int, int] | None:
    """(layer, tier) of a unit of LAYERS; None for UNDER and OUTSIDE."""
    for layer, (_, tiers) in LAYERS.items():
        for tier, units in enumerate(tiers):
            if unit in units:
                return layer, tier
    return None


def _wrong_import(name: str, dep: str) -> str | None:
    """Why module ``name`` must not import module ``dep`` (None when it may)."""
    me, other = _unit(name), _unit(dep)
    if me == other:
        return None
    if me in UNDER:
        return f"{name} ({me}: under every layer) imports {dep}: it must import nothing of the package"
    if other in UNDER:
        return None
    if other in OUTSIDE:
        if me == "tools":
            return None
        if me in OUTSIDE:
            return f"{name} imports {dep}: {me}/ never imports {other}/"
        return f"{name} imports {dep}: {other}/ is outside the library, never imported by it"
    if me in OUTSIDE:
        return None
    (lm, tm), (lo, to) = _place(me), _place(other)
    if lo < lm or (lo == lm and to < tm):
        return None
    where = "a higher layer" if lo > lm else "a later tier of its layer" if to > tm else "a sibling of its tier"
    return (f"{name} (layer {lm} {LAYERS[lm][0]}) imports {dep} (layer {lo} {LAYERS[lo][0]}): "
            f"{where}; imports point down the layers")


def _wrong_imports(graph: dict[str, set[str]]) -> list[str]:
    return [why for name, deps in sorted(graph.items()) if name for dep in sorted(deps)
            if (why := _wrong_import(name, dep))]


def test_every_import_goes_down_the_layers():
    """The package root (``mcore_reshard/__init__``) is the front door above layer 5: it re-exports."""
    bad = _wrong_imports({name: _imports(name, path) for name, path in _modules().items() if name})
    assert not bad, "\n".join(bad)


def test_a_wrong_import_is_caught(tmp_path):
    """The check fails on imports that break the numbering: the layout importing the planner (up),
    the mapper importing a target layout (sibling), the planner importing the CLI (outside), a
    utility importing the library (under); and lets a downward import and a utility through."""
    layout = tmp_path / "layout.py"
    layout.write_text("from .box import Box\n\ndef f():\n    from .planner import make_plan\n")
    assert _imports("core.layout", layout) == {"core.box", "core.planner"}
    bad = _wrong_imports({"core.layout": _imports("core.layout", layout)})
    assert len(bad) == 1 and "core.layout (layer 1 layout descriptors) imports core.planner (layer 3" in bad[0], bad
    assert "a sibling of its tier" in _wrong_import("mapper.family", "targets.vllm")
    assert "a later tier" in _wrong_import("core.layout", "sources.megatron_model")
    assert "outside the library" in _wrong_import("core.planner", "tools.cli")
    assert "import nothing" in _wrong_import("util.progress", "core.box")
    assert "testing/ never imports tools/" in _wrong_import("testing.tiny_models", "tools.launch")
    assert _wrong_import("export", "refit") is None and _wrong_import("core.planner", "util.progress") is None
    assert _wrong_import("tools.cli", "testing.megatron_cpu") is None


def test_the_readme_states_the_same_layers():
    text = (PKG.parent / "README.md").read_text()
    missing = [f"| {n} | {name} |" for n, (name, _) in LAYERS.items() if f"| {n} | {name} |" not in text]
    assert not missing, f"README.md's layer table lacks rows {missing} (tests/test_layers.py LAYERS is the reference)"


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
