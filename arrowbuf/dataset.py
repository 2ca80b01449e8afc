"""Offline datasets, opened and not loaded: `open_dataset` and `Dataset`.

A `Dataset` is a read-only store over a dataset on disk: an arrowbuf Parquet export
(``store.to_parquet``), an Arrow IPC directory, or a LeRobot v3 dataset
(`arrowbuf._dataset_sources`). The source is converted once into a
memory-mappable cache beside it (`arrowbuf._dataset_cache`), and the dataset samples
straight from the mapped columns: the rows are never loaded, and only the pages a
batch reads are brought in. A LeRobot video field's column holds each row's frame
reference, and its frames are decoded from the source's MP4 files when a batch
gathers them (`arrowbuf.video`). An encoded field's rows stay encoded in the cache and
are decoded when a batch gathers them; a ragged field's rows are sampled as jagged nested
tensors (`arrowbuf._dataset_heaps`), as a store samples them.

Sampling reuses the store's machinery unchanged: the rows keep the arena's layout
(each episode's steps, then its final observation), so a `MappedShard` holding the
mapped columns and the episode table is served by a `ShardEngine` like any shard,
with the same samplers (uniform, prioritized, sequences, episodes), the same
n-step and frame-stack look-ups (within episodes) and the same pooled gather.
Batches are the store's: a TensorDict with the fields at t, ``("next", obs)``,
``"index"``, ``"episode_id"`` and ``"step"``.

Example:
    >>> import numpy as np, arrowbuf as ab, tempfile, os
    >>> store = ab.ExperienceStore(capacity=100, seed=0)
    >>> _ = store.add_episode({"obs": np.zeros((4, 3), np.float32), "action": np.zeros(3, np.int64),
    ...                        "terminated": np.array([False, False, True])})
    >>> out = store.to_parquet(os.path.join(tempfile.mkdtemp(), "export"))
    >>> dataset = ab.open_dataset(out, seed=0)
    >>> len(dataset), dataset.sample(8)["next", "obs"].shape
    (3, torch.Size([8, 3]))
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch
from tensordict import TensorDict

from arrowbuf._checks import (check_bool, check_device, check_int, check_optional_int, check_path, check_priorities,
                              check_progress, check_sample_args, to_numpy)
from arrowbuf._dataset_cache import (MappedRows, cache_videos, check_cache_files, fingerprint, read_cache_manifest,
                                     read_episodes, source_changed, stored_schema, write_cache)
from arrowbuf._dataset_heaps import cache_heaps, heap_column
from arrowbuf._dataset_sources import EPISODES_IPC, detect, export_source, ipc_source, lerobot_files, lerobot_source
from arrowbuf._resident import FAULT_AROUND, ResidentBound
from arrowbuf.stage_arrays import host_tensor
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import FormatError, describe
from arrowbuf.parquet import MANIFEST as EXPORT_MANIFEST
from arrowbuf.rate_limiters import RateLimiter
from arrowbuf.samplers import PrioritizedSampler, Sampler, UniformSampler
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.placement import Ring
from arrowbuf.ragged import check_pad, pad_batch
from arrowbuf.shard import Shard
from arrowbuf.shard_arrow import episode_view
from arrowbuf.table import EpisodeTable
from arrowbuf.video import VIDEO_CACHE_BYTES, FrameCache, VideoReader

#: Where `open_dataset` keeps a source's cache, inside the source directory (``cache_dir=`` moves it).
CACHE_DIR = ".arrowbuf-cache"
#: Default ``resident_limit``: bytes of mapped pages a dataset lets sampling keep resident.
RESIDENT_LIMIT = 1 << 30

_SOURCES = {"export": export_source, "ipc": ipc_source, "lerobot": lerobot_source}


class MappedShard(Shard):
    """A read-only `Shard` whose columns are views of memory-mapped rows.

    Nothing is written into it: the engine that serves it only samples and gathers.
    Small fields are not row-packed (their columns are the file's), and its tensors
    of contiguous rows (`tensor_rows`) are views of read-only memory.
    """

    def __init__(self, schema: Schema, columns: dict[str, Any], table: EpisodeTable, num_rows: int) -> None:
        # Not Shard.__init__: that allocates an arena; these columns exist already.
        self.schema = schema
        self.capacity = max(num_rows, 1)
        self.mode = "fixed"
        self.table = table
        self.rows = self.capacity
        self.placement = Ring(table, self.capacity, self.rows, "fixed", write_pos=num_rows)
        self.specs = {**schema.fields, **SYSTEM_SPECS}
        self.packed, self._pack_offsets = None, {}
        self.arena = columns
        self._items = {}
        self._row_episode = None
        self.reuse = None
        self.gatherer = self.make_gatherer(self.gather_columns())

    def tensor_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return host_tensor(self.arena[name][start:stop], self.schema.fields[name])


def _episode_table(episodes: dict[str, Any]) -> EpisodeTable:
    """An `EpisodeTable` of the cache's episodes (no index map: `build_lookup` instead)."""
    n = len(episodes["episode_id"])
    env_names = sorted(set(episodes["env_id"]))
    codes = {name: k for k, name in enumerate(env_names)}
    length = episodes["length"]
    columns = {name: episodes[name] for name in ("episode_id", "first_row", "num_rows", "length", "has_final",
                                                 "terminated", "truncated", "return", "inserted_at")}
    columns["env"] = np.array([codes[e] for e in episodes["env_id"]], np.int32)
    columns["first_index"] = np.cumsum(length) - length
    table = EpisodeTable()
    table.load_state_dict({"shard": 0, "id_offset": 0, "id_stride": 1, "episodes_added": n,
                           "env_names": env_names, "counters": {"index": int(length.sum())}, "columns": columns,
                           "metadata": [[i, m] for i, m in enumerate(episodes["metadata"]) if m is not None]})
    table.build_lookup()
    return table


class Dataset:
    """A read-only, memory-mapped offline dataset, sampled like a store. Made by `open_dataset`.

    ``len(dataset)`` counts transitions, as a store's does (an export opens with its
    store's ``len``). Batches are the store's (see `ExperienceStore.sample`); their
    ``"index"`` numbers the dataset's transitions 0..len-1, in episode order.

    Resident memory: sampling brings the pages it reads into this process's resident
    set (a read fault maps the cached pages around it too: 64 KiB on Linux). When the
    mapped files are larger than ``resident_limit`` bytes, the dataset drops their pages
    from the resident set (they stay in the page cache) once they hold that many bytes
    (`arrowbuf._resident.ResidentBound`), so resident memory stays within
    ``resident_limit`` and one batch's rows whatever the dataset's size; smaller files
    are never dropped.

    Encoded fields (``codec=``) are decoded when a batch gathers them (``keys=`` that leave
    them out decode nothing), as a store's are; ragged fields come as jagged nested tensors,
    or padded with ``pad=``.

    Video fields (LeRobot's ``dtype: video``) are decoded from their files when a batch
    gathers them (`arrowbuf.video`), through a cache of decoded frames of at most
    ``video_cache_bytes`` (`video_cache` counts its hits, misses and decoded frames);
    ``keys=`` that leave them out decode nothing.
    """

    def __init__(self, directory: Path, manifest: dict, sampler: Sampler, seed: int | None,
                 resident_limit: int | None, verify: bool, video_cache_bytes: int = VIDEO_CACHE_BYTES) -> None:
        try:
            schema = Schema.from_json(json.dumps(manifest["schema"]))
        except (ValueError, TypeError, KeyError) as err:
            raise FormatError(f"{directory}: the cache's schema does not parse ({err})") from None
        check_cache_files(directory, manifest, verify)
        episodes = read_episodes(directory, manifest)
        self.path = directory
        self.info = dict(manifest["source"].get("info") or {}, kind=manifest["source"].get("kind"),
                         source=manifest["source"].get("path"))
        self.sampler = sampler
        self.seed = seed
        videos = cache_videos(manifest, directory)
        heaps = cache_heaps(manifest, schema, directory)
        stored = stored_schema(schema, videos, heaps)
        self._rows = MappedRows(directory, stored, manifest["num_rows"], manifest["format_version"], heaps)
        columns: dict[str, Any] = dict(self._rows.columns)
        for name, file in heaps.items():   # encoded and ragged fields: their kinds' columns over the heap files
            columns[name] = heap_column(schema.fields[name], name, columns[name], self._rows.heaps[name],
                                        directory / file)
        # The video files are the source's: its path, as the conversion recorded it.
        self._videos = VideoReader(Path(manifest["source"].get("path", directory)), video_cache_bytes) \
            if videos else None
        for name, spec in videos.items():
            columns[name] = self._videos.column(name, spec, columns[name])
        self._engine = ShardEngine(max(manifest["num_rows"], 1), sampler=sampler, rate_limiter=RateLimiter(),
                                   seed=seed)
        table = _episode_table(episodes)
        self._engine.attach(MappedShard(schema, columns, table, manifest["num_rows"]))
        if sampler.tracks_rows:   # a prioritized sampler: every transition at the first priority
            for first, length in zip(table.col("first_row").tolist(), table.col("length").tolist()):
                if length:
                    sampler.on_add(first, length)
        # Bytes one gathered row may make resident: a fault per column read (and per heap
        # file), each mapping the pages around it (`FAULT_AROUND`), plus the row and the next
        # one (a heap field's: its mean row).
        limited = resident_limit is not None and self._rows.nbytes > resident_limit
        heap_row = sum(len(data) for data in self._rows.heaps.values()) // max(manifest["num_rows"], 1)
        self._bound = ResidentBound(self._rows, resident_limit, (len(schema.fields) + len(heaps)) * FAULT_AROUND
                                    + 2 * (stored.row_bytes + heap_row)) if limited else None

    # -- shape -----------------------------------------------------------------------

    @property
    def schema(self) -> Schema:
        return self._engine.schema

    @property
    def engine(self) -> ShardEngine:
        """The engine serving the mapped shard (a `Mixture` samples it directly)."""
        return self._engine

    def __len__(self) -> int:
        """Transitions (steps that have a next observation)."""
        return len(self._engine)

    @property
    def num_episodes(self) -> int:
        return self._engine.num_episodes

    @property
    def nbytes(self) -> int:
        """Bytes of the memory-mapped files: the rows, and the heap files of encoded and ragged fields."""
        return self._rows.nbytes

    @property
    def video_cache(self) -> FrameCache | None:
        """The cache of decoded video frames (``nbytes``, ``max_bytes``, ``hits``, ``misses``,
        ``decoded``); None without video fields."""
        return self._videos.cache if self._videos is not None else None

    def __repr__(self) -> str:
        return (f"Dataset({str(self.path)!r}, kind={self.info.get('kind')!r}, transitions={len(self)}, "
                f"episodes={self.num_episodes}, sampler={self.sampler!r}, schema={self.schema!r})")

    def episodes(self) -> pa.Table:
        """The episode table (as `ExperienceStore.episodes`)."""
        return self._engine.episodes()

    def episode(self, episode_id: int) -> pa.RecordBatch:
        """One episode's rows, zero-copy views of the mapped file.

        Raises:
            KeyError: no episode has this id.
        """
        ids = self._engine.table.col("episode_id")
        found = np.flatnonzero(ids == episode_id) if isinstance(episode_id, (int, np.integer)) else []
        if not len(found):
            raise KeyError(f"episode {episode_id!r} is not in the dataset ({len(ids)} episodes)")
        return episode_view(self._engine.shard, int(found[0]))

    def to_arrow(self) -> pa.Table:
        """Every row (system columns computed), zero-copy where the columns allow."""
        return self._engine.to_arrow()

    # -- sampling ---------------------------------------------------------------------

    def sample(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               keys: list | None = None, min_version: int | None = None, pad: dict | None = None) -> TensorDict:
        """Sample with the dataset's sampler, as `ExperienceStore.sample` does (n-step
        returns and frame stacks stay within episodes); ``min_version``: only steps of
        ``policy_version`` >= it (`arrowbuf.versions`); ``pad``: {ragged field: pad value},
        that field as a padded ``[B, L_max]`` tensor plus ``<field>_length`` (`arrowbuf.ragged`).

        Raises:
            ValueError: a bad argument.
            EmptyStoreError: the dataset holds no transition (of ``min_version``).
        """
        batch_size = check_int("batch_size", batch_size, 1)
        args = check_sample_args(n_step, gamma, frame_stack, self.schema if n_step != 1 else None)
        device = check_device(device)
        pin_memory = check_bool("pin_memory", pin_memory)
        min_version = check_optional_int("min_version", min_version, 0)
        pad = check_pad(pad, self.schema)
        batch = self._engine.sample(batch_size, args, device, pin_memory, None, keys, min_version)
        self.touched(batch.numel())
        return batch if pad is None else pad_batch(batch, pad)

    def sample_iter(self, batch_size: int, prefetch: int = 4, batches_per_request: int | None = None, *,
                    n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
                    device: torch.device | str | None = None, keys: list | None = None,
                    pad: dict | None = None) -> Iterator[TensorDict]:
        """Endless `sample` batches (``prefetch`` and ``batches_per_request`` are a Ray
        store's and are ignored here); its arguments are checked when it is called."""
        batch_size = check_int("batch_size", batch_size, 1)
        check_sample_args(n_step, gamma, frame_stack, self.schema)
        check_device(device)
        self._engine.check_keys(keys)
        check_pad(pad, self.schema)
        return (self.sample(batch_size, n_step=n_step, gamma=gamma, frame_stack=frame_stack, device=device, keys=keys,
                            pad=pad) for _ in itertools.count())

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     epochs: int = 1, device: torch.device | str | None = None,
                     keys: list | None = None, min_version: int | None = None,
                     pad: dict | None = None) -> Iterator[TensorDict]:
        """Every transition once per epoch, in batches (as `ExperienceStore.iter_batches`;
        batches are always copies: the mapped rows are read-only; ``pad`` as in `sample`).

        Raises:
            ValueError: a bad argument.
        """
        batch_size = check_int("batch_size", batch_size, 1)
        shuffle = check_bool("shuffle", shuffle)
        drop_last = check_bool("drop_last", drop_last)
        epochs = check_int("epochs", epochs, 1)
        device = check_device(device)
        keys = self._engine.check_keys(keys)
        min_version = check_optional_int("min_version", min_version, 0)
        pad = check_pad(pad, self.schema)
        return self._epochs(batch_size, shuffle, drop_last, epochs, device, keys, min_version, pad)

    def _epochs(self, batch_size: int, shuffle: bool, drop_last: bool, epochs: int, device: Any,
                keys: Any, min_version: int | None, pad: dict | None) -> Iterator[TensorDict]:
        for _ in range(epochs):
            for indices in self._engine.epoch(batch_size, shuffle, drop_last, min_version):
                batch = self._engine.gather(indices, device, keys)
                self.touched(len(indices))
                yield batch if pad is None else pad_batch(batch, pad)

    def gather(self, index: Any, *, device: torch.device | str | None = None) -> TensorDict:
        """The transitions of ``index`` (values of a batch's ``"index"``), in that order.

        Raises:
            ValueError: ``index`` is not a 1-D array of ints.
            KeyError: some indices are outside 0..len-1.
        """
        array, _ = to_numpy(index, "index")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"index must be a 1-D array of ints, got {describe(array)}")
        array = array.astype(np.int64)
        live = self._engine.table.is_live(array)
        if not live.all():
            raise KeyError(f"{int((~live).sum())} of the {len(array)} indices are outside the dataset's "
                           f"0..{len(self) - 1}")
        batch = self._engine.gather(array, check_device(device))
        self.touched(len(array))
        return batch

    def update_priorities(self, index: Any, priority: Any, *, wait: bool = True) -> int:
        """Set priorities of sampled transitions (a dataset opened with a `PrioritizedSampler`);
        as `ExperienceStore.update_priorities`. Returns how many indices were in the dataset.

        Raises:
            ValueError: not prioritized, or bad input (nothing is changed).
        """
        if not isinstance(self.sampler, PrioritizedSampler):
            raise ValueError(f"update_priorities needs a PrioritizedSampler; this dataset uses {self.sampler!r}")
        check_bool("wait", wait)
        index, priority = check_priorities(index, priority, self.sampler.alpha, self.sampler.eps,
                                           self._engine.capacity)
        return self._engine.update_priorities(index, priority)

    def touched(self, rows: int) -> None:
        """Count ``rows`` gathered rows (sampled here, or by a `Mixture` through `engine`);
        past the resident limit, drop the mapped pages (`ResidentBound`)."""
        if self._bound is not None:
            self._bound.touched(rows)

    def release(self) -> None:
        """Drop the mapped pages from this process's resident set now (they stay in the page cache)."""
        if self._bound is not None:
            self._bound.release()
        else:
            self._rows.release()

    def close(self) -> None:
        """Unmap the rows and close the video files; the dataset cannot be sampled after."""
        self._rows.close()
        if self._videos is not None:
            self._videos.close()

    def __enter__(self) -> "Dataset":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def source_files(kind: str, path: Path) -> tuple[list[Path], list[Path]]:
    """(files, hashed files) a cache of ``path`` records, listed without parsing the rows."""
    if kind == "export":
        manifest = json.loads((path / EXPORT_MANIFEST).read_text())
        try:
            listed = [e["path"] for e in manifest["steps"]] + [manifest["episodes"]["path"]]
        except (KeyError, TypeError) as err:
            raise FormatError(f"{path / EXPORT_MANIFEST}: incomplete manifest ({err!r})") from None
        return [path / EXPORT_MANIFEST, *(path / p for p in listed)], [path / EXPORT_MANIFEST]
    if kind == "lerobot":
        return lerobot_files(path)
    rows = sorted(p for p in path.glob("*.arrow") if p.name != EPISODES_IPC)
    return [*rows, path / EPISODES_IPC], [path / EPISODES_IPC]


