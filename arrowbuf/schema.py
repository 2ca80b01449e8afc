"""A store's schema: its fields by name, their Arrow schema, inference, and the check of an episode.

A store's schema is a flat, ordered map of field name -> `Field`. Nested input
(``{"obs": {"pixels": ..., "state": ...}}``) flattens to dotted names
(``"obs.pixels"``) and comes back nested in TensorDicts. Fields that hold
observations (declared, given with T+1 rows under an observation-like name, or
passed as ``next_obs`` to a writer) are marked ``observation=True``: the store
keeps them once and reads ``next`` from the following row. Inference refuses what
it would have to guess (a T+1 field named like a step field, an episode without
``terminated``, a legacy ``done``) with the explicit schema to pass instead.
Each column is checked by `arrowbuf.fields.check_column` (integer values are
stored in float fields only when exact).

Arrow mapping: each field's type is `Field.arrow_type`; its metadata records its
role (observation, step, derived, system) and ``arrowbuf.dtype=bfloat16`` for
bfloat16 fields.

Example:
    >>> import arrowbuf as ab
    >>> schema = ab.Schema({"obs": ab.Field("float32", (4,), observation=True),
    ...                     "action": ab.Field("int64"), "reward": ab.Field("float32")})
    >>> schema.observation_names
    ('obs',)
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf.errors import SchemaError, describe
from arrowbuf.encoded import EncodedRows
from arrowbuf.fields import Field, arrow_to_numpy, check_column, dtype_name

#: Columns the store adds to every row; user fields may not use these names.
SYSTEM_FIELDS: dict[str, str] = {
    "episode_id": "int64",
    "step": "int32",
    "is_first": "bool",
    "is_last": "bool",
}
#: Keys that sampled batches add; user fields may not use these names either.
RESERVED_NAMES = frozenset(SYSTEM_FIELDS) | {"index", "next", "weight", "mask"}
# Episode-end flags: one per step, as gymnasium's () or TorchRL's (1,).
FLAG_NAMES = ("terminated", "truncated")
#: Episode-end flags of older APIs and datasets (gym's ``done``, D4RL's
#: ``terminals``): they mix terminations with time limits, so they are refused in
#: a schema without ``terminated`` rather than stored as ordinary fields.
LEGACY_FLAG_NAMES = frozenset({"done", "dones", "terminal", "terminals", "is_terminal"})
#: Names `Schema.infer` takes as observations when given with T+1 rows; so are
#: names with a dotted part among them, starting with ``obs_``, ``observation_``,
#: ``pixel`` (``pixel_values``), ``image_``, ``rgb_``, ``depth_``, or ending with
#: ``_obs``, ``_observation``, ``_pixels``, ``_image``, ``_rgb``, ``_depth``.
OBSERVATION_WORDS = frozenset({"obs", "observation", "observations", "pixels", "image", "images", "rgb", "depth",
                               "state", "states", "frame", "frames"})
_OBSERVATION_PREFIXES = ("obs_", "observation_", "pixel", "image_", "rgb_", "depth_")
_OBSERVATION_SUFFIXES = ("_obs", "_observation", "_pixels", "_image", "_rgb", "_depth")

_ROLE_KEY = b"arrowbuf.role"
_DTYPE_KEY = b"arrowbuf.dtype"
_CODEC_KEY = b"arrowbuf.codec"
_SHAPE_KEY = b"arrowbuf.shape"
_MAX_BYTES_KEY = b"arrowbuf.max_bytes"
SCHEMA_VERSION = "1"

#: Field specs of the system columns.
SYSTEM_SPECS: dict[str, Field] = {name: Field(dtype) for name, dtype in SYSTEM_FIELDS.items()}


def flatten(data: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested mappings to dotted names: {"obs": {"a": x}} -> {"obs.a": x}.

    Raises:
        SchemaError: a key is not a non-empty string or contains a dot.
    """
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key or "." in key:
            raise SchemaError(
                f"field names must be non-empty strings without '.', got {key!r}"
                + (f" under {prefix[:-1]!r}" if prefix else "")
            )
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def key_counts(paths: Iterable[tuple[str, ...]]) -> dict[tuple[str, ...], int]:
    """The number of keys of the dict at each path above the leaf ``paths`` of nested dicts (``()``: the
    top; ``("obs",)`` for ``("obs", "a")``): what `has_keys` checks a value against."""
    groups: dict[tuple[str, ...], set[str]] = {}
    for path in paths:
        for depth in range(len(path)):
            groups.setdefault(path[:depth], set()).add(path[depth])
    return {path: len(keys) for path, keys in groups.items()}


