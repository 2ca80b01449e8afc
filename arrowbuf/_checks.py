"""One copy of each argument check, and the one tensor -> numpy conversion.

Every public entry point checks what it is given with these helpers, before it
changes anything. Each error names the argument, the value received and what was
expected.

The bfloat16 rule, the same everywhere: numpy has no bfloat16, so a bf16 tensor
becomes a numpy view of its bits as ``uint16`` (lossless, no copy); the schema
records that such a column is bf16 and gives it back as ``torch.bfloat16``.
Code that needs the numbers themselves (priorities) decodes the bits with
`real_numbers`.
"""

from __future__ import annotations

import json
import math
import threading
from typing import Any, Mapping

import numpy as np
import torch

from arrowbuf.errors import describe


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy ints accepted, bools refused).

    Raises:
        ValueError: anything else.
    """
    if type(value) is int and value >= minimum:   # the common case, checked first
        return value
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_optional_int(name: str, value: Any, minimum: int) -> int | None:
    """None, or `check_int`."""
    return None if value is None else check_int(name, value, minimum)


def check_bool(name: str, value: Any) -> bool:
    """Raises ValueError unless ``value`` is True or False (numpy bools accepted)."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    """Raises ValueError unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


def check_timeout(timeout: Any) -> float | None:
    """A wait: None (do not wait) or seconds >= 0, ``math.inf`` for no limit.

    Raises:
        ValueError: anything else (NaN, negative, not a number).
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, np.integer, np.floating)) \
            or math.isnan(timeout) or timeout < 0:
        raise ValueError(f"timeout must be None (do not wait) or seconds >= 0 (math.inf: no limit), got {timeout!r}")
    # Waits past threading's limit (about 292 years) cannot be timed: they are unlimited.
    return math.inf if timeout > threading.TIMEOUT_MAX else float(timeout)


def check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device (None stays None), checked before anything is drawn.

    Raises:
        ValueError: not a device, or a CUDA device that this process lacks.
    """
    if device is None:
        return None
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name like 'cpu' or 'cuda:0', got {device!r}") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available()
                                  or (parsed.index or 0) >= torch.cuda.device_count()):
        seen = torch.cuda.device_count() if torch.cuda.is_available() else "no"
        raise ValueError(f"device {device!r}: this process sees {seen} CUDA device(s)")
    return parsed


def check_episode_id(episode_id: Any) -> int:
    """Raises ValueError unless ``episode_id`` is an int (an id from ``episodes()``)."""
    if isinstance(episode_id, bool) or not isinstance(episode_id, (int, np.integer)):
        raise ValueError(f"episode_id must be an int (an id from episodes()), got {episode_id!r}")
    return int(episode_id)


def check_env_id(env_id: Any) -> str:
    if not isinstance(env_id, str):
        raise ValueError(f"env_id must be a str, got {env_id!r}")
    return env_id


def check_metadata(metadata: Any) -> dict | None:
    """None, or a JSON-serializable mapping (kept in the episode table).

    Raises:
        ValueError: not a mapping, or not JSON-serializable.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict or None, got {describe(metadata)}")
    try:
        json.dumps(dict(metadata))
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata must be JSON-serializable: {err}") from None
    return dict(metadata)


def check_workers(batch_size: int, num_workers: Any) -> int | None:
    """None, or a worker count that divides ``batch_size``.

    Raises:
        ValueError: not an int >= 1, or ``batch_size`` is not a multiple of it.
    """
    if num_workers is None:
        return None
    num_workers = check_int("num_workers", num_workers, 1)
    if batch_size % num_workers:
        raise ValueError(f"batch_size {batch_size} is not a multiple of num_workers={num_workers}")
    return num_workers


def check_name(name: Any) -> str | None:
    """None, or a non-empty str (a writer's or a store's name)."""
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"name must be a non-empty str or None, got {name!r}")
    return name


def tensor_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A detached CPU view of ``tensor`` as numpy; bfloat16 as its ``uint16`` bits (no copy on the CPU)."""
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_numpy(value: Any, name: str) -> tuple[np.ndarray, bool]:
    """``value`` (tensor, array, list) as numpy, and whether it was a bfloat16 tensor.

    Raises:
        ValueError: it cannot be read as an array.
    """
    if isinstance(value, torch.Tensor):
        return tensor_to_numpy(value), value.dtype == torch.bfloat16
    try:
        return np.asarray(value), False
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be an array or tensor, got {describe(value)}") from None


def real_numbers(value: Any, name: str) -> np.ndarray:
    """``value`` as numpy numbers: a bfloat16 tensor's bits decoded to float32."""
    array, bf16 = to_numpy(value, name)
    return bf16_bits_to_float32(array) if bf16 else array


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bfloat16 ``uint16`` bits (exact: bf16 is float32's top half)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)