def open_dataset(path: str | Path, *, sampler: Sampler | None = None, seed: int | None = None,
                 cache_dir: str | Path | None = None, rebuild: bool = True, verify: bool = False,
                 resident_limit: int | None = RESIDENT_LIMIT, progress: bool | None = None,
                 video_cache_bytes: int = VIDEO_CACHE_BYTES) -> Dataset:
    """Open an offline dataset for sampling, without loading it.

    Args:
        path: an arrowbuf Parquet export (``store.to_parquet``), an Arrow IPC directory
            (``episodes.arrow`` + ``*.arrow`` files of rows), a LeRobot v3 dataset's
            root (``meta/info.json``), or a dataset cache directory itself.
        sampler: how `Dataset.sample` selects (`UniformSampler` by default; any
            store sampler: `PrioritizedSampler`, `SequenceSampler`, ...), one per dataset.
        seed: seed of the dataset's generator.
        cache_dir: where the memory-mappable cache goes (default: ``path/.arrowbuf-cache``).
        rebuild: when the cache is missing, or its source changed since it was converted
            (a source file's size, mtime or hash), convert again (True) or raise
            `FormatError` (False; a missing cache is converted either way).
        verify: check the cache files' SHA-256 on every open (by default only when a
            cache file's stat, mtime, inode or ctime, changed since it was recorded;
            sizes and layout always).
        resident_limit: bytes of mapped pages sampling may keep resident before they are
            dropped (`Dataset`); None never drops them (the kernel reclaims them under
            memory pressure).
        progress: a progress bar for the conversion (None: when stderr is a terminal).
        video_cache_bytes: bytes of decoded video frames the dataset keeps (LeRobot
            video fields, decoded when sampled; default 256 MiB, 0 keeps none).

    Raises:
        FormatError: not a dataset arrowbuf reads, a damaged source or cache, or a stale
            cache with ``rebuild=False``.
        ValueError: a bad argument.
    """
    path = check_path("path", path)
    sampler = UniformSampler() if sampler is None else sampler
    if not isinstance(sampler, Sampler):
        raise ValueError(f"sampler must be an arrowbuf Sampler (UniformSampler(), PrioritizedSampler(), ...), "
                         f"got {describe(sampler)}")
    if seed is not None:
        seed = check_int("seed", seed, 0)
    rebuild, verify, progress = check_bool("rebuild", rebuild), check_bool("verify", verify), check_progress(progress)
    resident_limit = check_optional_int("resident_limit", resident_limit, 0)
    video_cache_bytes = check_int("video_cache_bytes", video_cache_bytes, 0)
    if not path.is_dir():
        raise FormatError(f"{path}: no such directory")
    kind = detect(path)
    if kind == "cache":
        return Dataset(path, read_cache_manifest(path), sampler, seed, resident_limit, verify, video_cache_bytes)
    cache = check_path("cache_dir", cache_dir) if cache_dir is not None else path / CACHE_DIR
    files, hashed = source_files(kind, path)
    if cache.exists():
        manifest = read_cache_manifest(cache)
        changed = source_changed(manifest, fingerprint(path, files, hashed))
        if not changed:
            return Dataset(cache, manifest, sampler, seed, resident_limit, verify, video_cache_bytes)
        if not rebuild:
            raise FormatError(f"{cache}: the cache is stale: {changed[:5]} changed since it was converted from "
                              f"{path}; pass rebuild=True to convert again")
    write_cache(cache, _SOURCES[kind](path), progress)
    return Dataset(cache, read_cache_manifest(cache), sampler, seed, resident_limit, verify, video_cache_bytes)
