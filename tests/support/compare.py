"""Comparing what stores hold: columns as numpy, snapshots, equal stores, rows, episodes and batches."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import torch

import arrowbuf as ab


def column_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Values of any arrowbuf column as numpy (tensor columns with their shape, bool tensors included)."""
    if isinstance(column, pa.ChunkedArray):
        parts = [column_numpy(chunk) for chunk in column.chunks]
        return np.concatenate(parts) if parts else np.empty(0)
    if isinstance(column.type, pa.FixedShapeTensorType):
        values = column.storage.flatten().to_numpy(zero_copy_only=False)
        return values.reshape((len(column), *column.type.shape))
    return column.to_numpy(zero_copy_only=False)


def snapshot(store: ab.ExperienceStore) -> dict[str, Any]:
    """A deep copy of everything observable about a store's contents.

    Copies, not views: `to_arrow` and `episode` are zero-copy views of the arena, so a
    view taken before a call would change along with the store.
    """
    episodes = store.episodes()
    rows = store.to_arrow()
    return {
        "len": len(store),
        "num_episodes": store.num_episodes,
        "schema": store.schema,
        "episodes": pa.Table.from_pylist(episodes.to_pylist(), schema=episodes.schema),
        "rows": {name: column_numpy(rows.column(name)).copy() for name in rows.column_names},
    }


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert after["len"] == before["len"]
    assert after["num_episodes"] == before["num_episodes"]
    assert after["schema"] == before["schema"]
    assert after["episodes"].equals(before["episodes"])
    assert after["rows"].keys() == before["rows"].keys()
    for name, values in before["rows"].items():
        np.testing.assert_array_equal(after["rows"][name], values, err_msg=name)


def assert_same_batches(a: Any, b: Any) -> None:
    """Two sampled TensorDicts hold the same keys, dtypes, shapes and values."""
    keys = sorted(a.keys(True, True), key=str)
    assert keys == sorted(b.keys(True, True), key=str)
    for key in keys:
        x, y = a.get(key), b.get(key)
        assert x.dtype == y.dtype and x.shape == y.shape, key
        assert torch.equal(x, y), f"sampled {key!r} differs"


def assert_same_rows(a: pa.Table, b: pa.Table) -> None:
    """Same columns, types and values, bit for bit (NaNs included)."""
    assert a.schema.names == b.schema.names
    for name in a.schema.names:
        assert a.schema.field(name).type == b.schema.field(name).type, name
        x, y = column_numpy(a.column(name)), column_numpy(b.column(name))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def assert_same_episodes(a: ab.ExperienceStore, b: ab.ExperienceStore, skip: tuple[str, ...] = ()) -> None:
    ta, tb = a.episodes(), b.episodes()
    assert ta.column_names == tb.column_names
    for name in ta.column_names:
        if name in skip:
            continue
        if pa.types.is_floating(ta.schema.field(name).type):   # NaN returns (no reward field) compare equal
            np.testing.assert_array_equal(ta.column(name).to_numpy(), tb.column(name).to_numpy(), err_msg=name)
        else:
            assert ta.column(name).equals(tb.column(name)), name


def assert_same_store(a: ab.ExperienceStore, b: ab.ExperienceStore, skip: tuple[str, ...] = ()) -> None:
    """Same schema, episode table (but ``skip`` columns) and rows."""
    assert a.schema == b.schema
    assert (len(a), a.num_episodes) == (len(b), b.num_episodes)
    assert_same_episodes(a, b, skip)
    assert_same_rows(a.to_arrow(), b.to_arrow())
