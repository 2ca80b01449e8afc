"""Index access to a store's transitions and episodes, for the seed's index-based API.

The seed reads by index (``buffer[i]``, samplers that pick positions). The store
offers that publicly on both backends: `ExperienceStore.live_ranges`,
`ExperienceStore.episode_spans` and `ExperienceStore.gather`, all in indices (the
values of a batch's ``"index"``; on Ray ``shard << 48 | index``). This adapter
gives the compat layer its per-shard view of them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from tensordict import TensorDict

from arrowbuf.ray.options import ray_module
from arrowbuf.store import ExperienceStore


class StoreAccess:
    """A store's live indices per shard, its episodes' spans, and reads by index."""

    def __init__(self, store: ExperienceStore) -> None:
        self.store = store

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of the live indices of each shard, in shard order."""
        self.store.flush()
        return self.store.live_ranges()

    def episodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        self.store.flush()
        return self.store.episode_spans()

    def pin(self, env_id: str, shard: int) -> None:
        """Send env ``env_id``'s episodes to ``shard`` (node affinity), if it has no route yet."""
        self.store.pin_env(env_id, shard)

    def gather(self, shard: int, index: np.ndarray, device: Any) -> TensorDict:
        """The transitions of live ``index`` (1-D, of ``shard``), in that order, writable.

        Raises:
            KeyError: some are no longer live (written to from elsewhere?).
        """
        return self.store.gather(index, device=device)

    def gather_refs(self, indices: list[np.ndarray], extras: list[dict]) -> list:
        """Ray: ObjectRefs of the batches of ``indices`` (each 1-D or [n, T]) with ``extras``,
        seed keys (``next_<name>``), left in the object store (`ExperienceStore.gather_refs`)."""
        return self.store.gather_refs(indices, extras=extras, next_keys="flat") if indices else []

    @staticmethod
    def put(batch: TensorDict) -> Any:
        """Ray: an ObjectRef of ``batch`` (an empty batch, where no shard has rows to put)."""
        return ray_module().put(batch)


# The compat layer names one per backend; the store's public reads serve both.
LocalAccess = RayAccess = StoreAccess
