"""`OpenPieces`: a shard's pieces of episodes that are still open (a Ray writer's shipped steps).

A Ray writer ships the completed steps of each open episode as a piece on its
delivery timer (`arrowbuf.open_pieces`). Its shard stores a piece as it stores
any episode (a row of the episode table with its ``first_step``; sealed into a
block, so readers see its steps within ``seal_latency``), and notes here which
stored pieces belong to an episode that goes on, by (owner, env): the owner is
the id of the writer that shipped them, or of the writer whose state a restored
writer continues (`RaySink.load_open_state`); the episode's last piece
(``open=False``) or a close (`RaySink.close_open`) ends them.

They count as transitions (``len(store)``) but not as episodes: ``num_episodes``
and ``episodes()`` leave them out, ``episodes(include_open=True)`` lists them with
``open=True``, as a local store lists its writers' open tails. Eviction drops them
as any piece (first in, first out). A shard's checkpoint keeps which are open
(`state`, `load`); a durable shard restarted from its log forgets it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from arrowbuf._checks import is_int
from arrowbuf.errors import FormatError, describe
from arrowbuf.shard import Episode
from arrowbuf.table import EpisodeTable

Key = tuple[str | None, str]   # (owner: writer id, env id)
OPEN_PIECES = "open_pieces"    # the key of `OpenPieces.state` in a shard checkpoint's info


class OpenPieces:
    """Serials (0, 1, ... per shard, as `EpisodeTable.episodes_added` counts) of the
    stored pieces of open episodes, by (owner, env)."""

    def __init__(self) -> None:
        self.serials: dict[Key, list[int]] = {}

    def stored(self, writer: str | None, episode: Episode, serial: int) -> None:
        """``episode`` was stored as entry ``serial``: an open piece is noted, a last piece
        ends its episode's."""
        key = (writer, episode.env_id)
        if episode.open:
            self.serials.setdefault(key, []).append(serial)
        else:
            self.serials.pop(key, None)

    def close(self, writer: str | None, env_ids: list[str]) -> None:
        """The episodes of ``env_ids`` ended with their last stored piece."""
        for env_id in env_ids:
            self.serials.pop((writer, env_id), None)

    def clear(self) -> None:
        self.serials.clear()

    def state(self, table: EpisodeTable) -> list[list[Any]]:
        """The live open pieces as JSON: [owner, env id, serials] per open episode."""
        self.live(table)
        return [[owner, env, list(serials)] for (owner, env), serials in self.serials.items()]

    def load(self, state: Any, table: EpisodeTable, where: str) -> None:
        """Restore a `state` taken with ``table`` (a checkpoint's, named ``where``).

        Raises:
            FormatError: not [owner, env id, serials] entries naming live entries of ``table``.
        """
        head, added = table.episodes_added - len(table), table.episodes_added
        entries = state if isinstance(state, list) else [None]
        for entry in entries:
            ok = (isinstance(entry, list) and len(entry) == 3 and (entry[0] is None or isinstance(entry[0], str))
                  and isinstance(entry[1], str) and isinstance(entry[2], list) and entry[2]
                  and all(is_int(s, head) and s < added for s in entry[2]))
            if not ok:
                raise FormatError(f"{where}: store.{OPEN_PIECES} has {describe(entry)}; expected [writer id, env id, "
                                  f"serials of live pieces in [{head}, {added})] per open episode")
        self.serials = {(owner, env): [int(s) for s in serials] for owner, env, serials in state}

    def live(self, table: EpisodeTable) -> np.ndarray:
        """Serials of the live open pieces (evicted ones are forgotten)."""
        head = table.episodes_added - len(table)
        for key in list(self.serials):
            kept = [s for s in self.serials[key] if s >= head]
            if kept:
                self.serials[key] = kept
            else:   # evicted whole: the writer's later pieces note it again
                del self.serials[key]
        return np.fromiter((s for serials in self.serials.values() for s in serials), np.int64)

    def count(self, table: EpisodeTable) -> int:
        return len(self.live(table)) if self.serials else 0

    def listed(self, table: EpisodeTable, episodes: pa.Table, include_open: bool) -> pa.Table:
        """``episodes`` (the table's `to_arrow`, live entries oldest first) without the open
        pieces, or with them marked (an ``open`` column) when ``include_open``."""
        head = table.episodes_added - len(table)
        is_open = np.isin(np.arange(head, head + episodes.num_rows), self.live(table)) if self.serials \
            else np.zeros(episodes.num_rows, bool)
        if include_open:
            if "first_step" not in episodes.column_names:
                episodes = episodes.append_column("first_step", pa.array(np.zeros(episodes.num_rows, np.int64)))
            return episodes.append_column("open", pa.array(is_open))
        return episodes.filter(pa.array(~is_open)) if is_open.any() else episodes
