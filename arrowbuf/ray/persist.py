"""Persistence of Ray stores: exports, checkpoints and Ray Data, done by every shard at once.

Each shard actor writes its own files (Parquet parts, a checkpoint directory, or
Arrow tables in the object store); the driver only writes the small shared pieces
(episode table, manifests). Paths must be on storage every node can reach.

Layout of a Ray checkpoint::

    ckpt/
      ray_checkpoint.json     names the committed generation (replaced last, checksummed)
      gen-<id>/shard-<k>/     one local checkpoint per shard (`arrowbuf.checkpoint`), with
                              which of its pieces belong to open episodes; shard 0's also
                              holds the saving process's writer states (checked as a local
                              checkpoint's)

A save writes a new generation aside, and replacing the manifest commits it at once:
a save that fails on any shard leaves the previous generation named, complete.

`arrowbuf.opening` starts shards from a checkpoint; this module holds what the
shards, the router and the opener share, and imports none of them.

Ray Data rows use the plain export layout (fixed-size lists, Arrow booleans, the
system columns) plus one bool column, ``final_observation``: True on the row that
holds only an episode's final observation, so `episodes_of_dataset` can rebuild
episodes exactly.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import numpy as np
import pyarrow as pa

from arrowbuf._filesink import STAGING_PREFIX, ManifestSink, remove
from arrowbuf._persist import (batch_columns, check_format, join_rows, plain_schema, read_json, schema_of,
                               take_rows, write_manifest)
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import FormatError, ShardError
from arrowbuf.ray.handles import unwrapped
from arrowbuf.ray.options import ray_module
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.shard import Episode

if TYPE_CHECKING:
    from arrowbuf.ray.handles import ShardHandles
    from arrowbuf.ray.sink import RaySink

RAY_MANIFEST = "ray_checkpoint.json"
RAY_FORMAT = "arrowbuf-ray-checkpoint"
RAY_FORMAT_VERSION = 2     # 2: generations committed by the manifest, which carries a checksum
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


def save_ray_store(shards: "ShardHandles", path: Path, info: dict, writers: dict | None = None) -> Path:
    """Every shard saves into a new generation ``path/gen-<id>/shard-<k>`` in parallel;
    replacing the manifest (with the store's ``info``: capacity, mode, seed) commits
    the generation, and older generations are deleted. Shard 0 keeps ``writers``
    (writer states by name) in its checkpoint.

    The generation is written into a `ManifestSink`: if any shard fails, the pending
    generation is deleted and the manifest still names the previous one, complete.
    Each shard links the row files it still needs from its previous generation
    and writes only the episodes added since.

    Raises:
        ShardError: a shard died during the save (the previous checkpoint stays).
    """
    previous = _committed_generation(path)
    generation = f"gen-{uuid.uuid4().hex[:16]}"
    path.mkdir(parents=True, exist_ok=True)
    with ManifestSink(path, RAY_MANIFEST) as sink:
        pending = sink.pending / generation
        refs: dict[int, Any] = {}
        failure = None
        for s in range(shards.num_shards):
            try:
                refs[s] = shards.call(s, "save", str(shard_dir(pending, s)),
                                      str(shard_dir(previous, s)) if previous is not None else None,
                                      (writers or {}) if s == 0 else {})
            except ShardError as err:   # a shard known dead: wait for the others before the abort
                failure = err
                break
        _wait_all(refs, shards.name, failure)
        write_manifest(sink.pending / RAY_MANIFEST, {
            "format": RAY_FORMAT, "format_version": RAY_FORMAT_VERSION, "generation": generation,
            "num_shards": shards.num_shards, **info})
    for old in [*path.glob("gen-*"), *path.glob("shard-*"), *path.glob(f"{STAGING_PREFIX}*")]:
        if old.name != generation:
            remove(old)
    return path


def _wait_all(refs: dict[int, Any], name: str, failure: BaseException | None = None) -> None:
    """Wait for every shard's answer, then raise the first failure (so no shard still
    writes into a generation that is being deleted)."""
    ray = ray_module()
    for shard, ref in refs.items():
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError as err:
            failure = failure or ShardError(f"shard {shard} of store {name!r} died during the save: {err}; the "
                                            "previous checkpoint is kept")
        except Exception as err:   # the shard's own error (`unwrapped`), raised once all are done
            failure = failure or unwrapped(err)
    if failure is not None:
        raise failure


def _committed_generation(path: Path) -> Path | None:
    """The generation directory the Ray checkpoint in ``path`` commits, if any is readable."""
    try:
        return generation_dir(path, _read_manifest(path))
    except FormatError:
        return None


def _read_manifest(path: Path) -> dict[str, Any]:
    manifest_path = path / RAY_MANIFEST
    manifest = read_json(manifest_path, "Ray checkpoint manifest")
    check_format(manifest, manifest_path, RAY_FORMAT, RAY_FORMAT_VERSION)
    return manifest


def generation_dir(path: Path, manifest: Mapping[str, Any]) -> Path:
    """The directory of the committed generation (``path`` itself for format version 1).

    Raises:
        FormatError: a generation that is not a directory name inside ``path``.
    """
    generation = manifest.get("generation", ".")
    if generation == "." and manifest.get("format_version") == 1:
        return path
    if not isinstance(generation, str) or not generation.startswith("gen-") or Path(generation).name != generation:
        raise FormatError(f"{path / RAY_MANIFEST}: generation {generation!r} is not a gen-<id> directory name")
    return path / generation


def checkpoint_dirs(path: Path) -> tuple[dict, list[Path]]:
    """The manifest of the Ray checkpoint in ``path`` and its committed shards' directories.

    Raises:
        FormatError: no complete Ray checkpoint in ``path``.
    """
    manifest = _read_manifest(path)
    try:
        saved = int(manifest["num_shards"])
        int(manifest["capacity"]), manifest["mode"], manifest["seed"]   # present, the capacity an int
    except (KeyError, TypeError, ValueError) as err:
        raise FormatError(f"{path / RAY_MANIFEST}: incomplete manifest ({err!r})") from None
    created = manifest.get("created_at", 0.0)   # the store's creation time (absent before it was kept)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not np.isfinite(created):
        raise FormatError(f"{path / RAY_MANIFEST}: created_at is {created!r}; expected the store's creation time "
                          "(seconds since the epoch)")
    generation = generation_dir(path, manifest)
    dirs = [shard_dir(generation, s) for s in range(saved)]
    for directory in dirs:
        if not (directory / "manifest.json").exists():
            raise FormatError(f"{directory}: shard checkpoint missing; the Ray checkpoint is incomplete")
    return manifest, dirs


def reshard_task(directory: str, sink: "RaySink") -> int:
    """Stream one saved shard's episodes (oldest first) into another store's shards."""
    from arrowbuf.checkpoint import load_engine
    from arrowbuf.episode_read import read_episode

    engine = load_engine(directory, progress=False).engine
    table = engine.episodes()
    ids = table.column("episode_id").to_pylist()
    # Each episode keeps its env id, metadata and insertion time (its id is the new store's).
    inserted = table.column("inserted_at").cast(pa.int64()).to_pylist()
    metadata_of = table.column("metadata").to_pylist() if "metadata" in table.column_names else [None] * len(ids)
    for episode_id, env_id, metadata, at in zip(ids, table.column("env_id").to_pylist(), metadata_of, inserted):
        episode, _ = read_episode(engine.episode(episode_id), engine.schema, env_id,
                                  json.loads(metadata) if metadata else None)
        episode = dataclasses.replace(episode, inserted_at=at)
        sink.write(episode, route_key=f"{directory}:{episode_id}")   # spread episodes, not envs
        sink.commit()
    sink.close()
    return len(ids)


def to_ray_dataset(shards: "ShardHandles") -> Any:
    """A `ray.data.Dataset` of every shard's rows, built from Arrow tables the shards
    put in the object store (no round trip through the driver)."""
    import ray.data

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
    columns = {name: join_rows([p[name] for p in parts]) for name in [*schema.fields, FINAL]}
    has_final = bool(columns.pop(FINAL)[-1])
    num_steps = len(columns[next(iter(schema.fields))]) - int(has_final)
    for name, spec in schema.fields.items():
        if has_final and not spec.observation:
            columns[name] = columns[name][:num_steps]
    return Episode(columns, num_steps, has_final)
