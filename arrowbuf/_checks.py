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
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from arrowbuf._lazy_torch import is_tensor
from arrowbuf.errors import describe
from arrowbuf.sample_args import PLAIN, SampleArgs

if TYPE_CHECKING:
    import torch


def is_int(value: Any, minimum: int | None = None) -> bool:
    """Whether ``value`` is an int (numpy ints too, bools not) >= ``minimum``: the test of
    `check_int`, for callers that raise their own error."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and (
        minimum is None or value >= minimum)


def check_int(name: str, value: Any, minimum: int) -> int:
    """``value`` as an int >= ``minimum`` (numpy ints accepted, bools refused).

    Raises:
        ValueError: anything else.
    """
    if type(value) is int and value >= minimum:   # the common case, checked first
        return value
    if not is_int(value, minimum):
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


def check_progress(progress: Any) -> bool | None:
    """A progress-bar switch: None (shown when stderr is a terminal), True or False.

    Raises:
        ValueError: anything else (a truthy ``"no"`` would otherwise show the bar).
    """
    if progress is not None and not isinstance(progress, (bool, np.bool_)):
        raise ValueError(f"progress must be None (a bar when stderr is a terminal), True or False, got {progress!r}")
    return None if progress is None else bool(progress)


def check_path(name: str, path: Any) -> Path:
    """``path`` (a str or os.PathLike) as a `pathlib.Path`.

    Raises:
        TypeError: anything else, naming the argument (pathlib's own error named none).
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path (a str or os.PathLike), got {describe(path)}")
    return Path(path)


#: Parquet compressions pyarrow writes (names as `pyarrow.parquet.write_table` takes them, any case).
PARQUET_COMPRESSIONS = ("none", "snappy", "gzip", "brotli", "lz4", "lz4_raw", "zstd")
#: A step writer's autoreset modes (`arrowbuf.autoreset`); here, where loading a checkpoint's writer
#: states checks them without importing the writers (and torch) into a Ray shard.
AUTORESET_MODES = ("next_step", "same_step", "disabled")


def check_compression(compression: Any) -> str:
    """A Parquet compression codec's name, checked before any file is written.

    Raises:
        ValueError: not one of `PARQUET_COMPRESSIONS`, or one this pyarrow was built without.
    """
    import pyarrow as pa

    if not isinstance(compression, str) or compression.lower() not in PARQUET_COMPRESSIONS:
        raise ValueError(f"compression must be one of {PARQUET_COMPRESSIONS}, got {compression!r}")
    if compression.lower() != "none" and not pa.Codec.is_available(compression.lower()):
        raise ValueError(f"compression {compression!r}: this pyarrow was built without it; use 'zstd' or 'snappy'")
    return compression.lower()


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
    import torch   # a device asks for tensors

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name like 'cpu' or 'cuda:0', got {device!r}") from None
    if parsed.type == "cuda" and (not torch.cuda.is_available()
                                  or (parsed.index or 0) >= torch.cuda.device_count()):
        seen = torch.cuda.device_count() if torch.cuda.is_available() else "no"
        raise ValueError(f"device {device!r}: this process sees {seen} CUDA device(s)")
    return parsed


def check_storage_device(storage_device: Any, backend: str) -> torch.device | None:
    """Where a store keeps its columns: None (numpy, host memory) or a CPU / CUDA torch device.

    Raises:
        ValueError: not a device, a device type other than cpu and cuda, a CUDA
            device this process lacks, or a Ray store (its shards publish their rows
            as Arrow blocks in Ray's shared host memory, which a device arena cannot be).
    """
    if storage_device is None:
        return None
    try:
        device = check_device(storage_device)
    except ValueError as err:
        raise ValueError(f"storage_device: {err}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"storage_device must be None (numpy columns), 'cpu' or 'cuda[:k]' (torch columns), "
                         f"got {storage_device!r}")
    if backend != "local":
        raise ValueError(f"storage_device={storage_device!r} needs backend='local': a Ray store's shards publish "
                         "their rows as Arrow blocks in Ray's shared host memory for readers in other processes, "
                         "which columns on a torch device cannot be; sample a Ray store with device= instead")
    return device


def check_episode_id(episode_id: Any) -> int:
    """Raises ValueError unless ``episode_id`` is an int (an id from ``episodes()``)."""
    if not is_int(episode_id):
        raise ValueError(f"episode_id must be an int (an id from episodes()), got {episode_id!r}")
    return int(episode_id)


def check_env_id(env_id: Any) -> str:
    if not isinstance(env_id, str):
        raise ValueError(f"env_id must be a str, got {env_id!r}")
    return env_id


def check_metadata(metadata: Any) -> dict | None:
    """None, or a JSON-serializable mapping (kept in the episode table).

    Raises:
        ValueError: not a mapping, or not JSON-serializable (NaN and infinities included).
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise ValueError(f"metadata must be a dict or None, got {describe(metadata)}")
    try:   # allow_nan=False: NaN and Infinity are not JSON, and no other reader of the table parses them
        json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"metadata must be JSON-serializable (finite numbers), got {describe(metadata)}: "
                         f"{err}") from None
    return dict(metadata)


def metadata_text(metadata: Mapping | None) -> str | None:
    """Checked metadata (`check_metadata`) as the episode table and the durable log keep it: JSON text, or None."""
    return json.dumps(metadata) if metadata is not None else None


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


def default_env_ids(num_envs: int) -> list[str]:
    """The env ids of a writer given none: ``env-0`` .. ``env-<num_envs - 1>``."""
    return [f"env-{i}" for i in range(num_envs)]


def check_name(name: Any) -> str | None:
    """None, or a non-empty str (a writer's or a store's name)."""
    if name is not None and not (isinstance(name, str) and name):
        raise ValueError(f"name must be a non-empty str or None, got {name!r}")
    return name


def tensor_to_numpy(tensor: torch.Tensor, name: str = "tensor") -> np.ndarray:
    """A detached CPU view of ``tensor`` as numpy; bfloat16 as its ``uint16`` bits (no copy on the CPU).

    Raises:
        SchemaError: a tensor whose device has no data to copy (``meta``), naming ``name``.
    """
    import torch

    from arrowbuf.fields import tensor_on_cpu

    tensor = tensor_on_cpu(tensor, name)
    if tensor.dtype == torch.bfloat16:
        return tensor.contiguous().view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()


def to_numpy(value: Any, name: str) -> tuple[np.ndarray, bool]:
    """``value`` (tensor, array, list) as numpy, and whether it was a bfloat16 tensor.

    Raises:
        ValueError: it cannot be read as an array.
    """
    if is_tensor(value):
        import torch

        return tensor_to_numpy(value, name), value.dtype == torch.bfloat16
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


def check_fraction(name: str, value: Any) -> float:
    """A number in [0, 1] (a discount, GAE's lambda), or ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_sample_args(n_step: Any, gamma: Any, frame_stack: Any, schema: Any) -> SampleArgs:
    """The `SampleArgs` of a sample, checked against the store's schema; gamma is 1.0 when unused.

    Raises:
        ValueError: a bad value, or n_step > 1 without a scalar ``reward`` field (shape () or (1,)).
    """
    if n_step == 1 and frame_stack == 1 and type(n_step) is int and type(frame_stack) is int:   # the common case
        if gamma != 0.99:
            check_fraction("gamma", gamma)
        return PLAIN
    n_step = check_int("n_step", n_step, 1)
    frame_stack = check_int("frame_stack", frame_stack, 1)
    gamma = check_fraction("gamma", gamma)
    if n_step > 1 and (schema is None or "reward" not in schema.fields):
        raise ValueError("n_step > 1 needs a 'reward' field; the schema has "
                         f"{list(schema.fields) if schema else 'no fields yet'}")
    if n_step > 1 and schema.fields["reward"].shape not in ((), (1,)):
        raise ValueError(f"n_step > 1 needs a scalar 'reward' field (shape () or TorchRL's (1,)); it has shape "
                         f"{schema.fields['reward'].shape}")
    return SampleArgs(n_step, gamma, frame_stack)


def check_worker_nodes(backend: str, num_workers: int | None, worker_nodes: Any) -> None:
    """None, or one node id (str) per worker of a Ray store's sample.

    Raises:
        ValueError: a local store, or not one str per worker.
    """
    if worker_nodes is None:
        return
    if backend != "ray":
        raise ValueError("worker_nodes needs backend='ray' (a local store has one node)")
    if num_workers is None or isinstance(worker_nodes, str) or len(worker_nodes) != num_workers \
            or not all(isinstance(n, str) for n in worker_nodes):
        raise ValueError(f"worker_nodes must list one node id (str) per worker (num_workers={num_workers}), "
                         f"got {worker_nodes!r}")


def check_priorities(index: Any, priority: Any, alpha: float, eps: float,
                     capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(int64 index, float64 priority) of an `update_priorities` call.

    Raises:
        ValueError: mismatched lengths, non-integer indices, or priorities that
            are negative, not finite, or so large that ``(p + eps) ** alpha`` over
            ``capacity`` leaves would overflow the sum tree's total.
    """
    index = to_numpy(index, "index")[0].reshape(-1)
    priority = real_numbers(priority, "priority").reshape(-1)
    if not np.issubdtype(index.dtype, np.integer):
        raise ValueError(f"index must hold integers (a batch's 'index'), got dtype {index.dtype}")
    if not (np.issubdtype(priority.dtype, np.floating) or np.issubdtype(priority.dtype, np.integer)):
        raise ValueError(f"priority must hold real numbers, got dtype {priority.dtype}")
    priority = priority.astype(np.float64)
    if index.shape != priority.shape:
        raise ValueError(f"index has {index.size} entries but priority has {priority.size}; expected equal")
    if not np.all(np.isfinite(priority)) or np.any(priority < 0):
        bad = priority[~(np.isfinite(priority) & (priority >= 0))][:5]
        raise ValueError(f"priority must be finite and >= 0, got {bad.tolist()}")
    # Each leaf at most max/capacity, so that the tree's total stays finite.
    limit = np.finfo(np.float64).max / capacity
    with np.errstate(over="ignore"):
        too_big = (priority + eps) ** alpha > limit
    if too_big.any():
        raise ValueError(f"priority {priority[too_big][:5].tolist()} too large: (priority + eps) ** alpha must stay "
                         f"<= {limit:.3g} (float64 max / capacity) for the sum tree's total to be finite")
    return index.astype(np.int64), priority


def check_index_batches(indices: Any, extras: Any) -> tuple[list[np.ndarray], list[dict]]:
    """Batches of store indices (1-D or 2-D int arrays, non-empty) and their extra fields
    (None, or one mapping name -> array shaped like its batch per batch), as numpy.

    Raises:
        ValueError: anything else, naming the batch and what it got.
    """
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Sequence) or not len(indices):
        raise ValueError(f"indices must be a non-empty list of index arrays (one per batch), got {describe(indices)}")
    batches = []
    for k, index in enumerate(indices):
        array, _ = to_numpy(index, f"indices[{k}]")
        if array.ndim not in (1, 2) or not array.size or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"indices[{k}] must be a non-empty 1-D or 2-D array of ints, got {describe(array)}")
        batches.append(array.astype(np.int64))
    if extras is None:
        return batches, [{} for _ in batches]
    if not isinstance(extras, Sequence) or len(extras) != len(batches):
        raise ValueError(f"extras must be None or a list of {len(batches)} mappings (one per batch), "
                         f"got {describe(extras)}")
    checked = []
    for k, (extra, index) in enumerate(zip(extras, batches)):
        if not isinstance(extra, Mapping):
            raise ValueError(f"extras[{k}] must be a mapping name -> array, got {describe(extra)}")
        fields = {}
        for name, value in extra.items():
            array, _ = to_numpy(value, f"extras[{k}][{name!r}]")
            if not isinstance(name, str) or array.shape[:index.ndim] != index.shape:
                raise ValueError(f"extras[{k}][{name!r}] must be named by a str and lead with the batch's shape "
                                 f"{index.shape}, got {describe(array)}")
            fields[name] = array
        checked.append(fields)
    return batches, checked


def check_shard(shard: Any, num_shards: int) -> int | None:
    """None, or a shard number in [0, num_shards).

    Raises:
        ValueError: anything else (a local store, or a Ray store of one shard, has the one shard 0).
    """
    if shard is None:
        return None
    if not is_int(shard) or not 0 <= shard < num_shards:
        where = "the store has one shard, 0" if num_shards == 1 else f"the store has {num_shards} shards"
        raise ValueError(f"shard must be an int in [0, {num_shards}) or None, got {shard!r} ({where})")
    return int(shard)


def check_gae_args(gamma: Any, lam: Any, value_key: Any, bootstrap_value: Any, schema: Any) -> tuple[float, float]:
    """`ExperienceStore.compute_gae`'s arguments: (gamma, lam) checked; ValueError otherwise."""
    gamma, lam = check_fraction("gamma", gamma), check_fraction("lam", lam)
    if not isinstance(value_key, str) or schema is None or value_key not in schema.fields:
        raise ValueError(f"value_key {value_key!r} is not a field of the store; fields: "
                         f"{list(schema.fields) if schema else 'none yet'}")
    if bootstrap_value is not None and not callable(bootstrap_value):
        raise ValueError(f"bootstrap_value must be a callable (final_obs TensorDict -> values) or None, "
                         f"got {describe(bootstrap_value)}")
    return gamma, lam
