"""Checkpoints: a store saved to Arrow IPC files and loaded back bit-exact.

Layout of ``store.save("ckpt/")``::

    ckpt/
      manifest.json                   written last (atomic rename): the files below with
                                      their sizes and SHA-256, the schema, store settings,
                                      the JSON part of the state, and its own checksum
      rows-<first id>-<token>.arrow   rows of live episodes (plain columns, as in Parquet
                                      exports), one file per save that added episodes
      state-<token>.arrow             the arrays of the state: episode table, sampler
                                      (priority tree, epoch order), open writer episodes

The state is everything sampling depends on: episode table (ids, indices, arena
placement), sampler state, the store generator's state, rate-limiter counters and
the open episodes of the store's writers; nothing is pickled. `load` puts every
episode back at its arena row, so sampling the loaded store gives the same batches
as sampling the original would have.

**Incremental saves.** A save into a directory holding a save this store made (or
was loaded from) writes only the episodes added since, a new state file and the
manifest, and deletes row files whose episodes were all evicted (row files that
are partly evicted stay until all their episodes are). Any other directory gets
a full save, replacing the checkpoint files there. ``base=`` points at the
previous save elsewhere: Ray checkpoints write each generation into a new
directory and link the unchanged row files.

**Verified loads.** `load` checks, before trusting anything it reads: the
manifest's checksum, every file's size and SHA-256, Arrow validation of every
record batch (`arrowbuf._persist.ipc_batches`), and the state against its domains
(`arrowbuf._state_checks`: episodes inside the arena and not overlapping, the
write position after the newest episode, sampler, limiter, generator and writer
state). Any mismatch is a `FormatError` naming the file.

**Consistency.** The store's lock is held while the snapshot is taken (episode
positions and a copy of the state), not while rows are written: see
`arrowbuf._persist.snapshot_and_write` for how rows overwritten meanwhile are
detected and re-copied. Writers are snapshotted as they are, so take a save
between the steps of writers driven by other threads. One save at a time per
directory.

**Crashes.** A save is one `arrowbuf._filesink.ManifestSink`: new files are
written aside and flushed, moved in under fresh names, and the manifest is replaced
last, so a crash during a save leaves the previous checkpoint loadable (or, on
the first save, no manifest, which `load` refuses). The next save removes what a
crashed one left.

Example:
    >>> import numpy as np, arrowbuf as ab, tempfile
    >>> store = ab.ExperienceStore(capacity=100, seed=0)
    >>> _ = store.add_episode({"obs": np.zeros((4, 3), np.float32), "action": np.zeros(3, np.int64),
    ...                        "terminated": np.array([False, False, True])})
    >>> ckpt = tempfile.mkdtemp()
    >>> _ = store.save(ckpt)
    >>> loaded = ab.ExperienceStore.load(ckpt)
    >>> bool((loaded.sample(8)["obs"] == store.sample(8)["obs"]).all())
    True
"""

from __future__ import annotations

import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping

import numpy as np
import pyarrow as pa

from arrowbuf._checks import check_storage_device
from arrowbuf._filesink import STAGING_PREFIX, ManifestSink, fsync, link_or_copy, remove
from arrowbuf._persist import (CHECKPOINT_MANIFEST, EpisodeRows, arrays_table, batch_columns, check_columns,
                               check_file, check_format, file_entry, ipc_batches, ipc_schema, join_arrays,
                               plain_schema, progress_bar, read_json, read_manifest, snapshot_and_write,
                               split_arrays, table_arrays, take_rows, write_ipc, write_manifest)
from arrowbuf._state_checks import check_state
from arrowbuf._version import __version__
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import ArrowbufError, FormatError
from arrowbuf.freshness import FreshnessSampler
from arrowbuf.groups import GroupSampler
from arrowbuf.rate_limiters import MinSize, RateLimiter, SampleToInsertRatio
from arrowbuf.samplers import (EpisodeSampler, PrioritizedSampler, SequenceSampler, UniformSampler,
                               WithoutReplacementSampler)
