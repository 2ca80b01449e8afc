"""The package keeps its layers: no import circle (``TYPE_CHECKING`` imports included),
Ray imported only for backend="ray", no module reading or importing another's private
names, no module importing from a package above it (its ``__init__``), and both backends
implementing the whole `Backend` protocol the store calls."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import arrowbuf
from arrowbuf.backend import Backend
from arrowbuf.local import LocalBackend
from arrowbuf.ray.router import RayBackend

PACKAGE = Path(arrowbuf.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """arrowbuf modules ``path`` imports anywhere (functions included); those under
    ``if TYPE_CHECKING:`` only with ``type_checking``."""
    tree = ast.parse(path.read_text())
    skipped = set() if type_checking else {
        id(node) for guard in ast.walk(tree) if isinstance(guard, ast.If)
        and isinstance(guard.test, ast.Name) and guard.test.id == "TYPE_CHECKING" for node in ast.walk(guard)}
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


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    graph = {module_name(p): imports_of(p, known, type_checking) for p in paths}
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


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:   # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_closes_even_through_type_checking_imports():
    # An annotation-only import still says "this module needs that one": a circle
    # through one is a layer drawn the wrong way (move the type down instead).
    assert circles(import_graph(type_checking=True)) == []


def test_the_ray_backend_never_imports_the_store_facade():
    graph = import_graph()
    for module in (m for m in graph if m.startswith("arrowbuf.ray.")):
        assert "arrowbuf.store" not in graph[module], module


def module_map(package: str) -> list[str]:
    """The modules a package's docstring lists as bullets (``- `name`: its job``), in order."""
    return re.findall(r"^- `(\w+)`:", importlib.import_module(package).__doc__, flags=re.M)


def test_the_ray_packages_module_map_names_every_module_lowest_first():
    # Issue 36: arrowbuf/ray/__init__.py's map missed 5 of its 19 modules, and persist and actor
    # imported modules it listed after them.
    listed = module_map("arrowbuf.ray")
    modules = sorted(p.stem for p in (PACKAGE / "ray").glob("*.py") if p.name != "__init__.py")
    assert (sorted(set(listed)), len(listed)) == (modules, len(set(listed))), \
        f"arrowbuf/ray/__init__.py's map lacks {sorted(set(modules) - set(listed))}, names gone or twice " \
        f"{sorted(n for n in listed if n not in modules or listed.count(n) > 1)}"
    graph = import_graph(type_checking=True)
    later = {f"arrowbuf.ray.{name}": {f"arrowbuf.ray.{n}" for n in listed[k:]} for k, name in enumerate(listed)}
    upward = {module: sorted(graph[module] & after) for module, after in later.items() if graph[module] & after}
    assert upward == {}, "modules importing ones the map lists after them (list them lower)"


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


# -- private names ------------------------------------------------------------------

#: The one function allowed to read private names of torch and tensordict (documented there).
INTERNALS = ("arrowbuf._pool", "torch_internals")
#: Most cross-module private reaches the package may keep (issue 24: all of them in `INTERNALS`).
MAX_REACHES = 5


def private_reaches(path: Path) -> list[tuple[str, int, str]]:
    """``x._name`` reads in ``path`` where ``_name`` is defined nowhere in that module (no
    def, class, assignment, argument or import of it): a reach into another module's
    object, ``self._backend`` of a method holder defined elsewhere included. Each as
    (enclosing top-level function or class, line, the expression)."""
    tree = ast.parse(path.read_text())
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            own.add(node.attr)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.alias):
            own.add((node.asname or node.name).split(".")[0])
    found = []
    for top in tree.body:
        for node in ast.walk(top):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in own:
                found.append((getattr(top, "name", ""), node.lineno, ast.unparse(node)))
    return found


def all_private_reaches() -> dict[str, list[tuple[str, int, str]]]:
    return {module_name(p): reaches for p in sorted(PACKAGE.rglob("*.py")) if (reaches := private_reaches(p))}


def test_modules_read_no_private_names_of_other_modules_but_the_documented_torch_internals():
    reaches = all_private_reaches()
    outside = {module: [r for r in found if (module, r[0]) != INTERNALS] for module, found in reaches.items()}
    assert {m: found for m, found in outside.items() if found} == {}, "private names read outside " + ".".join(INTERNALS)
    total = sum(map(len, reaches.values()))
    assert total <= MAX_REACHES, reaches
    module, function = INTERNALS
    assert inspect.getdoc(getattr(__import__(module, fromlist=[function]), function)), "undocumented internals"


def test_a_reach_through_self_of_a_class_defined_elsewhere_is_found(tmp_path):
    holder = tmp_path / "holder.py"
    holder.write_text("class Sampling:\n    def sample(self):\n        return self._backend.sample()\n")
    assert private_reaches(holder) == [("Sampling", 3, "self._backend")]
    owner = tmp_path / "owner.py"
    owner.write_text("class Store:\n    def __init__(self):\n        self._backend = 1\n"
                     "    def sample(self):\n        return self._backend\n")
    assert private_reaches(owner) == []


