"""Loading a Parquet export into a new store: episode selection, capacity, streaming.

`ExperienceStore.from_parquet` lands here. The rows are read row group by row
group (about 64 MiB each, `arrowbuf.parquet.group_rows`) and copied into the
store's arena one episode at a time, so an export larger than memory loads into a
store of any capacity: the newest selected episodes that fit are kept, the files
and row groups of the others are not read. Every file read is checked against the
SHA-256 the manifest recorded first, and its page checksums as it is read.
"""

from __future__ import annotations

import heapq
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Union

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from arrowbuf._persist import batch_columns, check_file, join_rows, progress_bar
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import CapacityError, FormatError
from arrowbuf.parquet import EPISODES, STEPS, Export, group_rows, open_export
from arrowbuf.schema import SYSTEM_SPECS, Schema
from arrowbuf.shard import Episode, Shard

if TYPE_CHECKING:   # pyarrow.compute takes a while to import: only when a filter uses it
    import pyarrow.compute as pc

#: What `from_parquet` accepts as ``episode_filter``.
EpisodeFilter = Union[Callable[[pa.Table], Any], "pc.Expression"]


def select_episodes(episodes: pa.Table, episode_filter: EpisodeFilter | None) -> np.ndarray:
    """A boolean mask over the episode table from ``episode_filter``.

    The filter is a `pyarrow.compute.Expression` over the episode table's columns,
    or a callable taking the table and returning a boolean mask (one per episode)
    or the episode ids to keep.

    Raises:
        ValueError: a filter result of the wrong length, type, or with unknown ids.
    """
    import pyarrow.compute as pc

    n = episodes.num_rows
    if episode_filter is None:
        return np.ones(n, bool)
    ids = episodes.column("episode_id").to_numpy()
    if isinstance(episode_filter, pc.Expression):
        kept = episodes.filter(episode_filter).column("episode_id").to_numpy()
        return np.isin(ids, kept)
    if not callable(episode_filter):
        raise ValueError(f"episode_filter must be a callable or a pyarrow.compute.Expression, got {episode_filter!r}")
    result = episode_filter(episodes)
    if isinstance(result, (pa.Array, pa.ChunkedArray)):
        result = result.to_numpy(zero_copy_only=False)
    result = np.asarray(result)
    if result.dtype == bool:
        if result.shape != (n,):
            raise ValueError(f"episode_filter returned a mask of shape {result.shape}; "
                             f"expected ({n},), one per episode")
        return result
    if result.size and not np.issubdtype(result.dtype, np.integer):
        raise ValueError(f"episode_filter must return a boolean mask or episode ids, got dtype {result.dtype}")
    unknown = np.setdiff1d(result, ids)
    if unknown.size:
        raise ValueError(f"episode_filter returned ids not in the export: {unknown[:5].tolist()}")
    return np.isin(ids, result)


def newest_that_fit(length: np.ndarray, selected: np.ndarray, capacity: int, mode: str) -> np.ndarray:
    """The selected episodes a store of ``capacity`` transitions keeps: the newest whose
    transitions (``length``) fit.

    Raises:
        CapacityError: a selected episode is longer than the capacity, or
            ``mode="fixed"`` and they do not all fit.
    """
    too_long = selected & (length > capacity)
    if too_long.any():
        raise CapacityError(f"{int(too_long.sum())} selected episode(s) have more transitions than the capacity of "
                            f"{capacity} (up to {int(length[too_long].max())}); raise capacity or filter them out")
    rows = np.where(selected, length, 0)
    from_newest = np.cumsum(rows[::-1])[::-1]
    kept = selected & (from_newest <= capacity)
    if mode == "fixed" and not np.array_equal(kept, selected):
        raise CapacityError(f"the selected episodes hold {int(rows.sum())} transitions, more than the capacity of "
                            f"{capacity}, and mode='fixed' does not evict; raise capacity or filter episodes")
    return kept


def insertion_order(episodes: pa.Table) -> np.ndarray:
    """The positions of an export's episode table in the order its episodes were stored.

    A one-shard export lists them so already; a Ray store's lists each shard's in turn
    (each shard's files hold its own, oldest first), so its shards' lists are merged by
    ``inserted_at``, each keeping its own order.
    """
    shards = episodes.column("shard").to_numpy() if "shard" in episodes.column_names else np.zeros(0)
    if len(np.unique(shards)) < 2:
        return np.arange(episodes.num_rows)
    inserted = episodes.column("inserted_at").cast(pa.int64()).to_numpy()
    lists = [[(int(inserted[p]), p) for p in np.flatnonzero(shards == k).tolist()] for k in np.unique(shards)]
    return np.fromiter((p for _, p in heapq.merge(*lists)), np.int64, episodes.num_rows)


