"""Durable shards: an append-only log of an engine's episodes, replayed after a crash.

A durable shard writes every episode it stores to an on-disk log, and flushes the
log to disk (``fdatasync``) before the write is acknowledged. After a crash its
engine is rebuilt from the last checkpoint plus the log, so every acknowledged
episode is back, exactly once. Nothing here knows about Ray: a Ray shard actor
composes a `DurableShard` with its engine (see ``ShardServer``).

Layout of a durable directory::

    shard-dir/                     0700, files 0600: the owner's only
      lock                         flock'd by the one process writing here; names it (`arrowbuf._dirlock`)
      log-head                     oldest and newest segment, the newest one's acknowledged end
      log-<segment:08d>.arrowlog   segments of the episode log (`arrowbuf.episode_log`)
      checkpoint/                  the last checkpoint (`arrowbuf.checkpoint`); saves compact the log

Example:
    >>> import numpy as np, tempfile, arrowbuf as ab
    >>> from arrowbuf.durable import DurableShard
    >>> from arrowbuf.engine import ShardEngine
    >>> from arrowbuf.episode_read import read_episode
    >>> make = lambda: ShardEngine(100, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0)
    >>> durable = DurableShard(tempfile.mkdtemp())
    >>> engine = durable.recover(make)
    >>> episode, schema = read_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3),
    ...                                 "terminated": np.arange(3) == 2}, None)
    >>> durable.commit(engine, [(engine.add(episode, schema), episode)])
    >>> durable.close()
    >>> with DurableShard(durable.directory) as restarted:   # after a crash: from the log
    ...     restarted.recover(make).num_episodes
    1
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from arrowbuf._dirlock import FILE_MODE, private_tree
from arrowbuf._filesink import fsync
from arrowbuf._log_records import Batch
from arrowbuf._persist import CHECKPOINT_MANIFEST
from arrowbuf.engine import ShardEngine
from arrowbuf.episode_log import EpisodeLog, next_episode_id
from arrowbuf.errors import FormatError, ShardError
from arrowbuf.shard import Episode

SHARE = "share"   # a shard's share of its store's capacity, as last moved (`DurableShard.remember_share`)

logger = logging.getLogger("arrowbuf")


def durable_directory(durable: Any, name: str) -> Path | None:
    """Where a store's durable shards keep ``shard-<k>``: the directory ``durable``, or
    ``~/.cache/arrowbuf/<name>`` for True; None for False (or None).

    Raises:
        ValueError: anything but a bool or a path, or (for True) a name that is not
            one plain directory name (it would put the data outside ``~/.cache/arrowbuf``).
    """
    if durable is False or durable is None:
        return None
    if durable is True:
        check_directory_name(name)
        return Path.home() / ".cache" / "arrowbuf" / name
    if isinstance(durable, (str, os.PathLike)) and str(durable):
        return Path(durable).expanduser()
    raise ValueError(f"durable must be True, False or a directory path, got {durable!r}")



def check_directory_name(name: str) -> str:
    """``name`` as one directory name inside its parent: no separator, not ``.``/``..``, no NUL.

    Raises:
        ValueError: a name that could leave its directory (``../x``, ``/abs``, ``a/b``).
    """
    separators = {"/", os.sep, os.altsep} - {None}
    if not isinstance(name, str) or not name or name in (".", "..") or "\0" in name \
            or any(s in name for s in separators):
        raise ValueError(f"name {name!r} cannot name a durable directory: with durable=True the store keeps its data "
                         "in ~/.cache/arrowbuf/<name>, so the name must be one plain directory name (no '/', not "
                         "'.' or '..'); pass durable='some/dir' to choose another place")
    return name


class DurableShard:
    """An engine's log and checkpoint in one directory: what a durable shard adds to its engine.

    The owner calls `recover` once to get its engine, `seen` before a write,
    `commit` after storing a write's episodes (before answering), `cleared` after
    `ShardEngine.clear`, and `checkpoint` to save and compact. Writes must be
    serialized with their `commit` (a Ray actor runs one call at a time).

    Args:
        directory: the shard's durable directory.
        shard, num_shards: the engine's place in its store (for checkpoint loads).
        sync, lock_wait, holder: see `EpisodeLog`.

    Raises:
        InUseError: another process has the directory open (its lock).
        FormatError: a damaged log (see `EpisodeLog`).
    """

    def __init__(self, directory: str | os.PathLike, shard: int = 0, num_shards: int = 1, sync: bool = True,
                 lock_wait: float = 0.0, holder: str | None = None) -> None:
        self.log = EpisodeLog(directory, sync=sync, lock_wait=lock_wait, holder=holder)
        self.directory = self.log.directory
        self.shard = shard
        self.num_shards = num_shards
        self._failed: str | None = None   # why the log stopped taking writes

    @property
    def checkpoint_path(self) -> Path:
        return self.directory / "checkpoint"

    def recover(self, make_engine: Callable[[], ShardEngine], pieces: Any = None,
                restarted: bool = False) -> ShardEngine:
        """The engine of the last checkpoint here (else ``make_engine()``) with the log replayed into it.

        Args:
            pieces: the shard's `arrowbuf.ray.tails.OpenPieces`, restored as they were: from the
                checkpoint's info (``restore``), then the replayed pieces' (`EpisodeLog.replay`).
            restarted: the shard's actor was restarted (Ray reconstructed it): it takes the share
                of its store's capacity it had (`remember_share`) before the log is replayed, so
                a replay keeps what the shard held.

        Raises:
            FormatError: a damaged checkpoint, log or share file.
        """
        from arrowbuf.checkpoint import load_engine

        if (self.checkpoint_path / CHECKPOINT_MANIFEST).exists():
            loaded = load_engine(self.checkpoint_path, progress=False, shard=self.shard,
                                 num_shards=self.num_shards, whole_pieces=True)   # a Ray shard's
            engine = loaded.engine
            if pieces is not None:
                pieces.restore(loaded.info, engine.table, str(loaded.manifest))
        else:
            engine = make_engine()
        if not restarted:   # a new store's shares start where its router starts them, not at an earlier run's
            (self.directory / SHARE).unlink(missing_ok=True)
        share = self.saved_share() if restarted else None
        if share is not None and share != engine.capacity:
            try:
                engine.set_capacity(share)
            except ValueError as err:
                raise FormatError(f"{self.directory / SHARE}: {err}") from None
        replayed = self.log.replay(engine, pieces)
        if replayed:
            logger.info("%s: %d logged episodes replayed after the last checkpoint", self.directory, replayed)
        return engine

    def remember_share(self, capacity: int) -> None:
        """Keep this shard's share of its store's capacity (`arrowbuf.ray.shares`) on disk, so that a
        restarted shard starts from it (`recover`), not from the even split it was made with."""
        path = self.directory / SHARE
        staged = path.with_name(SHARE + ".new")
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "w") as file:
            file.write(json.dumps({"capacity": int(capacity)}))
            file.flush()
            os.fsync(file.fileno())
        os.replace(staged, path)
        fsync(self.directory)

    def saved_share(self) -> int | None:
        """The share `remember_share` kept (None: never moved).

        Raises:
            FormatError: a damaged share file, naming it.
        """
        path = self.directory / SHARE
        if not path.exists():
            return None
        try:
            value = json.loads(path.read_text())["capacity"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise FormatError(f"{path}: unreadable share of the store's capacity ({type(err).__name__}: {err})") from None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise FormatError(f"{path}: capacity {value!r}; expected this shard's share of its store's capacity, "
                              "an int >= 0")
        return value

    def seen(self, batch: Batch | None) -> bool:
        """Whether a write with this (writer id, batch number) is logged already (a retry)."""
        return batch is not None and self.log.seen(batch)

    def logged_ids(self, batch: Batch) -> list[int] | None:
        """The ids a `seen` batch was stored under (None: too old to be kept)."""
        return self.log.logged_ids(batch)

    def commit(self, engine: ShardEngine, added: Sequence[tuple[int, Episode]], batch: Batch | None = None,
               owner: str | None = None, closes: Sequence[str] | None = None) -> None:
        """Log episodes just stored in ``engine``, flushed to disk before it returns.

        Args:
            engine: the engine that stored them.
            added: (id `ShardEngine.add` returned, episode), in the order stored.
            batch: the write's (writer id, batch number), for `seen`.
            owner, closes: whose open pieces they are, and the envs whose open episodes ended
                with this write (`arrowbuf.ray.tails`): logged, so a restart links them again.

        Raises:
            ShardError: the log could not be written (now or at an earlier commit:
                the engine holds episodes the log lacks, so later writes would be
                lost at a restart; the shard refuses them until it restarts).
        """
        if self._failed is not None:
            raise ShardError(self._failed)
        if not added and not closes:
            return
        table = engine.table
        entries = []
        for episode_id, episode in added:
            position = table.position_of(episode_id)
            live = 0 <= position < len(table) and table.col("episode_id")[position] == episode_id
            # The time the table recorded, so a replay restores the same episode table.
            inserted = int(table.col("inserted_at")[position]) if live else int(episode.inserted_at or 0)
            entries.append((episode_id, episode, inserted))
        try:
            self.log.append(entries, engine.schema, batch, owner,
                            (list(closes), next_episode_id(engine)) if closes else None)
        except BaseException as err:   # not only OSError: a MemoryError building the record leaves the same gap
            self._failed = (f"the durable log {self.directory} could not be written ({type(err).__name__}: {err}); "
                            "this shard refuses writes until it restarts (it then recovers every acknowledged write)")
            if isinstance(err, Exception):
                raise ShardError(self._failed) from None
            raise

    def failed(self, reason: str) -> None:
        """Refuse every later write (`commit` raises `ShardError` saying ``reason``)."""
        self._failed = f"the durable log {self.directory} takes no more writes: {reason}"

    def cleared(self, engine: ShardEngine) -> None:
        """Log a `ShardEngine.clear` (call right after it)."""
        self.log.append_clear(next_episode_id(engine))

    def checkpoint(self, engine: ShardEngine, info: Mapping[str, Any]) -> Path:
        """Save the engine into ``<directory>/checkpoint`` (incrementally) and compact the log.

        Args:
            engine: the shard's engine.
            info: the store settings `arrowbuf.checkpoint.save_engine` records.
        """
        from arrowbuf.checkpoint import save_engine

        with engine.lock:
            upto = next_episode_id(engine)   # every episode below it is in the save that follows
        save_engine(engine, self.checkpoint_path, info, progress=False)
        private_tree(self.checkpoint_path)   # owner-only, as the log
        self.log.compact(upto)
        return self.checkpoint_path

    def close(self) -> None:
        self.log.close()

    def __enter__(self) -> "DurableShard":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
