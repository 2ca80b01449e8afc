"""The RLightning buffer config, checked: `parse_config` -> `BufferSettings`.

Accepts a dict, a pydantic model (RLightning's ``BufferConfig``), an OmegaConf
``DictConfig``, a dataclass or any object with attributes. Unlike the seed's
pydantic model (``extra="allow"``), an unknown key is an error, so a misspelled
``storage.unit`` cannot silently fall back to its default. Every error names the
key, the value received and what is expected.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from arrowbuf._checks import is_int

BUFFER_TYPES = ("ReplayBuffer", "RolloutBuffer")
SAMPLER_TYPES = ("uniform", "batch", "all")
DEFAULT_SAMPLER = {"ReplayBuffer": "uniform", "RolloutBuffer": "all"}
MODES = ("circular", "fixed")
STORAGE_TYPES = ("unified", "sharded")
UNITS = ("transition", "episode")

_TOP_KEYS = ("type", "capacity", "sampler", "auto_truncate_episode", "storage", "node_affinity_env",
             "node_affinity_train")
_SAMPLER_KEYS = ("type",)
_STORAGE_KEYS = ("mode", "type", "unit", "device", "num_shards")


@dataclass(frozen=True)
class BufferSettings:
    """A checked buffer config (defaults filled in)."""

    type: str
    capacity: int                  # transitions per storage shard, as in the seed
    sampler: str
    auto_truncate_episode: bool = False
    mode: str = "circular"
    storage_type: str = "unified"
    unit: str = "transition"
    device: str = "cpu"
    num_shards: int | None = None  # storage.num_shards (sharded storage only)
    node_affinity_env: bool = False
    node_affinity_train: bool = False


def _fail(path: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"buffer config {path!r}: got {value!r}, expected {expected}")


def plain_section(value: Any, path: str) -> dict[str, Any]:
    """A config section (dict, pydantic model, OmegaConf, dataclass or object) as a plain dict of its keys."""
    if isinstance(value, Mapping):
        return dict(value)
    dump = getattr(value, "model_dump", None)     # pydantic v2 (RLightning's Config)
    if callable(dump):
        return dict(dump())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    attributes = getattr(value, "__dict__", None)
    if isinstance(attributes, dict):
        return {k: v for k, v in attributes.items() if not k.startswith("_")}
    raise _fail(path or "<config>", value, "a mapping or an object with attributes")


def _check_keys(section: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
    for key, value in section.items():
        if key not in allowed:
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {prefix + close[0]!r}?)" if close else ""
            raise ValueError(f"buffer config: unknown key {prefix + str(key)!r} (value {value!r}){hint}; "
                             f"expected one of {', '.join(prefix + k for k in allowed)}")


def _choice(section: dict[str, Any], key: str, choices: tuple[str, ...], default: Any, path: str) -> str:
    value = section.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"buffer config {path!r} is required; expected one of {', '.join(map(repr, choices))}")
        return default
    if value not in choices:
        raise _fail(path, value, f"one of {', '.join(map(repr, choices))}")
    return value


def _flag(section: dict[str, Any], key: str, path: str) -> bool:
    value = section.get(key, False)
    if value is None:
        return False
    if not isinstance(value, (bool, np.bool_)):
        raise _fail(path, value, "true or false")
    return bool(value)


def _int(value: Any, path: str, minimum: int = 1) -> int:
    if not is_int(value, minimum):
        raise _fail(path, value, f"an int >= {minimum}")
    return int(value)


def parse_config(config: Any, buffer_type: str | None = None) -> BufferSettings:
    """Check an RLightning buffer config and fill in its defaults.

    Args:
        config: the ``buffer`` section of an RLightning config (dict or object).
        buffer_type: the type the caller implements ("ReplayBuffer" /
            "RolloutBuffer"); the config's ``type`` may be omitted then, and must
            match when given.

    Raises:
        ValueError: an unknown key or a bad value, named with the value received
            and what is expected.
    """
    top = plain_section(config, "")
    _check_keys(top, _TOP_KEYS, "")
    kind = top.get("type", None) if top.get("type", None) is not None else buffer_type
    kind = _choice({"type": kind}, "type", BUFFER_TYPES, None, "type")
    if buffer_type is not None and kind != buffer_type:
        raise _fail("type", kind, f"{buffer_type!r} for a {buffer_type}")
    if top.get("capacity") is None:
        raise ValueError("buffer config 'capacity' is required; expected an int >= 1 (transitions per storage shard)")
    capacity = _int(top["capacity"], "capacity")

    sampler = top.get("sampler")
    sampler = {} if sampler is None else plain_section(sampler, "sampler")
    _check_keys(sampler, _SAMPLER_KEYS, "sampler.")
    sampler_type = _choice(sampler, "type", SAMPLER_TYPES, DEFAULT_SAMPLER[kind], "sampler.type")

    storage = top.get("storage")
    storage = {} if storage is None else plain_section(storage, "storage")
    _check_keys(storage, _STORAGE_KEYS, "storage.")
    mode = _choice(storage, "mode", MODES, "circular", "storage.mode")
    storage_type = _choice(storage, "type", STORAGE_TYPES, "unified", "storage.type")
    unit = _choice(storage, "unit", UNITS, "transition", "storage.unit")
    device = storage.get("device") or "cpu"
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise _fail("storage.device", device, "'cpu' or 'cuda' (or 'cuda:<index>')")
    num_shards = storage.get("num_shards")
    if num_shards is not None:
        num_shards = _int(num_shards, "storage.num_shards")
    if storage_type == "unified" and num_shards not in (None, 1):
        raise _fail("storage.num_shards", num_shards, "1 or nothing with storage.type='unified' "
                    "(set storage.type='sharded' for several shards)")
    if storage_type == "sharded" and device != "cpu":
        raise _fail("storage.device", device, "'cpu' with storage.type='sharded'")

    return BufferSettings(
        type=kind, capacity=capacity, sampler=sampler_type,
        auto_truncate_episode=_flag(top, "auto_truncate_episode", "auto_truncate_episode"),
        mode=mode, storage_type=storage_type, unit=unit, device=device, num_shards=num_shards,
        node_affinity_env=_flag(top, "node_affinity_env", "node_affinity_env"),
        node_affinity_train=_flag(top, "node_affinity_train", "node_affinity_train"))