from arrowbuf.shard import Shard

FORMAT = "arrowbuf.checkpoint"
FORMAT_VERSION = 2      # 2: content hashes of every file, and of the manifest
MANIFEST = CHECKPOINT_MANIFEST
_BATCH_ROWS = 1 << 16    # rows per IPC record batch (progress granularity)

#: Names in states written before "rank" became "index" (checkpoints of format 2
#: from earlier versions): `upgrade_state` reads them under today's names.
_RENAMED_COUNTERS = {"rank": "index"}


def upgrade_state(state: dict[str, Any]) -> dict[str, Any]:
    """A table `state_dict` with the names of earlier versions renamed (in place; returned)."""
    for old, new in _RENAMED_COUNTERS.items():
        if old in state.get("counters", {}) and new not in state["counters"]:
            state["counters"][new] = state["counters"].pop(old)
        columns = state.get("columns", {})
        if f"first_{old}" in columns and f"first_{new}" not in columns:
            columns[f"first_{new}"] = columns.pop(f"first_{old}")
    return state


SAMPLERS = {c.__name__: c for c in (UniformSampler, WithoutReplacementSampler, PrioritizedSampler, GroupSampler,
                                    SequenceSampler, EpisodeSampler, FreshnessSampler)}
RATE_LIMITERS = {c.__name__: c for c in (RateLimiter, MinSize, SampleToInsertRatio)}


@dataclass
class _Snapshot:
    state: dict[str, Any]
    shard: Shard | None
    schema: pa.Schema | None       # of the row files
    rows: EpisodeRows | None       # episodes added since the previous save
    oldest_live: int | None        # oldest live episode id when the snapshot was taken

    def valid(self) -> bool:
        """No row written was overwritten meanwhile (call under the engine's lock)."""
        return self.rows is None or self.rows.still_live(self.shard)


# -- save ------------------------------------------------------------------------------


