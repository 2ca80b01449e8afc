"""Writing to `ExperienceStore`: whole episodes, named step writers, flush and clear.

`StoreWriting` holds these methods of the store (the facade in `arrowbuf.store`
is its only subclass): they check their arguments, read episodes against the
schema, keep the store's named writers, and hand the writes to its backend.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from arrowbuf._checks import check_env_id, check_int, check_metadata, check_name, check_timeout
from arrowbuf.episodes import StepWriter, read_episode


class StoreWriting:
    """The writing methods of `arrowbuf.ExperienceStore`."""

    def add_episode(self, episode: Any, env_id: str = "default",
                    metadata: Mapping[str, Any] | None = None, *, timeout: float | None = None) -> int:
        """Add one whole episode.

        Args:
            episode: a dict (nested dicts allowed) of numpy arrays / torch tensors, a
                TensorDict, or a pyarrow RecordBatch. Step fields have T rows;
                observation fields T+1 rows (with the final observation) or T.
            env_id: the environment it came from, kept in the episode table.
            metadata: JSON-serializable user metadata kept in the episode table.
            timeout: seconds to wait for the rate limiter to allow the insert
                (other threads sampling); None raises at once.

        Returns:
            The new episode's id. On Ray the shard assigns it, so the call sends the
            episode and waits for that shard's answer (a round trip, errors raised
            here); writers are the asynchronous, batched path.

        Raises:
            SchemaError: a wrong field name, dtype, shape or ragged lengths.
            CapacityError: longer than the capacity, or a full ``mode="fixed"`` store.
            RateLimited: the rate limiter refuses the insert (after ``timeout``).
            ValueError: a bad ``env_id`` or ``metadata``.
            Nothing is changed when it raises.
        """
        timeout = check_timeout(timeout)
        check_env_id(env_id)
        metadata = check_metadata(metadata)
        checked, schema = read_episode(episode, self.schema, env_id, metadata)
        return self._backend.add(checked, schema, timeout)

    def writer(self, num_envs: int, autoreset_mode: str = "next_step",
               env_ids: Sequence[str] | None = None, *, timeout: float | None = None,
               name: str | None = None) -> StepWriter:
        """A step writer for ``num_envs`` vectorized environments (see `StepWriter`).

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
            ValueError: a bad argument; a writer of this name is already open; a
                restored writer of this name has another num_envs, mode or env_ids.
        """
        name = check_name(name)
        timeout = check_timeout(timeout)
        num_envs = check_int("num_envs", num_envs, 1)
        claimed = self._writers.claim(name, num_envs, autoreset_mode, env_ids) if name else None
        if claimed is not None:
            writer, sink = claimed
            sink.timeout = timeout
            return writer
        sink = self._backend.sink(timeout, env_ids)
        writer = StepWriter(sink, num_envs, autoreset_mode, env_ids)
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
        if isinstance(shard, bool) or not isinstance(shard, (int, np.integer)) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be an int in [0, {self.num_shards}), got {shard!r}")
        self._backend.pin(env_id, int(shard))

    @property
    def writers(self) -> dict[str, StepWriter]:
        """Writers by name: those still referenced, and after `load` the restored
        ones (held by the store until claimed with ``writer(..., name=name)``)."""
        return self._writers.live()

    def _restore_writers(self, states: Mapping[str, Any]) -> None:
        """Writers of a loaded checkpoint, held until claimed by name."""
        for name, state in states.items():
            writer = self.writer(int(state["num_envs"]), state["autoreset_mode"], state["env_ids"], name=name)
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
