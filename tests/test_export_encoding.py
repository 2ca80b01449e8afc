"""Exports open anywhere: bfloat16 fields as their float32 values (restored bit for bit on
import), shaped fields as Arrow's canonical ``arrow.fixed_shape_tensor``, and exports written
the old way (uint16 bits, plain fixed-size lists) still load."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import arrowbuf as ab
from arrowbuf import _persist, parquet

from support.compare import assert_same_store, column_numpy

# bfloat16 values a float32 widening must keep exactly: signed zeros, infinities, NaN
# (with a payload), the smallest subnormal, the largest finite value, ordinary numbers.
SPECIAL_BITS = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x7F7F, 0x3F80, 0xC0A0, 0x3E4D],
                        np.uint16)


def bf16_store() -> ab.ExperienceStore:
    """Episodes with a bfloat16 image observation, a bfloat16 scalar and a shaped bool field."""
    store = ab.ExperienceStore(200, seed=0)
    g = torch.Generator().manual_seed(0)
    for T in (5, 10):
        special = torch.from_numpy(np.resize(SPECIAL_BITS, T).view(np.int16)).view(torch.bfloat16)
        store.add_episode({"obs": torch.randn(T + 1, 6, 5, 3, generator=g).bfloat16(), "value": special,
                           "contact": torch.rand(T, 4, generator=g) < 0.5, "reward": torch.randn(T, generator=g),
                           "terminated": torch.arange(T) == T - 1})
    return store


def rows_glob(path: Path) -> str:
    return str(path / "steps" / "*.parquet")


def test_duckdb_reads_an_exported_bfloat16_field_as_its_float_values(tmp_path):
    store = bf16_store()
    path = store.to_parquet(tmp_path / "export")
    types = dict(duckdb.sql(f"SELECT column_name, column_type FROM (DESCRIBE SELECT * FROM '{rows_glob(path)}')")
                 .fetchall())
    assert types["value"] == "FLOAT" and types["obs"] == "FLOAT[]"
    got = duckdb.sql(f"SELECT value, obs FROM '{rows_glob(path)}' ORDER BY episode_id, step").fetchall()
    rows = store.to_arrow()
    want_value = rows.column("value").to_numpy().astype(np.uint32) << 16    # the bf16 bits, widened
    want_obs = column_numpy(rows.column("obs")).astype(np.uint32) << 16
    got_value = np.array([v for v, _ in got], np.float32)
    got_obs = np.array([o for _, o in got], np.float32)
    # Every value is the bf16 value itself (NaN aside, whose payload DuckDB may not keep).
    nan = np.isnan(got_value)
    assert (nan == np.isnan(want_value.view(np.float32))).all()
    assert (got_value.view(np.uint32)[~nan] == want_value[~nan]).all()
    assert (got_obs.view(np.uint32) == want_obs.reshape(len(want_obs), -1)).all()
    assert got_value[1] == 0.0 and np.signbit(got_value[1]) and got_value[2] == np.inf and got_value[13] == 1.0 and got_value[14] == -5.0


def test_from_parquet_restores_bfloat16_bit_for_bit(tmp_path):
    store = bf16_store()
    path = store.to_parquet(tmp_path / "export")
    assert pq.read_schema(sorted(path.glob("steps/*.parquet"))[0]).field("value").type == pa.float32()
    loaded = ab.ExperienceStore.from_parquet(path)
    assert loaded.schema.fields["value"].dtype == "bfloat16" and loaded.schema.fields["obs"].dtype == "bfloat16"
    assert_same_store(store, loaded, skip=("inserted_at",))    # every column bit for bit, NaN payloads included
    batch = loaded.gather(np.arange(len(loaded)))
    assert batch["value"].dtype == torch.bfloat16
    assert (batch["value"].view(torch.int16).numpy().view(np.uint16) == np.r_[SPECIAL_BITS[:5], SPECIAL_BITS]).all()


def test_shaped_fields_export_as_arrow_fixed_shape_tensors_that_polars_and_pyarrow_show(tmp_path):
    store = bf16_store()
    path = store.to_parquet(tmp_path / "export")
    file = sorted(path.glob("steps/*.parquet"))[0]
    schema = pq.read_schema(file)
    assert schema.field("obs").type == pa.fixed_shape_tensor(pa.float32(), [6, 5, 3])
    assert schema.field("contact").type == pa.fixed_shape_tensor(pa.bool_(), [4])
    # The canonical extension: its name and shape are standard Arrow metadata, not arrowbuf's.
    arrow_schema = pq.read_metadata(file).schema.to_arrow_schema()
    assert arrow_schema.field("obs").type.extension_name == "arrow.fixed_shape_tensor"
    frames = pq.read_table(file).column("obs").chunk(0).to_numpy_ndarray()
    assert frames.shape[1:] == (6, 5, 3)
    obs = pl.read_parquet(file).schema["obs"]
    assert obs.ext_name() == "arrow.fixed_shape_tensor" and json.loads(obs.ext_metadata())["shape"] == [6, 5, 3]
    # DuckDB reads the storage (a list of the flattened values); the shape is in the file's metadata.
    assert duckdb.sql(f"SELECT len(obs) FROM '{file}' LIMIT 1").fetchall()[0][0] == 6 * 5 * 3
    meta = dict(duckdb.sql(f"SELECT decode(key), decode(value) FROM parquet_kv_metadata('{file}')").fetchall())
    assert json.loads(meta["arrowbuf.schema"])["obs"] == ["bfloat16", [6, 5, 3], True]


def test_an_export_written_the_old_way_still_loads(tmp_path, monkeypatch):
    store = bf16_store()
    with monkeypatch.context() as patch:
        patch.setattr(parquet, "FORMAT_VERSION", 3)     # as arrowbuf wrote exports before format 4
        path = store.to_parquet(tmp_path / "old")
    schema = pq.read_schema(sorted(path.glob("steps/*.parquet"))[0])
    assert schema.field("value").type == pa.uint16() and pa.types.is_fixed_size_list(schema.field("obs").type)
    assert parquet.open_export(path).manifest["format_version"] == 3
    assert_same_store(store, ab.ExperienceStore.from_parquet(path), skip=("inserted_at",))
    table = ab.read_parquet(path).to_table()
    assert table.schema.field("obs").type == pa.fixed_shape_tensor(pa.uint16(), [6, 5, 3])
    dataset = ab.open_dataset(path)
    index = np.arange(len(store))
    assert torch.equal(dataset.gather(index)["obs"].view(torch.int16), store.gather(index)["obs"].view(torch.int16))


def test_a_bfloat16_column_rewritten_with_values_bfloat16_lacks_is_refused_naming_the_field(tmp_path):
    path = bf16_store().to_parquet(tmp_path / "export")
    manifest = json.loads((path / parquet.MANIFEST).read_text())
    for entry in manifest["steps"]:
        file = path / entry["path"]
        table = pq.read_table(file)
        i = table.schema.get_field_index("value")
        table = table.set_column(i, table.schema.field(i), pa.array(np.full(table.num_rows, 0.1, np.float32)))
        pq.write_table(table, file, write_page_checksum=True)
        entry.update(_persist.file_entry(file))
    _persist.write_manifest(path / parquet.MANIFEST, manifest)
    with pytest.raises(ab.FormatError, match=r"field 'value' is bfloat16, but its float32 value 0\.1"):
        ab.ExperienceStore.from_parquet(path)
