"""torch, imported where tensors are made and nowhere else.

A Ray shard actor keeps numpy columns and ships Arrow and numpy bytes: it never builds a
tensor, and importing torch cost each actor process about 0.9 CPU s of its ~1.2 s start
(``python -X importtime -c "import arrowbuf.ray.actor"``). So the modules an actor imports
(`fields`, `shard`, `layout`, `tensors`, `_pool`, `_checks`, `_sumtree`, `advantages`,
`ray.shipping`) do not import torch at the top: a function that makes or reads tensors
imports it, and a type test goes through `is_tensor` / `is_dtype`, which never import it
(an object cannot be a torch tensor in a process that has not imported torch). So do the
modules a writing process imports (`store`, `episodes`, `step_reading`, `stage_arrays`,
`autoreset`, `inplace`, `torchrl_layout`, `ray.router`, `ray.reader`, `ray.gather`): an env
worker that writes numpy steps into a Ray store started ~1 CPU s faster without torch.
``tests/test_lazy_torch.py`` checks that an actor's process serves writes, samples and
payloads, and that a writer's process writes, saves, loads and exports, with torch never imported.

Dtypes travel as their names (``"float32"``, ``"bfloat16"``: `arrowbuf.fields` names,
and numpy's for extras), which are torch's attribute names too: `dtype` turns one into
the torch dtype where a tensor is made.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def is_tensor(value: Any) -> bool:
    """Whether ``value`` is a torch tensor (False, without importing torch, where torch is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def is_dtype(value: Any) -> bool:
    """Whether ``value`` is a torch dtype (False, without importing torch, where torch is not imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.dtype)


def is_tensordict(value: Any) -> bool:
    """Whether ``value`` is a TensorDict (False, without importing tensordict, where it is not imported:
    tensordict costs ~1.8 CPU s on top of torch, for processes that only write, load or export)."""
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and isinstance(value, tensordict.TensorDictBase)


@functools.lru_cache(maxsize=None)
def name_of(torch_dtype: torch.dtype) -> str:
    """The name of a torch dtype (``torch.float32`` -> ``"float32"``), cached: a write reads it per field."""
    return str(torch_dtype).removeprefix("torch.")


@functools.lru_cache(maxsize=None)
def dtype(name: str) -> torch.dtype:
    """The torch dtype named ``name`` (an arrowbuf dtype name or a numpy dtype's name)."""
    import torch

    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise TypeError(f"no torch dtype is named {name!r}")
    return found
