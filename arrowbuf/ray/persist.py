"""Persistence of Ray stores: exports, checkpoints and Ray Data, done by every shard at once.

Each shard actor writes its own files (Parquet parts, a checkpoint directory, or
Arrow tables in the object store); the driver only writes the small shared pieces
(episode table, manifests). Paths must be on storage every node can reach.

The router (`arrowbuf.ray.router`) starts shards from a checkpoint; this module
holds what the shards, the router and the facade share, and imports none of them.

Ray Data rows use the plain export layout (fixed-size lists, Arrow booleans, the
system columns) plus one bool column, ``final_observation``: True on the row that
holds only an episode's final observation, so `episodes_of_dataset` can rebuild
episodes exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa

from arrowbuf._persist import batch_columns, plain_schema, read_json, schema_of, take_rows, write_json
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import FormatError
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.shard import Episode

if TYPE_CHECKING:
    from arrowbuf.ray.router import RayBackend
    from arrowbuf.ray.sink import RaySink

RAY_MANIFEST = "ray_checkpoint.json"
RAY_FORMAT = "arrowbuf-ray-checkpoint"
FINAL = "final_observation"


def shard_dir(path: Path, shard: int) -> Path:
    return path / f"shard-{shard}"


def is_ray_checkpoint(path: str | Path) -> bool:
    return (Path(path) / RAY_MANIFEST).exists()


def plain_rows(engine: ShardEngine) -> pa.Table:
    """One shard's rows in the Ray Data layout (see the module docstring)."""
    with engine.lock:
        shard = engine.shard
        if shard is None or not len(shard.table):
            return pa.table({})
        rows = take_rows(shard, 0, len(shard.table), plain_schema(shard.schema), copy=False)
        has_final = np.repeat(shard.table.col("has_final"), shard.table.col("num_rows"))
    table = pa.Table.from_batches(rows.batches)
    final = has_final & table.column("is_last").to_numpy()
    return table.append_column(FINAL, pa.array(final))


def save_ray_store(backend: "RayBackend", path: Path, info: dict) -> Path:
    """Every shard saves into ``path/shard-<k>`` in parallel; the manifest (with the
    store's ``info``: capacity, mode, seed) comes last."""
    backend.flush()
    path.mkdir(parents=True, exist_ok=True)
    shards = backend.shards
    shards.get({s: shards.call(s, "save", str(shard_dir(path, s))) for s in range(backend.num_shards)})
    write_json(path / RAY_MANIFEST, {"format": RAY_FORMAT, "format_version": 1, "num_shards": backend.num_shards,
                                     **info})
    return path


def checkpoint_dirs(path: Path) -> tuple[dict, list[Path]]:
    """The manifest of the Ray checkpoint in ``path`` and its shards' directories.

    Raises:
        FormatError: no complete Ray checkpoint in ``path``.
    """
    manifest = read_json(path / RAY_MANIFEST, "Ray checkpoint manifest")
    if manifest.get("format") != RAY_FORMAT or int(manifest.get("format_version", 0)) > 1:
        raise FormatError(f"{path / RAY_MANIFEST}: not a Ray checkpoint this arrowbuf can read ({manifest})")
    dirs = [shard_dir(path, s) for s in range(int(manifest["num_shards"]))]
    for directory in dirs:
        if not (directory / "manifest.json").exists():
            raise FormatError(f"{directory}: shard checkpoint missing; the Ray checkpoint is incomplete")
    return manifest, dirs


def reshard_task(directory: str, sink: "RaySink") -> int:
    """Stream one saved shard's episodes (oldest first) into another store's shards."""
    from arrowbuf.checkpoint import load_engine
    from arrowbuf.episodes import read_episode

    engine = load_engine(directory, progress=False).engine
    table = engine.episodes()
    ids = table.column("episode_id").to_pylist()
    for episode_id, env_id in zip(ids, table.column("env_id").to_pylist()):
        episode, _ = read_episode(engine.episode(episode_id), engine.schema, env_id)
        sink.write(episode, route_key=f"{directory}:{episode_id}")   # spread episodes, not envs
        sink.commit()
    sink.close()
    return len(ids)


def to_ray_dataset(backend: "RayBackend") -> Any:
    """A `ray.data.Dataset` of every shard's rows, built from Arrow tables the shards
    put in the object store (no round trip through the driver)."""
    import ray.data

    shards = backend.shards
    return ray.data.from_arrow_refs([shards.call(s, "plain_rows") for s in shards.live()])


def episodes_of_dataset(dataset: Any) -> tuple[Schema, Iterator[Episode]]:
    """The schema of a dataset in the Ray Data layout and its episodes, streamed in order."""
    schema = schema_of(dataset.schema().base_schema, "dataset")
    specs = {**schema.fields, **SYSTEM_SPECS}

    def episodes() -> Iterator[Episode]:
        parts: list[dict[str, np.ndarray]] = []
        for batch in dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            for record in batch.to_batches() if isinstance(batch, pa.Table) else [batch]:
                columns = batch_columns(record, specs, "dataset")
                final = (record.column(FINAL).to_numpy(zero_copy_only=False) if FINAL in record.schema.names
                         else np.zeros(record.num_rows, bool))

                def part(start: int, stop: int) -> dict[str, np.ndarray]:
                    return {**{n: columns[n][start:stop] for n in schema.fields}, FINAL: final[start:stop]}

                start = 0
                for end in (np.flatnonzero(columns["is_last"]) + 1).tolist():
                    parts.append(part(start, end))
                    yield _episode(parts, schema)
                    parts, start = [], end
                if start < record.num_rows:   # an episode that goes on in the next batch
                    parts.append(part(start, record.num_rows))
        if parts:
            raise FormatError("dataset ends inside an episode (no is_last row)")

    return schema, episodes()


def _episode(parts: list[dict[str, np.ndarray]], schema: Schema) -> Episode:
    columns = {name: np.concatenate([p[name] for p in parts]) for name in [*schema.fields, FINAL]}
    has_final = bool(columns.pop(FINAL)[-1])
    num_steps = len(columns[next(iter(schema.fields))]) - int(has_final)
    for name, spec in schema.fields.items():
        if has_final and not spec.observation:
            columns[name] = columns[name][:num_steps]
    return Episode(columns, num_steps, has_final)
