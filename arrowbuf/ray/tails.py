"""`OpenPieces`: a shard's pieces of episodes that are still open (a Ray writer's shipped steps).

A Ray writer ships the completed steps of each open episode as a piece on its
delivery timer (`arrowbuf.piece_cutting`). Its shard stores a piece as it stores
any episode (a row of the episode table with its ``first_step``; sealed into a
block, so readers see its steps within ``seal_latency``), and notes here which
stored pieces belong to an episode that goes on, by (owner, env): the owner is
the id of the writer that shipped them, or of the writer whose state a restored
writer continues (`RaySink.load_open_state`); the episode's last piece
(``open=False``) or a close (`RaySink.close_open`) ends them.

Each stored piece records the piece it continues (`Episode.prev_piece`, from `previous`),
so that an episode's pieces are one episode: one ``episode_id`` (its first piece's), one
row of ``episodes()``, and n-step returns, frame stacks and GAE across them, as locally.
An episode whose pieces go on counts as transitions (``len(store)``) but not as an episode:
``num_episodes`` and ``episodes()`` leave it out, ``episodes(include_open=True)`` lists it
with ``open=True``, as a local store lists its writers' open episodes. Eviction drops its
pieces as any piece (first in, first out). A shard's checkpoint keeps which are open
(`state`, `load`), and a durable shard's log each piece's link, whether its episode goes
on, its owner and the ends (`arrowbuf.episode_log`): a restarted durable shard replays
them (`stored`, `close`) and keeps its pieces one episode, open where they were.
"""

from __future__ import annotations

from typing import Any

import numpy as np

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
        self.newest: dict[Key, int] = {}   # the serial of each open episode's newest stored piece, evicted or not

    def previous(self, writer: str | None, episode: Episode) -> int:
        """The serial of the stored piece that ``episode`` (a piece of ``writer``'s) continues; -1: none."""
        return self.newest.get((writer, episode.env_id), -1) if episode.first_step else -1

    def stored(self, writer: str | None, episode: Episode, serial: int) -> None:
        """``episode`` was stored as entry ``serial``: an open piece is noted, a last piece
        ends its episode's."""
        key = (writer, episode.env_id)
        if episode.open:
            self.serials.setdefault(key, []).append(serial)
            self.newest[key] = serial
        else:
            self.serials.pop(key, None)
            self.newest.pop(key, None)

    def close(self, writer: str | None, env_ids: list[str]) -> None:
        """The episodes of ``env_ids`` ended with their last stored piece."""
        for env_id in env_ids:
            self.serials.pop((writer, env_id), None)
            self.newest.pop((writer, env_id), None)

    def clear(self) -> None:
        self.serials.clear()
        self.newest.clear()

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
        self.newest = {key: serials[-1] for key, serials in self.serials.items()}   # a loaded writer's next piece links on

    def restore(self, info: dict, table: EpisodeTable, where: str) -> None:
        """`load` the state a checkpoint's ``info`` holds, if it holds one."""
        if info.get(OPEN_PIECES) is not None:
            self.load(info[OPEN_PIECES], table, where)

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

    def mask(self, table: EpisodeTable) -> np.ndarray | None:
        """Which live entries of ``table`` are pieces of open episodes; None when none is."""
        if not self.serials:
            return None
        head = table.episodes_added - len(table)
        return np.isin(np.arange(head, head + len(table)), self.live(table))
