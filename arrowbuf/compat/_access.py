"""Index access to a store's transitions and episodes, for the seed's index-based API.

The seed reads by index (``buffer[i]``, samplers that pick positions), which
`ExperienceStore` does not expose publicly: it samples by rank. These adapters
read a store's live ranks per shard and gather given ranks, through the same
internals the store's own `iter_batches` uses (local) and the shard actors'
``gather`` / ``live_range`` calls (Ray). This module is the only place where the
compat layer touches them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf.store import ExperienceStore


class LocalAccess:
    """One in-process store: a single shard, read through the store's public API."""

    def __init__(self, store: ExperienceStore) -> None:
        self.store = store

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of the live transition ranks of each shard."""
        return self.store.live_ranges()

    def episodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first rank, transitions) of every live episode, oldest first."""
        return self.store.episode_spans()

    def pin(self, env_id: str, shard: int) -> None:
        """One shard only: nothing to pin."""

    def gather(self, shard: int, ranks: np.ndarray, device: Any) -> TensorDict:
        """The transitions of live ``ranks`` (1-D), in that order."""
        return self.store.gather(ranks, device=device)


class RayAccess:
    """A Ray store: its shard actors, in shard order."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def pin(self, env_id: str, shard: int) -> None:
        """Send env ``env_id``'s episodes to ``shard`` (node affinity): a route set before its first write."""
        self.store._sink._routes.setdefault(env_id, shard)

    def live_ranges(self) -> list[tuple[int, int]]:
        self.store.flush()
        ranges = self.store._shards.broadcast("live_range")
        return [tuple(ranges.get(s, (0, 0))) for s in range(self.store.num_shards)]

    def episodes(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        table = self.store.episodes()
        if not table.num_rows:
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        shard = table.column("shard").to_numpy().astype(np.int64)
        first = table.column("first_index").to_numpy().astype(np.int64)
        length = table.column("length").to_numpy().astype(np.int64)
        order = np.argsort(shard, kind="stable")   # shard by shard, oldest first within each
        return shard[order], first[order], length[order]

    def gather(self, shard: int, ranks: np.ndarray, device: Any) -> TensorDict:
        shards = self.store._shards
        payload = shards.get({shard: shards.call(shard, "gather", ranks)}).get(shard)
        if payload is None or payload.batch_shape[0] != len(ranks):
            raise RuntimeError(f"shard {shard} of store {self.store.name!r} no longer holds some of the "
                               f"{len(ranks)} transitions requested (written to from elsewhere?)")
        # Views of Ray's read-only shared memory: copied, so trainers may write in place.
        return payload.to_tensordict(torch.device(device) if device is not None else None).clone()
