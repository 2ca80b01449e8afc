"""Module hops: the calls of a code path that cross from one arrowbuf module into another.

How far a path is spread over the package, as a count: `crossings` runs ``call()`` under
``sys.setprofile`` and lists every Python call (a ``"call"`` event: a function entered,
or a generator resumed) whose callee and immediate caller frame both live in arrowbuf
modules, and in different ones. Calls within one module, calls from or into other
libraries (numpy, Ray, tensordict), C functions and other threads are not counted. A
path's *hops* are ``len(crossings(call))``.
"""

from __future__ import annotations

import sys
from typing import Any, Callable


def _module(frame: Any) -> str:
    return frame.f_globals.get("__name__", "") if frame is not None else ""


def crossings(call: Callable[[], Any]) -> list[tuple[str, str, str]]:
    """(caller module, callee module, callee function) of each crossing while ``call()`` runs."""
    seen = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee, caller = _module(frame), _module(frame.f_back)
        if callee != caller and callee.startswith("arrowbuf") and caller.startswith("arrowbuf"):
            seen.append((caller, callee, frame.f_code.co_name))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(previous)
    return seen
