"""A writer's staged columns, numpy arrays on the host or torch tensors on a device: made,
copied and read back (`arrowbuf.episodes.StepWriter`, `arrowbuf.step_reading`, `arrowbuf.autoreset`).

torch is imported only where a tensor is made (a device stage, a view of host rows as a
tensor): a process that writes numpy steps, the usual env worker, never imports it
(``tests/test_lazy_torch.py``), and a type test goes through `arrowbuf._lazy_torch.is_tensor`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from arrowbuf._checks import tensor_to_numpy
from arrowbuf._lazy_torch import is_tensor
from arrowbuf.errors import SchemaError
from arrowbuf.fields import Field, as_array, dtype_name
from arrowbuf.row_stage import RowStage
from arrowbuf.shard import Episode

if TYPE_CHECKING:
    import torch


def readable_tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor of a numpy array's values, without a copy when it is contiguous, to
    be read (copied from) only."""
    import torch

    array = np.ascontiguousarray(array)
    if array.flags.writeable:
        return torch.from_numpy(array)
    # Read-only arrays (Arrow, Ray's object store) are only read by the copy that
    # follows; torch warns because it has no read-only tensors.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


def host_tensor(array: np.ndarray, spec: Field) -> torch.Tensor:
    """A host array of field ``spec`` (bfloat16 as its uint16 bits) as a CPU tensor of the
    field's torch dtype, without a copy (to be read only)."""
    import torch

    tensor = readable_tensor(array)
    if spec.dtype == "bfloat16" and tensor.dtype == torch.uint16:
        return tensor.view(torch.bfloat16)
    return tensor


def step_tensor(value: Any, name: str) -> tuple[torch.Tensor, str]:
    """One column of a device-staged step as a tensor (a tensor as given, on its device;
    anything else read as `arrowbuf.fields.as_array` reads it) and its dtype name."""
    if is_tensor(value):
        return value.detach(), dtype_name(value.dtype)
    array, dtype = as_array(value, name)
    return readable_tensor(array), dtype


def stage_zeros(shape: tuple, spec: Field, device: torch.device | None, name: str = "?") -> Any:
    """A zeroed staging array of field ``spec`` (named ``name``): numpy (``device`` None) or a tensor
    on ``device``; a ragged or text field's ``[envs, steps]`` rows: a `arrowbuf.row_stage.RowStage`.

    Raises:
        SchemaError: a ragged or text field staged on a device (its rows stay on the host).
    """
    if spec.ragged or spec.text:
        if device is not None:
            raise SchemaError(f"ragged or text field {name!r} in a writer that stages its steps on {device}: "
                              "such rows stay in host memory; leave the writer's device=None")
        return RowStage(shape[:2], spec, name)
    if device is None:
        return np.zeros(shape, spec.numpy_dtype)
    import torch

    return torch.zeros(shape, dtype=spec.torch_dtype, device=device)


def staged(array: np.ndarray, spec: Field, device: torch.device | None) -> Any:
    """A saved host array of field ``spec`` (bfloat16 as bits) as a stage on ``device`` holds it."""
    return array if device is None else host_tensor(array, spec)


def like_stage(values: Any, stage: Any) -> Any:
    """``values`` ready to assign into ``stage``: numpy casts on assignment, torch's
    indexed assignment needs the stage's dtype and device."""
    if is_tensor(values):
        return values.to(stage.device, stage.dtype)
    return values


def owned_copy(array: Any) -> Any:
    """A private copy of a numpy array or a tensor (on its device)."""
    return array.clone() if is_tensor(array) else array.copy()


def owned_episode(episode: Episode) -> Episode:
    """``episode`` owning copies of its columns (a writer's staging rows are reused by the env's next episode)."""
    return dataclasses.replace(episode, columns={n: owned_copy(a) for n, a in episode.columns.items()}, owned=True)


def host_copy(array: Any) -> np.ndarray | dict:
    """A numpy copy (bfloat16 as uint16 bits) of a numpy array or a tensor on any device; a
    ragged or text field's staged rows as a writer's state keeps them (`RowStage.saved`)."""
    if isinstance(array, RowStage):
        return array.saved()
    return tensor_to_numpy(array).copy() if is_tensor(array) else array.copy()
