"""Whole episodes from user data: a dict / TensorDict / Arrow RecordBatch read into a checked `Episode`.

`read_episode` is every write's way in (`add_episode`, imports, logs, Ray
persistence): a plain dict of numpy arrays with the schema's exact dtypes and
shapes takes `Schema.read_exact`'s fast path, anything else is read column by
column (`read_columns`) and checked, with errors naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf._lazy_torch import is_tensordict
from arrowbuf.stage_arrays import step_tensor
from arrowbuf.errors import SchemaError, describe
from arrowbuf.encoded import EncodedRows
from arrowbuf.fields import arrow_to_numpy, as_array
from arrowbuf.ragged import ragged_rows
from arrowbuf.text import text_values
from arrowbuf.schema import SYSTEM_FIELDS, Schema, flatten
from arrowbuf.shard import Episode



def read_columns(data: Any, keep_tensors: bool = False
                 ) -> tuple[dict[str, tuple[np.ndarray, str]], Schema | None, bool | None]:
    """Columns of one episode as numpy arrays with their dtype names.

    With ``keep_tensors`` (a store whose arena is torch tensors: `arrowbuf.arena`),
    torch tensors stay tensors on their device, bfloat16 included, so that a
    write from the GPU never goes through host memory.

    Returns:
        (columns, schema, has_final): ``schema`` and ``has_final`` are known only for
        Arrow input written by arrowbuf (field roles and batch metadata), else None.

    Raises:
        SchemaError: data of an unsupported type or dtype.
    """
    if isinstance(data, pa.Table):
        data = data.combine_chunks().to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist([], data.schema)
    if isinstance(data, pa.RecordBatch):
        return _read_arrow(data)
    if is_tensordict(data):
        data = data.to_dict()
    if not isinstance(data, Mapping):
        raise SchemaError(f"episode must be a dict, TensorDict or pyarrow.RecordBatch, got {describe(data)}")
    read = step_tensor if keep_tensors else as_array
    return {name: read(value, name) for name, value in flatten(data).items()}, None, None


def _read_arrow(batch: pa.RecordBatch) -> tuple[dict[str, tuple[np.ndarray, str]], Schema | None, bool | None]:
    user = [f.name for f in batch.schema if f.name not in SYSTEM_FIELDS]
    if not user:
        raise SchemaError(f"record batch has no data columns, only {batch.schema.names}")
    schema = Schema.from_arrow(pa.schema([batch.schema.field(n) for n in user]))
    roles_known = any((batch.schema.field(n).metadata or {}).get(b"arrowbuf.role") for n in user)
    has_final = (batch.schema.metadata or {}).get(b"arrowbuf.has_final") == b"1"
    columns = {}
    for name in user:
        spec = schema.fields[name]
        # An encoded field's rows as stored: a store of the same codec keeps their bytes.
        array = EncodedRows(batch.column(name), spec.encoder) if spec.codec is not None \
            else ragged_rows(batch.column(name), name, spec.shape[1:]) if spec.ragged \
            else text_values(batch.column(name), name) if spec.text \
            else arrow_to_numpy(batch.column(name), name)
        if has_final and not spec.observation:
            array = array[:-1]
        columns[name] = (array, spec.dtype)
    return columns, (schema if roles_known else None), (has_final if roles_known else None)


def read_episode(data: Any, schema: Schema | None, env_id: str = "default",
                 metadata: Mapping[str, Any] | None = None, keep_tensors: bool = False) -> tuple[Episode, Schema]:
    """Check one episode against ``schema`` (inferred from it when None); ``keep_tensors``
    as in `read_columns`.

    Returns:
        The episode and the schema it satisfies.

    Raises:
        SchemaError: the data does not match the schema.
    """
    exact = schema.read_exact(data) if schema is not None else None
    if exact is None:
        columns, arrow_schema, _ = read_columns(data, keep_tensors)
        if schema is None:
            schema = arrow_schema or Schema.infer(columns)
        num_steps, has_final = schema.check(columns)
        exact = {n: a for n, (a, _) in columns.items()}, num_steps, has_final
    return Episode(*exact, env_id, dict(metadata) if metadata is not None else None), schema