def load_episodes(engine: ShardEngine, export: Export, kept: np.ndarray, progress: bool | None,
                  order: np.ndarray) -> None:
    """Stream the kept episodes' rows into an empty ``engine``, oldest first (in ``order``,
    `insertion_order`'s: the files of a Ray store's shards are read side by side).

    Reads row group by row group (about 64 MiB each), skipping files and row groups
    without kept episodes. Episode ids and indices are kept when the kept episodes
    are consecutive (no filter, or only the oldest dropped, of a one-shard store);
    otherwise they are renumbered from 0.

    Raises:
        FormatError: rows that disagree with the episode table.
    """
    episodes = export.episodes.take(pa.array(order[kept[order]]))
    ids = episodes.column("episode_id").to_numpy()
    rank = {int(i): k for k, i in enumerate(ids)}
    num_rows = episodes.column("num_rows").to_numpy()
    has_final = episodes.column("has_final").to_numpy(zero_copy_only=False)
    env_ids = episodes.column("env_id").to_pylist()
    inserted = episodes.column("inserted_at").cast(pa.int64()).to_numpy()
    first_step = (episodes.column("first_step").to_numpy() if "first_step" in episodes.column_names
                  else np.zeros(len(ids), np.int64))   # pieces of episodes (a step writer's), else 0
    metadata = (episodes.column("metadata").to_pylist() if "metadata" in episodes.column_names
                else [None] * len(ids))
    shard = engine.shard
    _resume_numbering(shard, episodes, export.store)
    if "first_step" in export.episodes.column_names:   # its entries were pieces: so are this store's
        shard.table.mark_pieces()
    schema = export.schema
    shards = (episodes.column("shard").to_numpy() if "shard" in episodes.column_names
              else np.zeros(len(ids), np.int64))
    streams = []
    for k in np.unique(shards).tolist():   # each shard's kept episodes, in its files' order
        mine = np.flatnonzero(shards == k)
        # A Ray store numbers episodes across its shards in turn: every shard's id range spans
        # the others' files, which would then be hashed and decoded once per shard.
        files = [e for e in export.files if e["episodes"] and e.get("shard", k) == k and _overlaps(e, ids[mine])]
        streams.append(_stream(export, files, ids[mine], num_rows[mine], rank))
    added = 0
    with progress_bar(progress, int(num_rows.sum()), f"import {export.path.name}") as bar:
        for k, parts in heapq.merge(*streams):
            if k != added:
                raise FormatError(f"{export.path}: rows of episode {int(ids[k])} come before those of episode "
                                  f"{int(ids[added])}, which was stored before it")
            engine.add(_episode(parts, schema, int(num_rows[k]), bool(has_final[k]), env_ids[k], metadata[k],
                                int(inserted[k]), int(first_step[k])), limited=False)
            bar.update(int(num_rows[k]))
            added += 1
    if added != len(ids):
        raise FormatError(f"{export.path}: episode {int(ids[added])} of {EPISODES} has no or only some of its rows "
                          f"in {STEPS}/")


