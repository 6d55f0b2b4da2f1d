"""The package's layers import one way (issue 15), read from every module's ``import`` statements (ast):

    tools -> runtime / codegen / passes / frontend / targets
    frontend -> passes.ir          passes -> passes.ir, targets          codegen -> passes.ir, targets
    passes.ir and targets -> nothing above them

plus: no ``__import__(...)`` outside the tests, and no import that exists only for its side effect (a name
imported and never used: a registration). ``from dayzero import UserError`` (the root's error classes) is allowed
everywhere; the root ``__init__`` itself (``dayzero.compile``) may reach the tools.
"""

from __future__ import annotations

import ast
from pathlib import Path


import dayzero

ROOT = Path(dayzero.__file__).parent
PKG = "dayzero"

# layer -> the dayzero packages it may import (besides itself and the root's error classes). The memory planner
# (passes/memory_plan.py) is a pure function over lifetimes, no graph: codegen lays programs out with it and the
# runtime's validator checks artifacts with it. The runtime reads checkpoints and runs the upstream reference.
ALLOWED = {
    "dayzero.frontend": ("dayzero.passes.ir",),
    "dayzero.passes.ir": (),
    "dayzero.passes": ("dayzero.passes.ir", "dayzero.targets"),
    "dayzero.codegen": ("dayzero.passes.ir", "dayzero.passes.memory_plan", "dayzero.targets"),
    "dayzero.targets": ("dayzero.passes.ir",),  # what an op's storage is (capabilities asks about kernels of it)
    "dayzero.runtime": ("dayzero.codegen", "dayzero.passes.ir", "dayzero.passes.memory_plan", "dayzero.targets",
                        "dayzero.frontend"),
}
KERNELS = "dayzero.codegen.kernels"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] == "tests":
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PKG, *parts])] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported dayzero module, line) for every import in the module, relative ones resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from dayzero.x import y`: y may be a module
                sub = f"{base}.{a.name}"
                found.append((sub if sub in MODULES else base, node.lineno))
    return [(m, line) for m, line in found if m == PKG or m.startswith(PKG + ".")]


def _layer(name: str) -> str | None:
    for layer in sorted(ALLOWED, key=len, reverse=True):  # passes.ir before passes
        if name == layer or name.startswith(layer + "."):
            return layer
    return None


def _within(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _violations(skip_kernels: bool) -> list[str]:
    bad = []
    for name, path in MODULES.items():
        layer = _layer(name)
        if layer is None:
            continue
        for mod, line in _imports(name, path):
            if mod == PKG or _within(mod, (layer, *ALLOWED[layer])):
                continue
            if layer == "dayzero.passes" and _within(mod, (KERNELS,)) and skip_kernels:
                continue  # test_passes_never_import_kernels
            bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return sorted(set(bad))


def test_layers_import_one_way():
    assert _violations(skip_kernels=True) == []


def test_passes_never_import_kernels():
    bad = [v for v in _violations(skip_kernels=False) if f"imports {KERNELS}" in v]
    assert bad == []


def test_frontend_never_imports_tools():
    assert not any(_within(m, ("dayzero.tools",)) for n, p in MODULES.items() if _within(n, ("dayzero.frontend",))
                   for m, _ in _imports(n, p))


def test_no_dunder_import():
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "__import__":
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert bad == []


def _unused_imports(path: Path) -> list[str]:
    """Names an import binds that the module never reads (nor exports in ``__all__``)."""
    tree = ast.parse(path.read_text())
    bound: dict[str, int] = {}
    probes = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try)
              and any(isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                      for h in t.handlers) for b in t.body for n in ast.walk(b)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in probes:
            for a in node.names:
                if a.name != "*" and not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                    bound[a.asname or a.name.split(".")[0]] = node.lineno
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    exported = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            exported = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    # a name read only inside a string annotation (``from __future__ import annotations``) counts as used
    text = path.read_text()
    return [f"{path.relative_to(ROOT)} {name}" for name, line in bound.items()
            if name not in used and name not in exported and f"{name}." not in text and f"{name}[" not in text
            and f"{name} |" not in text and f"| {name}" not in text and f": {name}" not in text
            and f"-> {name}" not in text and f"[{name}" not in text]


def _side_effect_imports() -> list[str]:
    return sorted(u for path in MODULES.values() if path.name != "__init__.py" for u in _unused_imports(path))


def test_no_import_only_for_side_effects():
    assert _side_effect_imports() == []