def resolved(path: Path, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` of ``path`` names, its relative levels resolved."""
    if not node.level:
        return node.module or ""
    parts = module_name(path).split(".")
    base = parts[:len(parts) - node.level + (path.name == "__init__.py")]
    return ".".join(base + ([node.module] if node.module else []))


def private_imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """``from m import _name`` in ``path``, ``m`` another arrowbuf module (its underscore modules
    included): (line, the import). Importing a private *module* is fine; its public names are its API."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (source := resolved(path, node)).split(".")[0] == "arrowbuf":
            found += [(node.lineno, f"from {source} import {alias.name}") for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")
                      and f"{source}.{alias.name}" not in known]
    return found


def test_no_module_imports_private_names_of_another_module():
    # Issue 36: freshness imported _column and _refresh of _version_spans (now shard_bounds,
    # version_column, episode_versions there). The bound is 0: a name another module needs is public.
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    found = {module_name(p): imports for p in paths if (imports := private_imports(p, known))}
    assert found == {}


def upward_imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """Imports in ``path`` of names (not modules) from the ``__init__`` of a package above it
    (``from arrowbuf import __version__``, ``import arrowbuf``): (line, the import). A
    package's own ``__init__`` may import from its modules, never the reverse."""
    module = module_name(path)
    above = {".".join(module.split(".")[:k]) for k in range(1, module.count(".") + 1)}
    if path.name == "__init__.py":
        above.discard(module)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names if a.name in above]
        elif isinstance(node, ast.ImportFrom) and (source := resolved(path, node)) in above:
            found += [(node.lineno, f"from {source} import {a.name}") for a in node.names
                      if f"{source}.{a.name}" not in known]   # a submodule is not the package's own name
    return found


def test_no_module_imports_from_a_package_above_it():
    # Issue 36: parquet.py imported __version__ from the package top (now arrowbuf._version).
    paths = sorted(PACKAGE.rglob("*.py"))
    known = {module_name(p) for p in paths}
    found = {module_name(p): imports for p in paths if (imports := upward_imports(p, known))}
    assert found == {}


def test_private_and_upward_imports_are_found_absolute_or_relative(tmp_path, monkeypatch):
    package = tmp_path / "arrowbuf"
    (package / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "_b.py", "sub/__init__.py", "sub/c.py"):
        (package / name).write_text("")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    known = {"arrowbuf", "arrowbuf.a", "arrowbuf._b", "arrowbuf.sub", "arrowbuf.sub.c"}
    c = package / "sub" / "c.py"
    c.write_text("from arrowbuf._b import _x, y, __version__\nfrom .._b import _z\nfrom ..a import ok\n"
                 "from arrowbuf import __version__, a\nfrom .. import _b\nfrom . import name\nimport arrowbuf.a\n"
                 "import arrowbuf\n")
    assert private_imports(c, known) == [(1, "from arrowbuf._b import _x"), (2, "from arrowbuf._b import _z")]
    assert upward_imports(c, known) == [(4, "from arrowbuf import __version__"), (6, "from arrowbuf.sub import name"),
                                        (8, "import arrowbuf")]
    init = package / "sub" / "__init__.py"
    init.write_text("from arrowbuf.sub.c import f\nfrom . import c\nfrom .. import name\n")
    assert upward_imports(init, known) == [(3, "from arrowbuf import name")]


# -- the backend contract -------------------------------------------------------------

def protocol_members() -> dict[str, object]:
    """Every member `Backend` declares: annotated attributes, properties and methods."""
    members = {name: None for name in getattr(Backend, "__annotations__", {})}
    members.update({name: value for name, value in vars(Backend).items()
                    if not name.startswith("_") and (callable(value) or isinstance(value, property))})
    return members


def test_the_backend_protocol_lists_what_the_store_calls():
    called = set()
    for node in ast.walk(ast.parse((PACKAGE / "store.py").read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) \
                and node.value.attr == "_backend":
            called.add(node.attr)
    assert called and called <= set(protocol_members()), called - set(protocol_members())


@pytest.mark.parametrize("backend", [LocalBackend, RayBackend], ids=lambda b: b.__name__)
def test_each_backend_implements_every_member_of_the_protocol(backend):
    missing, mismatched = [], []
    for name, member in protocol_members().items():
        if not hasattr(backend, name) and name not in inspect.get_annotations(backend):   # set by __init__
            missing.append(name)
        elif callable(member) and not isinstance(member, property):
            expected = list(inspect.signature(member).parameters)
            got = list(inspect.signature(getattr(backend, name)).parameters)
            if isinstance(inspect.getattr_static(backend, name), (classmethod, staticmethod)) or got != expected:
                mismatched.append(f"{name}{tuple(got)} != {tuple(expected)}")
    assert (missing, mismatched) == ([], [])


def test_importing_the_package_or_the_shard_actor_leaves_out_what_they_do_not_use():
    # Every Ray shard actor is a new process that imports `arrowbuf.ray.actor`: tensordict
    # (which imports torch._dynamo) would add ~1.5 CPU s to each; `import arrowbuf` alone
    # (the CLI's parser) imports neither torch nor tensordict until a name is used.
    code = ("import sys, arrowbuf; assert not {'torch', 'tensordict'} & set(sys.modules), 'arrowbuf imported torch'; "
            "assert arrowbuf.Schema.__name__ == 'Schema' and 'Schema' in dir(arrowbuf); "
            "assert arrowbuf.schema.Schema is arrowbuf.Schema and arrowbuf.ray.options.RayOptions is arrowbuf.RayOptions; "
            "import arrowbuf.ray.actor; assert 'tensordict' not in sys.modules, 'the actor imported tensordict'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