def _stream(export: Export, files: list[Mapping[str, Any]], ids: np.ndarray, num_rows: np.ndarray,
            rank: Mapping[int, int]) -> Iterator[tuple[int, list[dict[str, np.ndarray]]]]:
    """The rows of episodes ``ids`` (in this order) read from ``files``: (rank, parts) per episode.

    Raises:
        FormatError: an episode's rows out of order, more than ``num_rows``, or unreadable.
    """
    specs = {**export.schema.fields, **SYSTEM_SPECS}
    group = group_rows(export.schema.row_bytes)
    mine = {int(i): k for k, i in enumerate(ids)}
    parts: list[dict[str, np.ndarray]] = []
    have = done = 0
    for entry in files:
        file = export.path / entry["path"]
        check_file(file, entry, export.manifest["format_version"] >= 2)
        try:
            reader = pq.ParquetFile(file, page_checksum_verification=True)
            groups = _row_groups(reader, int(ids.min()), int(ids.max()))
            for batch in reader.iter_batches(batch_size=group, row_groups=groups):
                columns = batch_columns(batch, specs, str(file))
                episode_ids = columns["episode_id"]
                cuts = np.flatnonzero(episode_ids[1:] != episode_ids[:-1]) + 1
                for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(episode_ids)]):
                    k = mine.get(int(episode_ids[a]))
                    if k is None:
                        continue
                    if k != done:
                        raise FormatError(f"{file}: rows of episode {int(episode_ids[a])} come before those "
                                          f"of episode {int(ids[done])}, or it has too few rows")
                    parts.append({name: array[a:b] for name, array in columns.items()})
                    have += b - a
                    if have > num_rows[k]:
                        raise FormatError(f"{file}: episode {int(ids[k])} has more than the {int(num_rows[k])} "
                                          "rows the episode table says")
                    if have == num_rows[k]:
                        yield rank[int(ids[k])], parts
                        parts, have, done = [], 0, done + 1
        except (pa.ArrowException, OSError) as err:
            raise FormatError(f"{file}: unreadable ({err}); the file is truncated or corrupted") from None


def _resume_numbering(shard: Shard, episodes: pa.Table, store: Mapping[str, Any]) -> None:
    ids = episodes.column("episode_id").to_numpy()
    if not len(ids) or store.get("num_shards", 1) != shard.table.id_stride:
        return
    first_index = episodes.column("first_index").to_numpy() if "first_index" in episodes.column_names else None
    stride = shard.table.id_stride
    k, rest = divmod(int(ids[0]) - shard.table.id_offset, stride)
    consecutive = bool(np.all(np.diff(ids) == stride))
    if first_index is None or rest or k < 0 or not consecutive:
        return
    lengths = episodes.column("length").to_numpy()
    if np.array_equal(first_index[1:], first_index[:-1] + lengths[:-1]):
        shard.table.resume(k, int(first_index[0]))


def _episode(parts: list[dict[str, np.ndarray]], schema: Schema, num_rows: int, has_final: bool, env_id: str,
             metadata: str | None, inserted_at: int, first_step: int) -> Episode:
    steps = num_rows - int(has_final)
    columns = {}
    for name, spec in schema.fields.items():
        rows = join_rows([p[name] for p in parts])
        columns[name] = rows if spec.observation else rows[:steps]
    return Episode(columns, steps, has_final, env_id, json.loads(metadata) if metadata else None,
                   inserted_at=inserted_at, first_step=first_step)


def _overlaps(entry: Mapping[str, Any], ids: np.ndarray) -> bool:
    first, last = entry["first_episode_id"], entry["last_episode_id"]
    return bool(np.any((ids >= first) & (ids <= last)))


def _row_groups(reader: pq.ParquetFile, low: int, high: int) -> list[int]:
    """Row groups whose episode_id statistics overlap [low, high] (all when unknown)."""
    column = reader.schema_arrow.get_field_index("episode_id")
    groups = []
    for g in range(reader.metadata.num_row_groups):
        stats = reader.metadata.row_group(g).column(column).statistics
        if stats is None or not stats.has_min_max or (stats.max >= low and stats.min <= high):
            groups.append(g)
    return groups


def load_store(cls: type, path: str | Path, capacity: int | None = None,
               episode_filter: EpisodeFilter | None = None, progress: bool | None = None,
               **store_kwargs: Any) -> Any:
    """`ExperienceStore.from_parquet`: a new store holding an export's (selected) episodes."""
    export = open_export(path)
    for name in ("schema", "backend"):
        if name in store_kwargs and not (name == "backend" and store_kwargs[name] == "local"):
            raise ValueError(f"from_parquet takes no {name}={store_kwargs[name]!r}: the schema comes from the "
                             "export and the store is local")
    capacity = int(export.store["capacity"]) if capacity is None else capacity
    mode = store_kwargs.setdefault("mode", export.store.get("mode", "circular"))
    store = cls(capacity, schema=export.schema, **store_kwargs)
    selected = select_episodes(export.episodes, episode_filter)
    order = insertion_order(export.episodes)   # the newest that fit: by when they were stored
    kept = np.empty_like(selected)
    kept[order] = newest_that_fit(export.episodes.column("length").to_numpy()[order], selected[order],
                                  store.capacity, mode)
    load_episodes(store.engine, export, kept, progress, order)
    return store
