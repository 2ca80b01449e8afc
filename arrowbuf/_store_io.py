"""Persistence of `ExperienceStore`: Parquet export and import, checkpoints, Ray Data.

`StoreIO` holds these methods of the store (the facade in `arrowbuf.store` is its
only subclass); the work is done by `arrowbuf.parquet`, `arrowbuf.parquet_load`,
`arrowbuf.checkpoint` and `arrowbuf.ray.persist`, on the store's backend.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from arrowbuf._checks import check_int, check_name, check_storage_device
from arrowbuf.local import LocalBackend
from arrowbuf.ray.options import RayOptions, as_ray_options


#: `StoreIO.load`'s default: columns go back to the saved store's ``storage_device``.
AS_SAVED = "as saved"


class StoreIO:
    """The persistence methods of `arrowbuf.ExperienceStore`."""

    def to_parquet(self, path: str | Path, compression: str = "zstd", rows_per_file: int | None = None,
                   progress: bool | None = None, *, overwrite: bool = False) -> Path:
        """Export the live episodes as a Parquet directory any dataframe tool reads.

        ``steps/part-<shard>-<n>.parquet`` hold the rows (oldest episode first,
        whole episodes per file, at most ``rows_per_file`` rows unless one episode
        is longer), ``episodes.parquet`` the episode table, ``_arrowbuf.json`` the
        manifest. The store's lock is held only while the snapshot is taken.
        `arrowbuf.read_parquet` opens the rows as a dataset. Details: `arrowbuf.parquet`.

        Args:
            path: the directory to create (written beside it, then renamed).
            compression: Parquet codec ("zstd", "snappy", "lz4", "none", ...).
            rows_per_file: rows per step file; None for one file.
            progress: a tqdm bar; None shows it when stderr is a terminal.
            overwrite: replace an existing ``path``.

        Returns:
            ``path``.

        Raises:
            ValueError: the store has no schema yet, or a bad argument.
            FileExistsError: ``path`` exists, is not empty, and ``overwrite`` is False.
        """
        from arrowbuf.parquet import export_store

        return export_store(self, self._backend.export_steps, path, compression=compression,
                            rows_per_file=rows_per_file, progress=progress, overwrite=overwrite)

    @classmethod
    def from_parquet(cls, path: str | Path, capacity: int | None = None, episode_filter: Any = None,
                     progress: bool | None = None, **store_kwargs: Any) -> Any:
        """A new store holding the episodes of a `to_parquet` export (offline RL).

        Rows are streamed row group by row group, so an export larger than memory
        loads into a smaller ``capacity``: the newest episodes that fit are kept,
        as FIFO eviction would. Episodes keep their final observations, so samples
        hold the same transitions and ``next`` observations as the original; ids
        and indices are kept unless a filter leaves gaps (then they count from 0).

        Args:
            path: the export directory.
            capacity: rows of the new store; None for the exported store's capacity.
            episode_filter: which episodes to load: a `pyarrow.compute.Expression`
                over the episode table (``pc.field("return") > 100``), or a callable
                taking the episode table (a pyarrow.Table) and returning a boolean
                mask over its rows or a list of episode ids.
            progress: a tqdm bar; None shows it when stderr is a terminal.
            **store_kwargs: seed, sampler, rate_limiter, mode (default: the
                exported mode) of the new store.

        Raises:
            FormatError: a missing, incomplete or corrupted export, a file of
                another schema, or a newer format; the message names the file.
            CapacityError: a selected episode is longer than ``capacity``, or a
                ``mode="fixed"`` store cannot hold them all.
        """
        from arrowbuf.parquet_load import load_store

        return load_store(cls, path, capacity, episode_filter, progress, **store_kwargs)

    def save(self, path: str | Path, progress: bool | None = None) -> Path:
        """Checkpoint the store into directory ``path`` (Arrow IPC files and a JSON manifest).

        Saves the live episodes, the episode table, the sampler's and rate
        limiter's state, the generator's state and the open episodes of this
        store's writers. Saving again into the same directory writes only the
        episodes added since and drops files whose episodes were all evicted.
        The lock is held only while the snapshot is taken. Details:
        `arrowbuf.checkpoint`.

        Returns:
            ``path``.

        Raises:
            FileExistsError: ``path`` is a file or holds a foreign manifest.json.
        """
        info = {"capacity": self.capacity, "mode": self.mode, "seed": self.seed, "track_reuse": self.track_reuse,
                "created_at": self.created_at}
        if self.storage_device is not None:   # rows are saved from host copies; the device is restored
            info["storage_device"] = str(self.storage_device)
        if self.backend == "ray":
            from arrowbuf.ray.persist import save_ray_store

            return save_ray_store(self._backend, Path(path), info)
        from arrowbuf.checkpoint import save_engine

        return save_engine(self.engine, path, info,
                           lambda: {name: w.state_dict() for name, w in self._writers.live().items()}, progress)

    @classmethod
    def load(cls, path: str | Path, progress: bool | None = None, *, num_shards: int | None = None,
             name: str | None = None, ray_options: RayOptions | None = None,
             storage_device: Any = AS_SAVED) -> Any:
        """The store saved in ``path``; it samples exactly as the saved one would have.

        Restored writers are in `writers`; ``store.writer(..., name=name)`` claims one.
        A local store's columns go back where they were (``storage_device`` of the
        saved store), or to the ``storage_device`` given (None: numpy, host memory).
        A Ray store's checkpoint loads as a Ray store (its writers' open episodes are
        not saved); ``num_shards`` spreads it over another number of shards, and
        ``name`` / ``ray_options`` are those of the new store.

        Raises:
            FormatError: a missing or incomplete checkpoint, a truncated file, or a
                newer format version; the message names the file.
            ValueError: Ray arguments for a local checkpoint.
        """
        from arrowbuf.checkpoint import load_engine
        from arrowbuf.ray.persist import is_ray_checkpoint

        if is_ray_checkpoint(path):
            from arrowbuf.ray.router import RayBackend

            if storage_device != AS_SAVED:
                check_storage_device(storage_device, "ray")

            if num_shards is not None:
                check_int("num_shards", num_shards, 1)
            backend, config = RayBackend.load(Path(path), num_shards, check_name(name), as_ray_options(ray_options))
            return cls._of_backend(backend, config["capacity"], config["seed"], config["sampler"], config["mode"],
                                   config["rate_limiter"], config["track_reuse"], time.time())
        if (num_shards, name, ray_options) != (None, None, None):
            raise ValueError(f"num_shards, name and ray_options apply to Ray checkpoints only; {path} is a local one")
        if storage_device != AS_SAVED:
            storage_device = check_storage_device(storage_device, "local")
        loaded = load_engine(path, progress, storage_device=storage_device)
        engine = loaded.engine
        store = cls._of_backend(LocalBackend(engine), engine.capacity, engine.seed, engine.sampler, engine.mode,
                                engine.rate_limiter, engine.track_reuse, float(loaded.info["created_at"]))
        with loaded.typed_errors():
            store._restore_writers(loaded.writers)
        return store

    # -- Ray Data -------------------------------------------------------------------------

    def to_ray_dataset(self) -> Any:
        """The stored rows as a `ray.data.Dataset`, built where the shards live
        (``ds.write_parquet(...)`` then exports from all nodes at once); see
        `arrowbuf.ray.persist` for the row layout.

        Raises:
            ValueError: a local store (export it with `to_parquet`, or use ``backend="ray"``).
        """
        if self.backend != "ray":
            raise ValueError("to_ray_dataset needs backend='ray'; a local store exports with to_parquet(), "
                             "which ray.data.read_parquet() reads")
        from arrowbuf.ray.persist import to_ray_dataset

        self.flush()
        return to_ray_dataset(self._backend)

    @classmethod
    def from_ray_dataset(cls, dataset: Any, capacity: int, **store_kwargs: Any) -> Any:
        """A new store (local unless ``backend="ray"``) holding the episodes of a
        `ray.data.Dataset` made by `to_ray_dataset` (or any dataset in that row
        layout; see `arrowbuf.ray.persist`). ``store_kwargs`` are the store's arguments.

        Raises:
            FormatError: the dataset is not in that layout, or ends inside an episode.
        """
        from arrowbuf.ray.persist import episodes_of_dataset

        schema, episodes = episodes_of_dataset(dataset)
        store = cls(capacity, schema=schema, **store_kwargs)
        store._backend.import_episodes(episodes)
        return store
