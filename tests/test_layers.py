"""The package's import graph has no circle, and Ray is imported only for backend="ray"."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import arrowbuf

PACKAGE = Path(arrowbuf.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """arrowbuf modules ``path`` imports anywhere (functions included), except under TYPE_CHECKING."""
    tree = ast.parse(path.read_text())
    skipped = {id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
               and isinstance(guard.test, ast.Name) and guard.test.id == "TYPE_CHECKING"
               for node in ast.walk(guard)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in known}
    return found - {module_name(path)}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, known) for p in paths}
    # A package's __init__ re-exports its modules: importing a module imports its
    # package first, so an edge into a package's module is not a circle through it.
    return {m: {d for d in deps if not m.startswith(d + ".")}
            for m, deps in graph.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def test_no_module_of_arrowbuf_imports_itself_through_a_circle():
    assert find_circle(import_graph()) is None, " -> ".join(find_circle(import_graph()))


def test_the_ray_backend_never_imports_the_store_facade():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("arrowbuf.ray.")):
        assert "arrowbuf.store" not in graph[module], module


def test_importing_arrowbuf_and_a_local_store_does_not_import_ray():
    code = ("import sys, numpy as np, arrowbuf as ab; s = ab.ExperienceStore(10); "
            "s.add_episode({'obs': np.zeros((3, 2)), 'action': np.zeros(2), 'terminated': np.zeros(2, bool)}); s.sample(2); "
            "assert 'ray' not in sys.modules, 'ray imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_arrowbuf_module_imported_exists_in_this_tree():
    # An editable install of another checkout would otherwise serve a deleted module.
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    missing = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("arrowbuf"):
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("arrowbuf")]
            else:
                continue
            missing |= {f"{module_name(path)} imports {n}" for n in names if n not in known}
    assert not missing, sorted(missing)
