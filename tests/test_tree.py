"""The tree keeps the shape docs/internals.md promises: every module listed in its Layout
table (and nothing listed that is gone), each small and stating its job."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "arrowbuf"
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
MAX_LINES = 600   # issue 24's bound: split at seams (a job, a type), not at a line count


def layout_entries() -> set[str]:
    page = (ROOT / "docs" / "internals.md").read_text()
    table = page.split("## Layout", 1)[1].split("\n## ", 1)[0]
    names = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([\w/]+(?:\.py|/))`", line.split("|")[1]))
    return names


def test_the_internals_layout_table_lists_every_module_and_only_modules_that_exist():
    listed = layout_entries()
    modules = {str(p.relative_to(PACKAGE)) for p in MODULES}
    covered = {m for m in modules if m in listed or any(m.startswith(d) for d in listed if d.endswith("/"))}
    assert modules - covered == set(), "modules missing from docs/internals.md's Layout table"
    assert {n for n in listed if not (PACKAGE / n).exists()} == set(), "Layout lists modules that do not exist"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_states_its_job_and_stays_small(path):
    text = path.read_text()
    assert ast.get_docstring(ast.parse(text)), f"{path.name} has no module docstring stating its job"
    assert len(text.splitlines()) <= MAX_LINES, f"{path.name}: {len(text.splitlines())} lines, more than {MAX_LINES}"
