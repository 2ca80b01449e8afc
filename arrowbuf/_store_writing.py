"""Writing to `ExperienceStore`: whole episodes, named step writers, flush and clear.

`StoreWriting` holds these methods of the store (the facade in `arrowbuf.store`
is its only subclass): they check their arguments, read episodes against the
schema, keep the store's named writers, and hand the writes to its backend.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from arrowbuf._checks import check_env_id, check_int, check_metadata, check_name, check_shard, check_timeout
from arrowbuf.autoreset import writer_settings
from arrowbuf.episode_batch import read_episodes
from arrowbuf.episode_read import read_episode
from arrowbuf.episodes import StepWriter
from arrowbuf.errors import CapacityError


class StoreWriting:
    """The writing methods of `arrowbuf.ExperienceStore`."""

    def add_episode(self, episode: Any, env_id: str = "default",
                    metadata: Mapping[str, Any] | None = None, *, timeout: float | None = None,
                    shard: int | None = None) -> int:
        """Add one whole episode.

        Args:
            episode: a dict (nested dicts allowed) of numpy arrays / torch tensors, a
                TensorDict, or a pyarrow RecordBatch. Step fields have T rows;
                observation fields T+1 rows (with the final observation) or T.
            env_id: the environment it came from, kept in the episode table.
            metadata: JSON-serializable user metadata kept in the episode table.
            timeout: seconds to wait for the rate limiter to allow the insert
                (other threads sampling); None raises at once.
            shard: store it on this shard (Ray: e.g. the shard on the node that
                will train on it), whatever its env's route; None routes by env id.
                A local store has one shard: only 0 or None.

        Returns:
            The new episode's id. On Ray the shard assigns it, so the call sends the
            episode and waits for that shard's answer (a round trip, errors raised
            here); writers are the asynchronous, batched path.

        Raises:
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses the insert (after ``timeout``).
            ValueError: a bad ``env_id``, ``metadata`` or ``shard``.
            Nothing is changed when it raises.
        """
        timeout = check_timeout(timeout)
        check_env_id(env_id)
        metadata = check_metadata(metadata)
        shard = check_shard(shard, self.num_shards)
        checked, schema = read_episode(episode, self.schema, env_id, metadata,
                                       keep_tensors=self.storage_device is not None)
        if shard is None:
            return self._backend.add(checked, schema, timeout)
        return self._backend.add_many([checked], schema, timeout, shard)[0]

    def add_episodes(self, episodes: Any, *, lengths: Any = None, env_ids: Any = None, metadata: Any = None,
                     timeout: float | None = None, shard: int | None = None) -> list[int]:
        """Add E episodes given together: arrays shaped [E, T, ...] (a rollout of E envs).

        One check of the batch against the schema, then the episodes go in as views
        of its arrays (on Ray: one request per shard for all of its episodes), much
        cheaper than E `add_episode` calls.

        Args:
            episodes: a dict (nested dicts allowed) or TensorDict: step fields
                [E, T, ...]; observation fields [E, T + 1, ...] (with the final
                observations) or [E, T, ...]. ``terminated`` / ``truncated`` are
                step fields [E, T] like any other.
            lengths: None (every episode has T steps), or E ints in [1, T] for a
                padded batch: episode e is its first ``lengths[e]`` steps (its final
                observation at row ``lengths[e]``; its flags at step ``lengths[e] - 1``).
            env_ids: None (``"default"``), one env id for all, or one per episode.
            metadata: None, or one JSON-serializable mapping (or None) per episode.
            timeout: seconds to wait for the rate limiter, per episode.
            shard: store all of them on this shard (see `add_episode`).

        Returns:
            The E new episode ids, in order.

        Raises:
            SchemaError: a wrong field name, dtype or shape, or ragged leading dims.
            CapacityError: an episode longer than a shard's capacity (before any is
                stored); a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses an insert (after ``timeout``).
            ValueError: a bad ``lengths``, ``env_ids``, ``metadata`` or ``shard``.
            Nothing is stored when the batch is refused by a check; when a full
            fixed-mode store or the rate limiter refuses some episodes, the others are
            stored and the error says how many were refused.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(capacity=1_000)
            >>> E, T = 4, 5
            >>> ids = store.add_episodes({"obs": np.zeros((E, T + 1, 3), np.float32),
            ...                           "action": np.zeros((E, T), np.int64), "reward": np.ones((E, T)),
            ...                           "terminated": np.zeros((E, T), bool), "truncated": np.ones((E, T), bool)},
            ...                          lengths=[5, 3, 5, 1], env_ids=[f"env-{e}" for e in range(E)])
            >>> ids, len(store)
            ([0, 1, 2, 3], 14)
        """
        timeout = check_timeout(timeout)
        shard = check_shard(shard, self.num_shards)
        checked, schema = read_episodes(episodes, self.schema, lengths, env_ids, metadata,
                                        keep_tensors=self.storage_device is not None)
        longest = max(e.num_rows for e in checked)
        if longest > self.capacity // self.num_shards:
            raise CapacityError(f"an episode of {longest} rows is longer than a shard's capacity of "
                                f"{self.capacity // self.num_shards} rows; nothing was stored")
        return self._backend.add_many(checked, schema, timeout, shard)

    def writer(self, num_envs: int | None = None, autoreset_mode: Any = None,
               env_ids: Sequence[str] | None = None, *, env: Any = None, timeout: float | None = None,
               name: str | None = None) -> StepWriter:
        """A step writer for ``num_envs`` vectorized environments (see `StepWriter`).

        The autoreset mode (`arrowbuf.autoreset`) comes from ``autoreset_mode``
        (``"next_step"``, ``"same_step"``, ``"disabled"`` or a gymnasium
        ``AutoresetMode``), or from ``env``, a gymnasium vector env, whose
        ``metadata["autoreset_mode"]`` it reads (and its ``num_envs``). Given
        neither, the writer assumes gymnasium's default, ``"next_step"``, and checks
        it as steps arrive: it keeps a step after an episode's end whose ``obs`` is
        not that env's last ``next_obs`` (you reset the env), and raises
        `AutoresetModeError` (naming the modes) for one that carries a reward or a
        done flag, so no step is dropped silently.

        ``timeout`` is how long a sealed episode waits for the rate limiter.
        ``name`` identifies the writer in checkpoints (default ``writer-<k>``):
        `save` stores the open episodes of every writer still referenced, and on a
        loaded store ``writer(..., name=name)`` hands back the restored writer with
        those episodes (see `writers`). ``with store.writer(...) as w:`` closes it.
        A Ray store's writer pickles into Ray tasks and actors (env runners); it
        sends finished episodes within ``RayOptions.delivery_latency`` without
        `flush`, and raises a shard's error (or death, naming the episodes lost)
        at its next call.

        Raises:
            ValueError: a bad argument (an ``env`` whose num_envs or mode contradicts
                the others given); a writer of this name is already open; a
                restored writer of this name has another num_envs, mode or env_ids.
        """
        name = check_name(name)
        timeout = check_timeout(timeout)
        num_envs, autoreset_mode, check_resets = writer_settings(num_envs, autoreset_mode, env)
        num_envs = check_int("num_envs", num_envs, 1)
        claimed = self._writers.claim(name, num_envs, autoreset_mode, env_ids) if name else None
        if claimed is not None:
            writer, sink = claimed
            sink.timeout = timeout
            return writer
        sink = self._backend.sink(timeout, env_ids)
        writer = StepWriter(sink, num_envs, autoreset_mode, env_ids, device=self.storage_device,
                            check_resets=check_resets)
        self._writers.add(name or self._writers.new_name(), writer, sink)
        return writer

    def pin_env(self, env_id: str, shard: int) -> None:
        """Send the `add_episode` episodes of ``env_id`` to ``shard`` (e.g. the shard on
        the node where that env runs), unless the env was already routed; on a local
        store (one shard) it changes nothing.

        Raises:
            ValueError: a bad ``env_id``, or ``shard`` not in [0, num_shards).
        """
        check_env_id(env_id)
        shard = check_shard(shard, self.num_shards)
        if shard is None:
            raise ValueError(f"shard must be an int in [0, {self.num_shards}), got None")
        self._backend.pin(env_id, shard)

    @property
    def writers(self) -> dict[str, StepWriter]:
        """Writers by name: those still referenced, and after `load` the restored
        ones (held by the store until claimed with ``writer(..., name=name)``)."""
        return self._writers.live()

    def _restore_writers(self, states: Mapping[str, Any]) -> None:
        """Writers of a loaded checkpoint, held until claimed by name."""
        for name, state in states.items():
            mode = None if state.get("check_resets") else state["autoreset_mode"]   # older states lack it
            writer = self.writer(int(state["num_envs"]), mode, state["env_ids"], name=name)
            writer.load_state_dict(state)
            self._writers.hold(name)

    def flush(self) -> None:
        """Wait until every write so far is stored, and raise the first error.

        A local store writes synchronously: nothing to wait for. A Ray store sends
        what this process's writers have queued (their open episodes stay open:
        `StepWriter.flush` cuts them) and waits for the shards' answers; ``len``
        right after it is exact.
        """
        self._flush_writers()
        self._backend.flush()

    def _flush_writers(self) -> None:
        """Send what this process's writers queued and wait for it (no-op locally)."""
        for sink in self._writers.sinks():
            sink.flush()

    def clear(self) -> None:
        """Remove every episode. Indices sampled before stay stale forever. Episodes
        this process's writers had sealed are stored first (and removed)."""
        self._flush_writers()
        self._backend.clear()
