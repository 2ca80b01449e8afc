"""One owner per job (issue 33): no module of arrowbuf writes the state of another module's objects.

A write is an assignment (plain, augmented or annotated) or a ``del`` whose target is an
attribute of an object, or an item of such an attribute: ``regions.length[slots] += 1``,
``shard.write_pos = 0``, ``self._tails.sealed = {...}``. A module may write its own objects
(``self.x = ...``) and objects of its own classes; it may not write an attribute that only
classes of *other* arrowbuf modules define (assign on ``self``, declare in ``__slots__`` or as
a dataclass field). That owner offers a method instead (`OpenRegions.wrote`, `Stage.start_at`,
`ShardHandles.close`, ...). Attributes no arrowbuf class defines belong to other libraries
(ctypes' ``argtypes``, PyAV's ``thread_type``) and are their API; the few that an arrowbuf class
happens to define too are listed in `THIRD_PARTY` with the object they really belong to.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import arrowbuf

PACKAGE = Path(arrowbuf.__file__).parent

#: Writes into objects of other libraries whose attribute names an arrowbuf class also defines.
THIRD_PARTY = {
    ("arrowbuf._state_checks", "np.random.PCG64().state"): "a numpy bit generator's state (a probe)",
    ("arrowbuf.engine", "self._rng.bit_generator.state"): "the engine's numpy generator, restored from a checkpoint",
    ("arrowbuf.errors", "err.args"): "an exception's message, extended where it is raised again",
}


def module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, (ast.Assign, ast.Delete)):
        found = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            found += target.elts
        else:
            flat.append(target)
    return flat


def attribute_owners(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """attribute name -> the modules whose classes define it (on ``self``, in ``__slots__``, as a
    class-level name or a dataclass field, or by ``setattr(self, "name", ...)``)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for module, tree in trees.items():
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            for node in ast.walk(cls):
                for target in _targets(node):
                    if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                            and target.value.id == "self":
                        owners[target.attr].add(module)
                    elif isinstance(target, ast.Name) and node in cls.body:
                        owners[target.id].add(module)
                        if target.id == "__slots__" and isinstance(node.value, (ast.Tuple, ast.List)):
                            for slot in node.value.elts:
                                if isinstance(slot, ast.Constant) and isinstance(slot.value, str):
                                    owners[slot.value].add(module)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                        and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                        and node.args[0].id == "self" and isinstance(node.args[1], ast.Constant):
                    owners[node.args[1].value].add(module)
    return owners


def foreign_writes(root: Path) -> list[tuple[str, int, str]]:
    """(module, line, target) of every write in the package at ``root`` into an attribute that only
    other modules' classes define."""
    trees = {module_of(p, root): ast.parse(p.read_text()) for p in sorted(root.rglob("*.py"))}
    owners = attribute_owners(trees)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            for target in _targets(node):
                written = target
                while isinstance(written, ast.Subscript):
                    written = written.value
                if not isinstance(written, ast.Attribute):
                    continue
                if isinstance(written.value, ast.Name) and written.value.id in ("self", "cls"):
                    continue   # its own state
                defined_by = owners.get(written.attr, set())
                if defined_by and module not in defined_by:
                    found.append((module, node.lineno, ast.unparse(target)))
    return sorted(found)


def test_no_module_writes_the_state_of_another_modules_objects():
    found = [w for w in foreign_writes(PACKAGE) if (w[0], w[2]) not in THIRD_PARTY]
    assert found == [], "writes into other modules' objects (give the owner a method): " + repr(found)


def test_every_listed_third_party_write_still_exists():
    listed = {(m, t) for m, _, t in foreign_writes(PACKAGE)}
    assert set(THIRD_PARTY) <= listed, set(THIRD_PARTY) - listed


def test_writes_into_another_modules_objects_are_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "regions.py").write_text(
        "class Regions:\n    __slots__ = ('held',)\n    def __init__(self):\n        self.length = [0]\n"
        "        self.held = [False]\n    def wrote(self, slot):\n        self.length[slot] += 1\n")
    (package / "writer.py").write_text(
        "class Writer:\n    def __init__(self, regions):\n        self.regions = regions\n        self.steps = 0\n"
        "    def add(self, slot):\n        self.regions.length[slot] += 1\n        self.steps += 1\n"
        "        regions = self.regions\n        regions.held, other = [True], 0\n"
        "        self.regions.wrote(slot)\n        del regions.length\n")
    assert foreign_writes(package) == [("pkg.writer", 6, "self.regions.length[slot]"),
                                       ("pkg.writer", 9, "regions.held"),
                                       ("pkg.writer", 11, "regions.length")]
