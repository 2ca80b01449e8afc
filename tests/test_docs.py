"""The documentation runs: docstring examples, and every code block of README.md and docs/*.md.

Conventions for the Markdown pages (README.md and every ``docs/*.md`` page):

- Every ```` ```python ```` block runs, in page order, in ONE namespace per page: a block may use
  the names an earlier block of the same page defined (``store``, ``batch``...), never a
  name from another page. Each page runs in a fresh temporary directory (also its ``$HOME``,
  so ``durable=True`` logs and ``out/`` exports land there). Pages run as a user pastes them:
  nothing is handed in. The pages whose code mentions ``ray`` run in a fresh ``python`` apart
  from this process (`run_pasted`), one page after the other in one process (each a python that
  imports torch costs seconds of the suite), each in a namespace and working directory of its own
  (their ``$HOME`` is one: Ray keeps its auth token there for the process), so each starts its own
  cluster with ``ray.init`` as a user must (the test session's cluster is never lent) and
  `ray.shutdown` ends it after the page; other pages run in this process, and
  stores they leave in the namespace are closed afterwards.
- Other languages (```` ```bash ````, ```` ```text ````...) are not run.
- A python block opts out only with the comment ``<!-- no-run: REASON -->`` on the line
  just before its fence, REASON being one of `REASONS` (a GPU, several nodes). Opt-outs are
  counted: `OPT_OUTS` lists how many each page has, and the test fails when a page has more or
  fewer, so a block cannot stop running without this file saying so.
- Relative links (``[text](path)``, images too) point to files that exist, and a ``#anchor``
  into a Markdown page to one of its headings (GitHub's heading ids); absolute URLs are not
  fetched.
"""

from __future__ import annotations

import doctest
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import arrowbuf

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.walk_packages(arrowbuf.__path__, "arrowbuf.")
                 if not m.name.startswith("arrowbuf.ray."))   # Ray examples are marked to skip
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 12 * 1024

REASONS = {"gpu": "needs a CUDA device", "cluster": "needs a Ray cluster of several nodes"}
OPT_OUTS: dict[str, int] = {}   # page (relative to the root) -> python blocks marked no-run; absent: 0

NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\w+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,})\s*([\w+-]*)")


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_of_each_module_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed"


# -- code blocks -----------------------------------------------------------------------------------


@dataclass
class Block:
    language: str
    line: int            # 1-based line of the block's first code line
    code: str
    no_run: str | None   # the opt-out reason, or None


def code_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, in order, with their language and opt-out marker."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        previous = lines[i - 1].strip() if i else ""
        marker = NO_RUN.match(previous)
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        assert j < len(lines), f"line {i + 1}: a {fence} fence that never closes"
        blocks.append(Block(language.lower(), i + 2, "\n".join(body) + "\n", marker.group(1) if marker else None))
        i = j + 1
    return blocks


def python_blocks(path: Path) -> list[Block]:
    return [b for b in code_blocks(path.read_text()) if b.language in ("python", "py")]


def close_stores(namespace: dict) -> None:
    """Close what a page left open: stores (their Ray shards), compat buffers, gymnasium envs."""
    for value in list(namespace.values()):
        if isinstance(value, arrowbuf.ExperienceStore) or type(value).__module__.startswith("gymnasium"):
            close = getattr(value, "close", None)
            if callable(close):
                close()


RUNNABLE = [p for p in PAGES if any(b.no_run is None for b in python_blocks(p))]


def mentions_ray(blocks: list[Block]) -> bool:
    return any(re.search(r"\bray\b", b.code) for b in blocks)


def runnable_blocks(page: Path) -> list[Block]:
    return [b for b in python_blocks(page) if b.no_run is None]


