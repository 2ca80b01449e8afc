"""Persistence of Ray stores: exports, checkpoints and Ray Data, done by every shard at once.

Each shard actor writes its own files (Parquet parts, a checkpoint directory, or
Arrow tables in the object store); the driver only writes the small shared pieces
(episode table, manifests). Paths must be on storage every node can reach.

Ray Data rows use the plain export layout (fixed-size lists, Arrow booleans, the
system columns) plus one bool column, ``final_observation``: True on the row that
holds only an episode's final observation, so `from_ray_dataset` can rebuild
episodes exactly.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np
import pyarrow as pa

from arrowbuf._persist import batch_columns, plain_schema, read_json, schema_of, take_rows, write_json
from arrowbuf.engine import ShardEngine
from arrowbuf.episodes import read_episode
from arrowbuf.errors import FormatError
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.shard import Episode

if TYPE_CHECKING:
    from arrowbuf.ray_backend import RayExperienceStore
    from arrowbuf.store import ExperienceStore

RAY_MANIFEST = "ray_checkpoint.json"
RAY_FORMAT = "arrowbuf-ray-checkpoint"
FINAL = "final_observation"


def shard_dir(path: Path, shard: int) -> Path:
    return path / f"shard-{shard}"


def plain_rows(engine: ShardEngine) -> pa.Table:
    """One shard's rows in the Ray Data layout (see the module docstring)."""
    shard = engine.shard
    if shard is None or not len(shard.table):
        return pa.table({})
    rows = take_rows(shard, 0, len(shard.table), plain_schema(shard.schema), copy=False)
    table = pa.Table.from_batches(rows.batches)
    has_final = np.repeat(shard.table.col("has_final"), shard.table.col("num_rows"))
    final = has_final & table.column("is_last").to_numpy()
    return table.append_column(FINAL, pa.array(final))


def save_ray_store(store: "RayExperienceStore", path: Path) -> Path:
    """Every shard saves into ``path/shard-<k>`` in parallel; the manifest comes last."""
    store.flush()
    path.mkdir(parents=True, exist_ok=True)
    store._shards.get({s: store._shards.call(s, "save", str(shard_dir(path, s))) for s in range(store.num_shards)})
    write_json(path / RAY_MANIFEST, {"format": RAY_FORMAT, "format_version": 1, "num_shards": store.num_shards,
                                     "capacity": store.capacity, "mode": store.mode, "seed": store.seed})
    return path


def load_ray_store(path: Path, num_shards: int | None, **options: Any) -> "RayExperienceStore":
    """A Ray store from `save_ray_store`'s directory, into ``num_shards`` shards.

    With the saved number of shards every shard actor loads its own directory
    (sampler state and generators included). Into another number, the episodes of
    each saved shard are streamed into the new shards by tasks in parallel, the
    way writers send them; their ids are renumbered and sampler state starts fresh.

    Raises:
        FormatError: no complete Ray checkpoint in ``path``.
    """
    from arrowbuf.ray_backend import RayExperienceStore, _ray

    manifest = read_json(path / RAY_MANIFEST, "Ray checkpoint manifest")
    if manifest.get("format") != RAY_FORMAT or int(manifest.get("format_version", 0)) > 1:
        raise FormatError(f"{path / RAY_MANIFEST}: not a Ray checkpoint this arrowbuf can read ({manifest})")
    saved = int(manifest["num_shards"])
    dirs = [shard_dir(path, s) for s in range(saved)]
    for directory in dirs:
        if not (directory / "manifest.json").exists():
            raise FormatError(f"{directory}: shard checkpoint missing; the Ray checkpoint is incomplete")
    num_shards = saved if num_shards is None else num_shards
    kwargs = {"mode": manifest["mode"], "seed": manifest["seed"], **options}
    if num_shards == saved:
        store = RayExperienceStore(int(manifest["capacity"]), num_shards=saved, _load_from=[str(d) for d in dirs],
                                   **kwargs)
        store.sampler = store._shards.get({0: store._shards.call(0, "config")})[0]["sampler"]
        return store
    from arrowbuf.store import ExperienceStore

    first = ExperienceStore.load(dirs[0])
    sampler = type(first.sampler)(**first.sampler.config())
    store = RayExperienceStore(int(manifest["capacity"]), num_shards=num_shards, schema=first.schema,
                               sampler=sampler, **kwargs)
    reshard = _ray().remote(_reshard_task)
    _ray().get([reshard.remote(str(d), store._sink) for d in dirs])
    store._refresh_sizes()
    return store


def _reshard_task(directory: str, sink: Any) -> int:
    """Stream one saved shard's episodes (oldest first) into another store's shards."""
    from arrowbuf.store import ExperienceStore

    saved = ExperienceStore.load(directory)
    ids = saved.episodes().column("episode_id").to_pylist()
    env_ids = saved.episodes().column("env_id").to_pylist()
    for episode_id, env_id in zip(ids, env_ids):
        episode, _ = read_episode(saved.episode(episode_id), saved.schema, env_id)
        sink.write(episode, route_key=f"{directory}:{episode_id}")   # spread episodes, not envs
        sink.commit()
    sink.flush()
    return len(ids)


def to_ray_dataset(store: "RayExperienceStore") -> Any:
    """A `ray.data.Dataset` of every shard's rows, built from Arrow tables the shards
    put in the object store (no round trip through the driver)."""
    import ray.data

    store.flush()
    refs = [store._shards.call(s, "plain_rows") for s in store._shards.live()]
    return ray.data.from_arrow_refs(refs)


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


def from_ray_dataset(cls: type, dataset: Any, capacity: int, **store_kwargs: Any) -> "ExperienceStore":
    """A new store (local unless ``backend="ray"``) holding a Ray Data dataset's episodes."""
    schema, episodes = episodes_of_dataset(dataset)
    store = cls(capacity, schema=schema, **store_kwargs)
    for episode in episodes:
        if store.backend == "ray":
            store._sink.write(episode)
            store._sink.commit()
        else:
            store.engine.add(episode, limited=False)
    if store.backend == "ray":
        store.flush()
    return store


def is_ray_checkpoint(path: str | Path) -> bool:
    return (Path(path) / RAY_MANIFEST).exists()