def save_engine(engine: ShardEngine, path: str | Path, info: Mapping[str, Any],
                writers: Callable[[], dict[str, Any]] = dict, progress: bool | None = None,
                base: str | Path | None = None) -> Path:
    """Checkpoint one shard engine into directory ``path``, through a `ManifestSink`.

    Args:
        engine: the engine to save (its lock is held while the snapshot is taken).
        path: the directory.
        info: the store settings saved beside it (capacity, mode, seed,
            track_reuse, created_at).
        writers: returns the state of each open writer by name (called under the lock).
        progress: a tqdm bar; None shows it when stderr is a terminal.
        base: where this engine's previous checkpoint is (default ``path``): when
            it holds a save this engine made or loaded, only the episodes added
            since are written, and its row files that are still needed are linked
            into ``path`` (Ray checkpoints save each generation into a new directory).

    Raises:
        FileExistsError: ``path`` is a file, or holds a manifest.json that is not
            an arrowbuf checkpoint.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path} is a file; save needs a directory")
    _refuse_foreign(path)
    base = path if base is None else Path(base)
    previous = _previous(base, set(engine.checkpoints.values()))
    since = previous["last_episode_id"] if previous else None
    token = uuid.uuid4().hex[:16]

    def take(copy: bool) -> _Snapshot:
        shard = engine.shard
        state = {"store": dict(info), **engine.state_dict(), "writers": writers()}
        if shard is None:
            return _Snapshot(state, None, None, None, None)
        schema = plain_schema(shard.schema, {"arrowbuf.version": __version__, "arrowbuf.format": FORMAT})
        ids = shard.table.col("episode_id")
        start = 0 if since is None else int(np.searchsorted(ids, since, side="right"))
        return _Snapshot(state, shard, schema, take_rows(shard, start, len(ids), schema, copy),
                         int(ids[0]) if len(ids) else None)

    path.mkdir(parents=True, exist_ok=True)
    with ManifestSink(path, MANIFEST) as sink:
        def write(snapshot: _Snapshot) -> dict[str, Any] | None:
            if snapshot.rows is None or not len(snapshot.rows.ids):
                return None
            return _write_rows(sink.pending, snapshot.rows, snapshot.schema, token, progress)

        def discard(entry: dict[str, Any] | None) -> None:
            if entry is not None:
                (sink.pending / entry["path"]).unlink()

        snapshot, entry = snapshot_and_write(engine.lock, take, _Snapshot.valid, write, discard)
        kept = [e for e in (previous["row_files"] if previous else [])
                if snapshot.oldest_live is not None and e["last_episode_id"] >= snapshot.oldest_live]
        for e in kept:
            if not (path / e["path"]).exists():
                link_or_copy(base / e["path"], sink.pending / e["path"])
        row_files = kept + ([entry] if entry is not None else [])
        tree, arrays = split_arrays(snapshot.state)
        state_file = sink.pending / f"state-{token}.arrow"
        table = arrays_table(arrays)
        write_ipc(state_file, table.schema, table.to_batches())
        last = entry["last_episode_id"] if entry is not None else (previous["last_episode_id"] if previous else -1)
        write_manifest(sink.pending / MANIFEST, {
            "format": FORMAT, "format_version": FORMAT_VERSION, "arrowbuf_version": __version__,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "token": token,
            "last_episode_id": last, "row_files": row_files,
            "state_file": {"path": state_file.name, **file_entry(state_file)}, "state": tree,
        })
    _remove_unlisted(path, {e["path"] for e in row_files} | {state_file.name})
    engine.remember_checkpoint(str(path.resolve()), token)
    return path


def _refuse_foreign(path: Path) -> None:
    """Raises `FileExistsError` when ``path`` holds a manifest.json of something else."""
    manifest_path = path / MANIFEST
    if not manifest_path.exists():
        return
    try:
        fmt = read_json(manifest_path, "").get("format")
    except FormatError:
        fmt = FORMAT          # a damaged checkpoint of ours: the save replaces it
    if fmt != FORMAT:
        raise FileExistsError(f"{manifest_path} is not an arrowbuf checkpoint manifest; refusing to overwrite it")


def _previous(path: Path, tokens: set[str]) -> dict[str, Any] | None:
    """The manifest in ``path`` when it is intact and one of ``tokens`` (a save this store made or loaded)."""
    manifest_path = path / MANIFEST
    if not tokens or not manifest_path.exists():
        return None
    try:
        manifest = read_json(manifest_path, "")
        check_format(manifest, manifest_path, FORMAT, FORMAT_VERSION)
    except FormatError:
        return None
    if manifest.get("token") not in tokens or manifest.get("format_version") != FORMAT_VERSION:
        return None
    for entry in manifest["row_files"]:
        file = path / entry["path"]
        if not file.exists() or file.stat().st_size != entry["bytes"]:
            return None
    return manifest


def _write_rows(directory: Path, rows: EpisodeRows, schema: pa.Schema, token: str, progress: bool | None) -> dict:
    file = directory / f"rows-{int(rows.ids[0]):012d}-{token}.arrow"

    def pieces() -> Iterator[pa.RecordBatch]:
        with progress_bar(progress, rows.rows, f"save {directory.parent.name}") as bar:
            for batch in rows.batches:
                for offset in range(0, batch.num_rows, _BATCH_ROWS):
                    piece = batch.slice(offset, _BATCH_ROWS)
                    yield piece
                    bar.update(piece.num_rows)

    write_ipc(file, schema, pieces())
    return {"path": file.name, "first_episode_id": int(rows.ids[0]), "last_episode_id": int(rows.ids[-1]),
            "episodes": len(rows.ids), "rows": rows.rows, **file_entry(file)}


def _remove_unlisted(path: Path, listed: set[str]) -> None:
    """Delete checkpoint files the manifest no longer lists, and what crashed saves left."""
    for file in path.iterdir():
        name = file.name
        ours = (name.startswith(("rows-", "state-")) and name.endswith(".arrow")) or name.startswith(
            STAGING_PREFIX) or (name.startswith(".") and ".tmp-" in name)
        if ours and name not in listed:
            remove(file)
    fsync(path)


# -- load ------------------------------------------------------------------------------


@dataclass
class Loaded:
    """A loaded checkpoint: the restored engine, the saved store settings and open writers."""

    engine: ShardEngine
    info: dict[str, Any]           # capacity, mode, seed, track_reuse, created_at
    writers: dict[str, Any]        # name -> writer state_dict
    manifest: Path                 # named by errors of what is restored from it later (`typed_errors`)

    def typed_errors(self) -> ContextManager[None]:
        """Errors of restoring more of this checkpoint (its writers) become `FormatError`s."""
        return typed_errors(self.manifest)


@contextmanager
def typed_errors(manifest_path: Path) -> Iterator[None]:
    """Raise what goes wrong while a checkpoint's values are restored as a `FormatError`
    naming its manifest (values the state checks did not cover)."""
    try:
        yield
    except FormatError:
        raise
    except (ArrowbufError, pa.ArrowException, KeyError, TypeError, ValueError, IndexError, AttributeError,
            OverflowError, MemoryError) as err:
        raise FormatError(f"{manifest_path}: inconsistent checkpoint ({type(err).__name__}: {err})") from None


def load_engine(path: str | Path, progress: bool | None = None, shard: int = 0, num_shards: int = 1,
                storage_device: Any = "as saved", whole_pieces: bool = False, room: int | None = None) -> Loaded:
    """The engine saved in ``path``, complete before it is returned.

    Nothing read is trusted before it is checked: the manifest's checksum, every
    file's size and SHA-256, every record batch (Arrow validation), then the state
    against its domains (`arrowbuf._state_checks`).

    Args:
        path: the checkpoint directory.
        progress: a tqdm bar; None shows it when stderr is a terminal.
        shard, num_shards: the engine's place in a Ray store.
        whole_pieces: the engine evicts whole pieces only (a Ray shard's: `arrowbuf.placement`).
        room: the largest capacity the engine may be given later (a Ray shard's: its store's
            capacity, `arrowbuf.ray.shares`); default: the saved one (a Ray shard's ``room``), else its capacity.
        storage_device: a checked torch.device or None for the engine's columns;
            "as saved": the saved store's (``store.storage_device`` of the info).

    Raises:
        FormatError: a missing or incomplete directory, a newer format version, a
            missing, truncated, corrupted or inconsistent file, or a state outside
            its domain; the message names the file.
    """
    path = Path(path)
    manifest_path, manifest = read_manifest(path, "checkpoint")
    check_format(manifest, manifest_path, FORMAT, FORMAT_VERSION)
    with typed_errors(manifest_path):
        state_entry, row_files, token = manifest["state_file"], manifest["row_files"], manifest["token"]
        state_file = path / _name(state_entry["path"], manifest_path)
        hashed = manifest["format_version"] >= 2
        check_file(state_file, state_entry, hashed)
        for entry in row_files:
            check_file(path / _name(entry["path"], manifest_path), entry, hashed)
        state = join_arrays(manifest["state"], table_arrays(_read_state(state_file)))
        if isinstance(state.get("shard"), dict) and isinstance(state["shard"].get("table"), dict):
            upgrade_state(state["shard"]["table"])
        check_state(state, str(manifest_path))
        info = state["store"]
        if storage_device == "as saved":
            storage_device = _saved_device(info.get("storage_device"), manifest_path)
        engine = ShardEngine(int(info["capacity"]), seed=info["seed"], mode=info["mode"],
                             sampler=_build(SAMPLERS, state["sampler"], "sampler", manifest_path),
                             rate_limiter=_build(RATE_LIMITERS, state["rate_limiter"], "rate limiter", manifest_path),
                             track_reuse=bool(info["track_reuse"]), shard=shard, num_shards=num_shards,
                             storage_device=storage_device, whole_pieces=whole_pieces,
                             room=room if room is not None else info.get("room"))
        engine.load_state_dict(state, lambda restored: _fill(restored, path, row_files, progress))
        loaded = Loaded(engine, dict(info), dict(state["writers"]), manifest_path)
    engine.remember_checkpoint(str(path.resolve()), token)
    return loaded


def _saved_device(name: Any, where: Path) -> Any:
    """The checked torch device a store was saved from (None: numpy columns)."""
    try:
        return check_storage_device(name, "local")
    except ValueError as err:
        raise FormatError(f"{where}: the store was saved with its columns on {name!r}, which this process cannot "
                          f"use ({err}); pass storage_device= to load(), e.g. 'cpu'") from None


def _build(registry: Mapping[str, type], state: Mapping[str, Any], what: str, where: Path) -> Any:
    kind = registry.get(state["type"])
    if kind is None:
        raise FormatError(f"{where}: the {what} is a {state['type']}, which checkpoints cannot rebuild; "
                          f"supported: {sorted(registry)}")
    return kind(**state["config"])


def _name(name: Any, where: Path) -> str:
    """A file name from a manifest: a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise FormatError(f"{where}: file name {name!r} is not a plain file name in the checkpoint directory")
    return name


def _read_state(file: Path) -> pa.Table:
    return pa.Table.from_batches(list(ipc_batches(file)), schema=ipc_schema(file))


def _fill(shard: Shard, path: Path, row_files: list[Mapping[str, Any]], progress: bool | None) -> None:
    """Copy the live episodes' rows from the row files to their arena rows."""
    table = shard.table
    live_ids, first, num = table.col("episode_id"), table.col("first_row"), table.col("num_rows")
    filled = np.zeros(len(table), np.int64)
    # Counting rows per episode is not enough: a row given twice makes up for one missing.
    written = np.zeros(int((first + num).max()) if len(table) else 0, bool)
    expected = plain_schema(shard.schema)
    with progress_bar(progress, int(num.sum()), f"load {path.name}") as bar:
        for entry in row_files:
            file = path / entry["path"]
            check_columns(ipc_schema(file), expected, str(file))
            for batch in ipc_batches(file):
                columns = batch_columns(batch, shard.specs, str(file))
                ids, step = columns["episode_id"], columns["step"].astype(np.int64)
                pos = np.asarray(table.position_of(ids))
                live = (pos >= 0) & (pos < len(table))
                live[live] = live_ids[pos[live]] == ids[live]
                pos, step = pos[live], step[live]
                if table.pieces:   # steps count from the episode's start; rows from the piece's
                    step = step - table.col("first_step")[pos]
                    # Rows before a piece's first (its oldest steps were evicted since an earlier
                    # save wrote this file: `EpisodeTable.trim_oldest`) are not loaded.
                    kept = step >= 0
                    live[live] = kept
                    pos, step = pos[kept], step[kept]
                if np.any((step < 0) | (step >= num[pos])):
                    raise FormatError(f"{file}: rows with steps outside their episode")
                target = first[pos] + step
                if written[target].any() or len(np.unique(target)) != len(target):
                    raise FormatError(f"{file}: a row of an episode is given twice; the checkpoint is damaged")
                written[target] = True
                for name in shard.schema.fields:   # system columns follow from the table
                    shard.put_rows(name, target, columns[name][live])
                filled += np.bincount(pos, minlength=len(table))
                bar.update(len(pos))
    short = np.flatnonzero(filled != num)
    if len(short):
        k = short[0]
        raise FormatError(f"{path}: episode {int(live_ids[k])} has {int(filled[k])} of its {int(num[k])} rows in "
                          f"the row files; the checkpoint is incomplete")