def has_keys(data: Any, counts: Mapping[tuple[str, ...], int]) -> bool:
    """Whether ``data`` is plain dicts with exactly ``counts[path]`` keys at each path (`key_counts`)."""
    for path, keys in counts.items():
        node = data
        for key in path:
            node = node.get(key) if type(node) is dict else None
        if type(node) is not dict or len(node) != keys:
            return False
    return True


def at_path(data: Any, path: tuple[str, ...]) -> Any:
    """The value at ``path`` of nested plain dicts; None where a key is missing (`has_keys` counts keys,
    not names)."""
    for key in path:
        data = data.get(key) if type(data) is dict else None
    return data


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten`: {"obs.a": x} -> {"obs": {"a": x}} (groups keep their first position)."""
    nested: dict[str, Any] = {}
    for name, value in flat.items():
        node = nested
        *parents, leaf = name.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


class Schema:
    """An ordered map of field name -> `Field`, enforced on every write.

    Args:
        fields: name -> `Field` (or a dtype name, or a ``(dtype, shape)`` tuple);
            nested mappings flatten to dotted names.

    Raises:
        SchemaError: not a mapping, a reserved or malformed name, a bad spec, or no step field.
    """

    def __init__(self, fields: Mapping[str, Any]) -> None:
        if not isinstance(fields, Mapping):
            raise SchemaError(f"a schema is a mapping name -> Field (or dtype name, or (dtype, shape)), "
                              f"got {describe(fields)}")
        flat = flatten(fields) if fields else {}
        if not flat:
            raise SchemaError("a schema needs at least one field, got none")
        self.fields: dict[str, Field] = {}
        for name, spec in flat.items():
            if name.split(".")[0] in RESERVED_NAMES:
                raise SchemaError(
                    f"field name {name!r} is reserved by arrowbuf; reserved: {sorted(RESERVED_NAMES)}"
                )
            self.fields[name] = _as_field(spec, name)
            if name in FLAG_NAMES and self.fields[name].shape not in ((), (1,)):
                raise SchemaError(f"field {name!r}: shape {self.fields[name].shape}; expected () or (1,), "
                                  "one flag per step")
        if all(f.observation for f in self.fields.values()):
            raise SchemaError(
                "a schema needs at least one step field (action, reward, ...), "
                f"but every field is an observation: {list(self.fields)}"
            )
        legacy = [n for n in self.fields if n in LEGACY_FLAG_NAMES]
        if legacy and "terminated" not in self.fields:
            raise SchemaError(
                f"field {legacy[0]!r} is a legacy episode-end flag; arrowbuf follows gymnasium and needs "
                f"'terminated' (the episode really ended: n-step targets do not bootstrap) and 'truncated' "
                f"(cut by a time limit: they bootstrap). Rename {legacy[0]!r} to 'terminated' if it marks "
                f"true ends, and add 'truncated' for time limits (e.g. D4RL's 'timeouts')")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.fields)

    @functools.cached_property
    def input_fields(self) -> dict[str, Field]:
        """The fields writes carry: every field but the derived ones."""
        return {n: f for n, f in self.fields.items() if not f.derived}

    def extended(self, fields: Mapping[str, Field]) -> "Schema":
        """This schema plus new (derived) fields.

        Raises:
            SchemaError: a new name is already a field of another spec.
        """
        clash = [n for n, f in fields.items() if n in self.fields and self.fields[n] != f]
        if clash:
            raise SchemaError(f"fields {clash} already exist with other specs: "
                              f"{ {n: self.fields[n] for n in clash} }")
        return Schema(unflatten({**self.fields, **fields}))

    @functools.cached_property
    def observation_names(self) -> tuple[str, ...]:
        return tuple(n for n, f in self.fields.items() if f.observation)

    @functools.cached_property
    def _exact_specs(self) -> tuple[tuple, dict[tuple[str, ...], int]] | None:
        """((name, path (None for a top-level name), numpy dtype, ndim, shape, observation) of each field,
        and the `key_counts` of their paths), for `read_exact`; None when no dict can match exactly (bfloat16,
        derived or text fields: an object array's values are text only once read)."""
        if any(f.dtype == "bfloat16" or f.derived or f.text for f in self.fields.values()):
            return None
        specs = tuple((name, tuple(name.split(".")) if "." in name else None, f.numpy_dtype, len(f.shape) + 1,
                       f.shape, f.observation) for name, f in self.fields.items())
        return specs, key_counts(path or (name,) for name, path, *_ in specs)

    def read_exact(self, data: Any, stacked: bool = False) -> tuple[dict[str, np.ndarray], int, bool] | None:
        """The fast path of a write: ``data`` when it is a plain dict (nested dicts for dotted
        names) of numpy arrays with exactly the schema's names, dtypes and shapes and consistent lengths;
        ``stacked``: of E >= 1 episodes each, [E, T, ...] (`arrowbuf.episode_batch.read_episodes`).

        Returns:
            (columns, T, has_final) like `check`, or None for anything else (another
            container, a castable dtype, a bad value...): the general path then reads
            it and names any error.
        """
        exact = self._exact_specs
        if exact is None or type(data) is not dict:
            return None
        specs, counts = exact
        if not has_keys(data, counts):   # exactly the schema's names, at every level
            return None
        columns, num_steps, num_obs, count, lead = {}, -1, -1, -1, int(stacked)
        for name, path, dtype, ndim, shape, observation in specs:
            array = data.get(name) if path is None else at_path(data, path)   # (a top-level name: one lookup)
            if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != ndim + lead \
                    or array.shape[1 + lead:] != shape:
                return None
            columns[name] = array
            if lead and count != array.shape[0]:
                if count != -1 or not array.shape[0]:
                    return None
                count = array.shape[0]
            rows = array.shape[lead]
            if observation:
                if num_obs != rows and num_obs != -1:
                    return None
                num_obs = rows
            elif num_steps != rows:
                if num_steps != -1:
                    return None
                num_steps = rows
        if num_steps < 1 or (num_obs != -1 and num_obs != num_steps and num_obs != num_steps + 1):
            return None
        return columns, num_steps, num_obs == num_steps + 1

    @functools.cached_property
    def field_bytes(self) -> int:
        """Bytes one row of the user fields takes (what the arena stores per row)."""
        return sum(f.row_bytes for f in self.fields.values())

    @functools.cached_property
    def stored_bytes(self) -> int:
        """Bytes one row of the user fields takes up front in an arena (`Field.stored_bytes`)."""
        return sum(f.stored_bytes for f in self.fields.values())

    @functools.cached_property
    def observation_bytes(self) -> int:
        """Bytes one row of the observation fields takes."""
        return sum(self.fields[name].row_bytes for name in self.observation_names)

    @property
    def row_bytes(self) -> int:
        """Bytes one row takes in the arena, system columns included."""
        return sum(f.row_bytes for f in (*self.fields.values(), *SYSTEM_SPECS.values()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Schema) and self.fields == other.fields

    def __repr__(self) -> str:
        parts = []
        for name, f in self.fields.items():
            shape = f"{list(f.shape)}" if f.shape else ""
            codec = f" {f.codec}" if f.codec else ""
            parts.append(f"{name}: {f.dtype}{shape}{codec}{' (obs)' if f.observation else ''}")
        return "Schema(" + ", ".join(parts) + ")"

    # -- Arrow ------------------------------------------------------------------

    def to_arrow(self, system: bool = True) -> pa.Schema:
        """The Arrow schema of stored rows: user fields, then the system columns."""
        fields = []
        for name, f in self.fields.items():
            meta = {_ROLE_KEY: b"observation" if f.observation else b"derived" if f.derived else b"step"}
            if f.dtype == "bfloat16" or f.codec is not None:
                meta[_DTYPE_KEY] = f.dtype.encode()
            if f.codec is not None:   # a binary column of encoded rows: the codec and the decoded shape
                meta[_CODEC_KEY] = f.codec.encode()
                meta[_SHAPE_KEY] = json.dumps(list(f.shape)).encode()
            if f.max_bytes is not None:   # an encoded or a ragged field's
                meta[_MAX_BYTES_KEY] = str(f.max_bytes).encode()
            fields.append(pa.field(name, f.arrow_type(), nullable=False, metadata=meta))
        if system:
            for name, f in SYSTEM_SPECS.items():
                fields.append(pa.field(name, f.arrow_type(), nullable=False, metadata={_ROLE_KEY: b"system"}))
        return pa.schema(fields, metadata={b"arrowbuf.schema_version": SCHEMA_VERSION.encode()})

    @classmethod
    def from_arrow(cls, schema: pa.Schema) -> "Schema":
        """The arrowbuf schema of an Arrow schema written by `to_arrow` (system columns skipped).

        Raises:
            SchemaError: a column type arrowbuf cannot store.
        """
        fields: dict[str, Field] = {}
        for field in schema:
            meta = field.metadata or {}
            if meta.get(_ROLE_KEY) == b"system" or field.name in SYSTEM_FIELDS:
                continue
            observation = meta.get(_ROLE_KEY) == b"observation"
            if _CODEC_KEY in meta:
                fields[field.name] = _encoded_field(field, meta, observation)
                continue
            arrow_type = field.type
            shape: tuple = ()
            if pa.types.is_dictionary(arrow_type):
                arrow_type = arrow_type.value_type
            if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):   # a text field
                fields[field.name] = Field("string", (), False, meta.get(_ROLE_KEY) == b"derived")
                continue
            if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):   # a ragged field
                arrow_type = arrow_type.value_type
                shape = (None,)
                if pa.types.is_fixed_size_list(arrow_type):
                    shape, arrow_type = (None, arrow_type.list_size), arrow_type.value_type
            elif isinstance(arrow_type, pa.FixedShapeTensorType):
                shape = tuple(arrow_type.shape)
                arrow_type = arrow_type.value_type
            elif pa.types.is_fixed_size_list(arrow_type):
                shape = (arrow_type.list_size,)
                arrow_type = arrow_type.value_type
            if pa.types.is_boolean(arrow_type):
                dtype = "bool"
            elif meta.get(_DTYPE_KEY) == b"bfloat16":
                dtype = "bfloat16"
            else:
                try:
                    dtype = dtype_name(arrow_type.to_pandas_dtype())
                except (NotImplementedError, SchemaError):
                    raise SchemaError(f"column {field.name!r} has Arrow type {field.type}, "
                                      "which arrowbuf cannot store") from None
            try:
                max_bytes = int(meta[_MAX_BYTES_KEY]) if _MAX_BYTES_KEY in meta else None
                fields[field.name] = Field(dtype, shape, observation, meta.get(_ROLE_KEY) == b"derived",
                                           max_bytes=max_bytes)
            except (SchemaError, ValueError) as err:
                raise SchemaError(f"column {field.name!r}: {err}") from None
        return cls(unflatten(fields))

    def to_json(self) -> str:
        return self._json

    @functools.cached_property
    def _json(self) -> str:
        """`to_json`, encoded once (Ray writers send it with every request). A field's codec and
        ``max_bytes`` go in a 5th entry where either is set (``max_bytes`` of a ragged field
        without a codec was left out: a Ray shard and a loaded checkpoint held it unbounded)."""
        def options(f: Field) -> dict:
            return {k: v for k, v in (("codec", f.codec), ("max_bytes", f.max_bytes)) if v is not None}

        return json.dumps({n: [f.dtype, list(f.shape), f.observation,
                               *([f.derived, options(f)] if options(f) else [True] if f.derived else [])]
                           for n, f in self.fields.items()})

    @classmethod
    def from_json(cls, text: str) -> "Schema":
        """The schema of `to_json` (a 4th entry per field, when present, marks it derived; a 5th
        holds its codec and ``max_bytes``)."""
        return cls(unflatten({n: _json_field(n, spec) for n, spec in json.loads(text).items()}))

    # -- inference and checks ------------------------------------------------------

    @classmethod
    def infer(cls, columns: Mapping[str, tuple[np.ndarray, str]],
              observation_names: Iterable[str] | None = None) -> "Schema":
        """Infer a schema from one episode's columns.

        Without ``observation_names``, fields with one row more than the others are
        the observations (they carry the final observation), provided their names
        say so (`looks_like_observation`): a T+1 ``action`` is a mistake to report,
        not an observation to guess. Inferred data must carry a ``terminated`` flag
        (n-step targets must not bootstrap through terminal states); data without
        terminal flags is declared by giving the schema explicitly.

        Raises:
            SchemaError: ragged lengths, columns without a time dimension, a T+1
                field whose name does not look like an observation, or no
                ``terminated`` field; each names the fix.
        """
        lengths = {}
        for name, (array, _) in columns.items():
            if array.ndim == 0:
                raise SchemaError(f"field {name!r} is a scalar; expected an array with a leading time dimension")
            lengths[name] = array.shape[0]
        if observation_names is None:
            distinct = sorted(set(lengths.values()))
            if len(distinct) > 2 or (len(distinct) == 2 and distinct[1] != distinct[0] + 1):
                raise SchemaError(f"ragged episode: field lengths {lengths}; expected T rows for step "
                                  "fields and T or T+1 rows for observation fields")
            observation_names = [n for n, length in lengths.items() if len(distinct) == 2 and length == distinct[1]]
            ambiguous = [n for n in observation_names if not looks_like_observation(n)]
            if ambiguous:
                raise SchemaError(
                    f"field {ambiguous[0]!r} has {distinct[1]} rows, one more than the step fields (T = "
                    f"{distinct[0]}), like an observation with its final one, but its name does not say it is one "
                    "(inferred observations are named like 'obs', 'observation', 'pixels', 'pixel_values' or "
                    f"'*_obs'); give it {distinct[0]} rows, or declare it: {_declaration(columns, observation_names)}")
        obs = set(observation_names)
        schema = cls(unflatten({name: Field(dtype, array.shape[1:], name in obs)
                                for name, (array, dtype) in columns.items()}))
        if not any(name == "terminated" or name.startswith("terminated.") for name in schema.fields):
            raise SchemaError(
                f"episode has no 'terminated' field (fields: {list(columns)}); without it n-step targets and "
                "value bootstraps run through the ends of terminated episodes. Add 'terminated' and 'truncated' "
                "(one bool per step), or declare data without terminal flags by giving its schema explicitly: "
                f"{_declaration(columns, obs)}")
        return schema

    def check(self, columns: Mapping[str, tuple[np.ndarray, str]]) -> tuple[int, bool]:
        """Check one episode's columns against the schema.

        Returns:
            (T, has_final): the number of steps, and whether the observation fields
            carry the final observation (T+1 rows).

        Raises:
            SchemaError: a missing or unknown field, a wrong dtype or shape, ragged
                lengths, or an empty episode.
        """
        missing = [n for n in self.input_fields if n not in columns]
        unknown = [n for n in columns if n not in self.fields]
        if missing or unknown:
            raise SchemaError(f"episode fields do not match the schema: missing {missing}, unknown {unknown}; "
                              f"the schema has {list(self.fields)}")
        for name, (array, dtype) in columns.items():
            check_column(self.fields[name], name, array, dtype)
        steps = {n: columns[n][0].shape[0] for n, f in self.fields.items() if not f.observation and n in columns}
        if len(set(steps.values())) != 1:
            raise SchemaError(f"ragged episode: step fields have lengths {steps}; expected one length T")
        num_steps = next(iter(steps.values()))
        if num_steps < 1:
            raise SchemaError("episode has 0 steps; expected at least 1")
        obs = {n: columns[n][0].shape[0] for n in self.observation_names}
        if len(set(obs.values())) > 1 or not set(obs.values()) <= {num_steps, num_steps + 1}:
            raise SchemaError(f"observation fields have lengths {obs}; expected all {num_steps + 1} "
                              f"(with the final observation) or all {num_steps} (T = {num_steps} steps)")
        has_final = bool(obs) and next(iter(obs.values())) == num_steps + 1
        return num_steps, has_final


def looks_like_observation(name: str) -> bool:
    """Whether a field name says it holds observations (see `OBSERVATION_WORDS`)."""
    return any(part in OBSERVATION_WORDS or part.startswith(_OBSERVATION_PREFIXES)
               or part.endswith(_OBSERVATION_SUFFIXES) for part in name.split("."))


def _declaration(columns: Mapping[str, tuple[np.ndarray, str]], observations: Iterable[str]) -> str:
    """The `ExperienceStore` argument that declares ``columns`` explicitly, as code to copy."""
    obs = set(observations)
    specs = {}
    for name, (array, dtype) in columns.items():
        shape = f", {tuple(array.shape[1:])}" if array.ndim > 1 else ""
        specs[name] = f"ab.Field({dtype or array.dtype.name!r}{shape}{', observation=True' if name in obs else ''})"
    return f"ExperienceStore(..., schema={_as_code(unflatten(specs))})"


def _as_code(node: Any) -> str:
    if isinstance(node, str):
        return node
    return "{" + ", ".join(f"{key!r}: {_as_code(value)}" for key, value in node.items()) + "}"


def column_rows(field: pa.Field, column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """The rows of a column of `Schema.to_arrow`'s (a store's episode) as numpy, decoded when
    ``field`` is an encoded field's ``binary`` column.

    Raises:
        SchemaError: a column arrowbuf does not store; FormatError: a damaged encoded row.
    """
    if _CODEC_KEY in (field.metadata or {}):
        spec = _encoded_field(field, field.metadata, False)
        return np.asarray(EncodedRows(column, spec.encoder))
    if pa.types.is_list(field.type) or pa.types.is_large_list(field.type):
        raise SchemaError(f"column {field.name!r} is ragged ({field.type}): its rows have no one shape")
    return arrow_to_numpy(column, field.name)


def _encoded_field(field: pa.Field, meta: Mapping[bytes, bytes], observation: bool) -> Field:
    """The field of a ``binary`` column of encoded rows (`Schema.to_arrow`'s metadata).

    Raises:
        SchemaError: naming the column, for another type or metadata that is not a field's.
    """
    try:
        if not (pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type)):
            raise SchemaError(f"type {field.type}; an encoded field is a binary column")
        shape = json.loads(meta[_SHAPE_KEY].decode())
        if not isinstance(shape, list):
            raise SchemaError(f"shape {shape!r} is not a list")
        max_bytes = int(meta[_MAX_BYTES_KEY]) if _MAX_BYTES_KEY in meta else None
        return Field(meta.get(_DTYPE_KEY, b"uint8").decode(), tuple(shape), observation,
                     meta.get(_ROLE_KEY) == b"derived", meta[_CODEC_KEY].decode(), max_bytes)
    except (SchemaError, KeyError, ValueError, TypeError, UnicodeDecodeError) as err:
        raise SchemaError(f"column {field.name!r} is an encoded field whose metadata does not describe one: "
                          f"{err}") from None


def _json_field(name: str, spec: Any) -> Field:
    """The field of one entry of `Schema.to_json` (a damaged one: a SchemaError naming it)."""
    try:
        if not all(isinstance(flag, bool) for flag in spec[2:4]):   # a truthy string is no role
            raise SchemaError(f"observation and derived are bools, got {spec[2:4]!r}")
        return Field(spec[0], tuple(spec[1]), *spec[2:4], **(spec[4] if len(spec) > 4 else {}))
    except (SchemaError, TypeError, ValueError, IndexError, KeyError) as err:
        raise SchemaError(f"field {name!r}: {err} (its entry {spec!r})") from None


def _as_field(spec: Any, name: str) -> Field:
    if isinstance(spec, Field):
        return spec
    try:
        if isinstance(spec, tuple):
            return Field(*spec)
        return Field(spec)
    except SchemaError as err:
        raise SchemaError(f"field {name!r}: {err}") from None
    except TypeError:
        raise SchemaError(f"field {name!r}: expected a Field, a dtype or (dtype, shape[, observation]), "
                          f"got {spec!r}") from None
