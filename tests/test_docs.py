"""The examples in docstrings run and print what they say."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import arrowbuf

MODULES = sorted(m.name for m in pkgutil.walk_packages(arrowbuf.__path__, "arrowbuf.")
                 if not m.name.startswith("arrowbuf.ray."))   # Ray examples are marked to skip


@pytest.mark.parametrize("name", MODULES)
def test_the_docstring_examples_of_each_module_run(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, report=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} docstring examples of {name} failed"
