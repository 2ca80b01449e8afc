"""Exports say what their rows are: a final_observation column (as Ray Data's) and the row
convention in every file's metadata; exports of format 2, without the column, still load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import arrowbuf as ab
from arrowbuf import _persist, parquet
from support.compare import assert_same_store


def episode(steps: int, final: bool, terminated: bool, value: float) -> dict:
    return {"obs": np.full((steps + (1 if final else 0), 2), value, np.float32),
            "action": np.arange(1, steps + 1), "reward": np.full(steps, value + 1, np.float32),
            "terminated": (np.arange(steps) == steps - 1) & terminated,
            "truncated": (np.arange(steps) == steps - 1) & (not terminated)}


def exported(tmp_path: Path) -> tuple[ab.ExperienceStore, Path]:
    store = ab.ExperienceStore(1_000, seed=0)
    for k, (steps, final, terminated) in enumerate([(3, True, True), (4, False, False), (2, True, False),
                                                    (5, True, True)]):
        store.add_episode(episode(steps, final, terminated, float(k)))
    return store, store.to_parquet(tmp_path / "export", rows_per_file=8)


def test_final_observation_marks_exactly_the_rows_holding_an_episodes_final_observation(tmp_path):
    store, path = exported(tmp_path)
    rows = ab.read_parquet(path).to_table().to_pandas()
    has_final = dict(zip(*(store.episodes().column(c).to_pylist() for c in ("episode_id", "has_final"))))
    last = rows["is_last"] & rows["episode_id"].map(has_final)
    assert rows["final_observation"].tolist() == last.tolist()
    assert rows["final_observation"].sum() == 3
    finals = rows[rows["final_observation"]]
    assert (finals["action"] == 0).all() and (finals["reward"] == 0).all() and not finals["terminated"].any()
    before = rows.loc[finals.index - 1]
    assert (before["terminated"] | before["truncated"]).all()   # the episode's end is on the row before
    # A plain Parquet reader sees the column and the convention in every step file.
    for entry in parquet.open_export(path).files:
        file = path / entry["path"]
        assert "final_observation" in pq.read_table(file).column_names
        assert b"final_observation=True" in pq.read_schema(file).metadata[b"arrowbuf.row_convention"]
    loaded = ab.ExperienceStore.from_parquet(path)
    assert_same_store(store, loaded, skip=("inserted_at",))


def as_format_2(path: Path) -> None:
    """Rewrite an export as arrowbuf wrote format 2: step files without final_observation, their
    shaped fields plain fixed-size lists (not format 4's fixed_shape_tensor; no bfloat16 here)."""
    manifest = json.loads((path / parquet.MANIFEST).read_text())
    for entry in manifest["steps"]:
        file = path / entry["path"]
        table = pq.read_table(file)
        for i, field in enumerate(table.schema):
            if isinstance(field.type, pa.FixedShapeTensorType):
                table = table.set_column(i, field.with_type(field.type.storage_type),
                                         pa.chunked_array([c.storage for c in table.column(i).chunks]))
        table = table.drop_columns(["final_observation"]).replace_schema_metadata(table.schema.metadata)
        pq.write_table(table, file, compression="zstd", write_page_checksum=True)
        entry.update(_persist.file_entry(file))
    manifest["format_version"] = 2
    _persist.write_manifest(path / parquet.MANIFEST, manifest)


def test_an_export_of_format_2_without_the_column_still_loads(tmp_path):
    store, path = exported(tmp_path)
    as_format_2(path)
    assert parquet.open_export(path).manifest["format_version"] == 2
    assert "final_observation" not in ab.read_parquet(path).schema.names
    assert ab.read_parquet(path).to_table().num_rows == 17
    assert_same_store(store, ab.ExperienceStore.from_parquet(path), skip=("inserted_at",))