# The pages' blocks, pasted one after the other into one fresh interpreter (warnings are errors, as
# in this suite): each page in a namespace and a working directory of its own, each
# block padded so that a traceback names its real line in the page. A page's error is written down
# and the next page runs; Ray is shut down after each page, as a user's process would end.
PASTE = ("import json, os, sys, traceback\n"
         "failed = {}\n"
         "with open(sys.argv[1]) as pasted:\n"
         "    pages = json.load(pasted)\n"
         "for page, directory, blocks in pages:\n"
         "    os.chdir(directory)\n"
         "    namespace = {'__name__': '__main__'}\n"
         "    try:\n"
         "        for line, code in blocks:\n"
         "            exec(compile('\\n' * (line - 1) + code, page, 'exec'), namespace)\n"
         "    except BaseException:\n"
         "        failed[page] = traceback.format_exc()\n"
         "    finally:\n"
         "        if 'ray' in sys.modules and sys.modules['ray'].is_initialized():\n"
         "            sys.modules['ray'].shutdown()\n"
         "with open(sys.argv[2], 'w') as out:\n"
         "    json.dump(failed, out)\n")


def run_pasted(pages: dict[Path, Path], directory: Path) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Run the runnable blocks of each page (-> its working directory) in one fresh ``python -W error``
    whose ``$HOME`` is ``directory``, with this checkout's arrowbuf and no Ray address, what a user
    pasting the pages gets: the process, and the traceback of each page that failed."""
    pasted, failed = directory / "blocks.json", directory / "failed.json"
    pasted.write_text(json.dumps([(str(page), str(home), [(b.line, b.code) for b in runnable_blocks(page)])
                                  for page, home in pages.items()]))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(HOME=str(directory), PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-W", "error", "-c", PASTE, str(pasted), str(failed)], cwd=directory,
                          env=env, capture_output=True, text=True, timeout=600)
    return done, json.loads(failed.read_text()) if failed.exists() else {}


@pytest.fixture(scope="module")
def pasted_ray_pages(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """The pages whose code mentions ``ray``, run as pasted (`run_pasted`), each in a directory of its own."""
    root = tmp_path_factory.mktemp("ray-pages")
    pages = {}
    for i, page in enumerate(p for p in RUNNABLE if mentions_ray(runnable_blocks(p))):
        pages[page] = root / f"page-{i}"
        pages[page].mkdir()
    return run_pasted(pages, root)


@pytest.mark.parametrize("page", RUNNABLE, ids=relative)
def test_the_python_blocks_of_each_page_run_in_order_in_one_namespace(page, tmp_path, monkeypatch, request):
    blocks = runnable_blocks(page)
    if mentions_ray(blocks):   # starts its own cluster, as pasted
        done, failed = request.getfixturevalue("pasted_ray_pages")
        assert done.returncode == 0 and str(page) not in failed, \
            f"{relative(page)} failed as pasted into a fresh python:\n{failed.get(str(page), done.stderr[-6000:])}"
        return
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    namespace: dict = {"__name__": f"docs:{relative(page)}"}
    try:
        for block in blocks:
            # Padded so that a traceback names the block's real line in the page.
            exec(compile("\n" * (block.line - 1) + block.code, str(page), "exec"), namespace)   # noqa: S102
    finally:
        close_stores(namespace)


def test_opt_outs_are_exactly_the_counted_ones_each_with_a_known_reason():
    counted = {}
    for page in PAGES:
        for block in python_blocks(page):
            if block.no_run is not None:
                assert block.no_run in REASONS, \
                    f"{relative(page)}:{block.line}: no-run reason {block.no_run!r}, expected one of {sorted(REASONS)}"
                counted[relative(page)] = counted.get(relative(page), 0) + 1
    assert counted == OPT_OUTS, "python blocks marked <!-- no-run: ... --> changed: update OPT_OUTS in this file"
    total = sum(len(python_blocks(p)) for p in PAGES)
    assert total - sum(counted.values()) >= 10, f"only {total - sum(counted.values())} of {total} blocks run"


def test_the_block_parser_reads_languages_markers_and_indented_fences():
    text = ("intro\n```python\na = 1\n```\n<!-- no-run: gpu -->\n```python\nb = 2\n```\n"
            "```bash\npip install x\n```\n- item\n\n  ```python\n  c = a\n  ```\n<!-- no-run: gpu -->\n\n"
            "````python\nd = '```'\n````\n")
    blocks = code_blocks(text)
    assert [(b.language, b.line, b.code, b.no_run) for b in blocks] == [
        ("python", 3, "a = 1\n", None), ("python", 7, "b = 2\n", "gpu"), ("bash", 10, "pip install x\n", None),
        ("python", 15, "c = a\n", None), ("python", 20, "d = '```'\n", None)]   # a marker binds the next line only


# -- links, size, commands ---------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown text outside code blocks and code spans, without URLs and pure anchors."""
    prose = re.sub(r"^(\s*)(`{3,}).*?^\s*\2\s*$", "", text, flags=re.M | re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = [m.group(1) for m in LINK.finditer(prose)]
    return [t for t in targets if not re.match(r"^([a-z][a-z0-9+.-]*:|#)", t, flags=re.I)]


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown text's headings: lower case, punctuation dropped, spaces to
    hyphens, repeats numbered (``-1``, ``-2``...)."""
    prose = re.sub(r"^(\s*)(`{3,}).*?^\s*\2\s*$", "", text, flags=re.M | re.S)
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", prose, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        seen[slug] = seen.get(slug, -1) + 1
        if seen[slug]:
            seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


@pytest.mark.parametrize("page", PAGES, ids=relative)
def test_every_relative_link_points_to_a_file_that_exists_and_a_heading_it_has(page):
    missing, unknown = [], []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            unknown.append(target)
    assert missing == [], f"{relative(page)} links to missing files: {missing}"
    assert unknown == [], f"{relative(page)} links to headings its targets lack: {unknown}"


def test_anchors_follow_githubs_heading_ids():
    text = "# Columns on a device (`storage_device`)\n## Data plane: blocks, readers\n## Tests\n## Tests\n"
    assert anchors(text) == {"columns-on-a-device-storage_device", "data-plane-blocks-readers", "tests", "tests-1"}


def test_the_link_checker_finds_links_and_images_but_not_urls_anchors_or_code():
    text = ("[a](docs/a.md) ![img](tools/b.png) [c](docs/c.md#part) [u](https://x.org) [s](#here)\n"
            "`[no](code.md)`\n```python\nx = '[no](block.md)'\n```\n")
    assert relative_links(text) == ["docs/a.md", "tools/b.png", "docs/c.md#part"]


def test_the_readme_is_a_five_minute_read_with_a_map_of_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    size = len(readme.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, more than {README_MAX_BYTES:,}"
    linked = {t.split("#", 1)[0] for t in relative_links(readme)}
    pages = {relative(p) for p in PAGES[1:]}
    assert pages - linked == set(), "docs pages the README's map does not link"


def test_the_readmes_two_commands_are_the_ones_ci_runs_verbatim():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("pip install")]
    shell = [line for b in code_blocks((ROOT / "README.md").read_text()) if b.language in ("bash", "sh")
             for line in b.code.splitlines()]
    assert ci == ['pip install "torch==2.13.0" && pip install -e . && arrowbuf demo',
                  'pip install "torch==2.13.0" && pip install -e ".[test]" && pytest']
    assert all(command in shell for command in ci), "the README's commands differ from .ci/run's"


# -- the README's package map ------------------------------------------------------------------------


def package_map(readme: str) -> list[str]:
    """What the first column of the README's "The package" table names, in order (paths relative
    to ``arrowbuf/``: ``name.py`` a module, ``name/`` a subpackage)."""
    section = readme.split("\n## The package\n", 1)[1].split("\n## ", 1)[0]
    return [name for line in section.splitlines() if line.startswith("| `")
            for name in re.findall(r"`([^`]+)`", line.split("|")[1])]


def test_the_readmes_package_map_names_every_public_module_and_only_files_that_exist():
    # Issue 36: the map named `_store_*.py` (gone) and left out 15 public modules. A module is
    # public when its name has no leading underscore; a subpackage is named as a folder (its own
    # modules are mapped in its __init__'s docstring, and docs/internals.md lists every module).
    package = ROOT / "arrowbuf"
    named = package_map((ROOT / "README.md").read_text())
    exists = [n for n in named if (package / n / "__init__.py").is_file() if n.endswith("/")] + \
        [n for n in named if n.endswith(".py") and (package / n).is_file()]
    public = {p.name for p in package.glob("*.py") if not p.name.startswith("_")} | \
        {p.parent.name + "/" for p in package.glob("*/__init__.py")}
    assert [n for n in named if n not in exists] == [], "the README's package map names files that do not exist"
    assert sorted(public - set(named)) == [], "public modules the README's package map does not name"
    assert len(named) == len(set(named)), "the README's package map names a file twice"
