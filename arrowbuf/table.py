"""The episode table: live episodes of one shard as numpy columns, oldest first.

Append and evict-oldest are O(1) amortized: rows live in growable arrays between
``head`` and ``tail``; the arrays double when full and are compacted when more than
half of them is dead.

Every transition gets an *index*: a serial number, unique for the life of the shard,
that never comes back after eviction or `clear`. Indices of live transitions form one
contiguous range, so uniform sampling is a draw of integers, and an index kept by a
user (the ``"index"`` of a sample) can always be told stale from live.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf.indexing import RunLookup, run_lookup
from arrowbuf.open_indices import TOKEN, TailIndices, split, tokens
from arrowbuf.played import episodes_arrow, group_played
from arrowbuf.table_indexes import IndexMap, LongestQueue, Tips

_COLUMNS: dict[str, Any] = {
    "episode_id": np.int64,
    "env": np.int32,          # code into `env_names`
    "first_row": np.int64,
    "num_rows": np.int64,     # rows in the arena: length, +1 with the final observation
    "length": np.int64,       # transitions (steps that have a next observation)
    "has_final": np.bool_,
    "terminated": np.bool_,
    "truncated": np.bool_,
    "return": np.float64,
    "inserted_at": np.int64,  # ns since the epoch
    "first_index": np.int64,
    "first_step": np.int64,   # step of the first row within its episode: > 0 for a piece that continues one
    "prev_piece": np.int64,   # serial (k-th added) of the piece this one continues, its steps just before; -1: none
    "episode": np.int64,      # the played episode's id (users' ``episode_id``): the id of its first piece
    "tail": np.int64,         # uid of the open tail this entry is or was (`arrowbuf.open_indices`); -1: none
}

#: Columns a state may lack (written before they existed), with their value then.
_OPTIONAL = {"first_step": 0, "prev_piece": -1, "tail": -1}


class EpisodeTable:
    """FIFO table of one shard's live episodes.

    Args:
        shard: the shard's number, recorded in exported tables.
        id_offset, id_stride: episode ids are ``id_offset + k * id_stride`` for the
            k-th episode ever added, so the ids of several shards never collide.
        capacity: the most transitions ever live at once (the shard's rows). Given,
            the table keeps a map index -> episode (4 bytes a transition) that makes
            locating indices O(1) instead of a binary search over the episodes.
    """

    def __init__(self, shard: int = 0, id_offset: int = 0, id_stride: int = 1, capacity: int | None = None) -> None:
        self.shard = shard
        self.id_offset = id_offset
        self.id_stride = id_stride
        self._cols = {name: np.zeros(16, dtype) for name, dtype in _COLUMNS.items()}
        self._metadata: list[Any] = [None] * 16
        self.env_names: list[str] = []
        self._env_codes: dict[str, int] = {}
        self.head = 0
        self.tail = 0
        self.episodes_added = 0   # ever; the next id is derived from it
        # Running serials: "index" numbers transitions; samplers add their own units
        # (e.g. windows of a sequence length) with `add_counter`.
        self._counters: dict[str, tuple[Callable[[int], int], list[int]]] = {"index": (lambda n: n, [0])}
        self._index_map = IndexMap(capacity) if capacity else None   # index -> its episode's serial
        self._longest = LongestQueue()
        # `build_lookup`'s O(1) index -> episode lookup (without an index map), dropped by any change.
        self._lookup: RunLookup | None = None
        # Open tails (`publish_open`): entries [tail, tail + _num_open) of the arrays, after the
        # sealed ones, with provisional indices from `next_index` on; episode_id -1.
        self._num_open = 0
        self.open_total = 0       # their transitions
        self._open_longest = 0
        self.pieces = False       # whether a live or open entry continues an episode (first_step > 0)
        self._tips = Tips()
        self._tails = TailIndices()   # open steps' indices that keep naming their step
        self._unmatched = 0           # serial of the first piece not yet matched to a tail (`_match_sealed`)
        self._played_count: tuple[Any, int] | None = None   # `num_played`'s last answer, by the state it read

    def __len__(self) -> int:
        return self.tail - self.head

    @property
    def next_index(self) -> int:
        """Index of the next transition added."""
        return self._counters["index"][1][0]

    @property
    def num_transitions(self) -> int:
        """Sampleable transitions: those of sealed episodes and the open tails'."""
        first, stop = self.live_range()
        return stop - first + self.open_total

    @property
    def sealed_transitions(self) -> int:
        """Transitions of sealed episodes (pieces) only."""
        first, stop = self.live_range()
        return stop - first

    @property
    def num_open(self) -> int:
        """Open tails with at least one completed transition (`publish_open`)."""
        return self._num_open

    def sample_range(self) -> tuple[int, int]:
        """[first, stop) of the indices uniform sampling draws from: the live indices, then
        the open tails' provisional ones (valid until the next write; see `publish_open`)."""
        first, stop = self.live_range()
        return first, stop + self.open_total

    def ecol(self, name: str) -> np.ndarray:
        """`col` over the sealed entries followed by the open tails': what a position that
        `locate` returned for a provisional index reads (positions >= ``len(self)``)."""
        return self._cols[name][self.head:self.tail + self._num_open]

    def publish_open(self, first_row: np.ndarray, length: np.ndarray, first_step: np.ndarray,
                     env: np.ndarray, prev_piece: np.ndarray | None = None, grown_only: bool = False) -> None:
        """Make the completed steps of open episodes sampleable: entries after the sealed
        ones, one per open tail with ``length`` >= 1 transitions at arena rows
        ``[first_row, first_row + length]`` (the last row is the observation after the
        last step). Their indices are provisional: ``next_index`` on, in the given order,
        renumbered by the next write (a sealed piece then takes its permanent indices).
        ``env`` holds codes of `env_code`; ``prev_piece`` the serial of the sealed piece
        each tail continues (-1: none). ``grown_only``: the tails of the last publish, in its
        order, only longer; with nothing appended since (each append drops the open tails),
        only their lengths are written."""
        n, cols = len(first_row), self._cols
        if not (grown_only and n and n == self._num_open):   # an append, `clear` or load made it 0
            while self.tail + n > len(self._cols["episode_id"]):
                self._grow(self.tail + n)
            i, stop, cols = self.tail, self.tail + n, self._cols
            cols["episode_id"][i:stop] = -1
            cols["env"][i:stop] = env
            cols["first_row"][i:stop] = first_row
            cols["has_final"][i:stop] = cols["terminated"][i:stop] = cols["truncated"][i:stop] = False
            cols["first_step"][i:stop] = first_step
            cols["prev_piece"][i:stop] = -1 if prev_piece is None else prev_piece
            cols["episode"][i:stop] = self._episodes_of(cols["env"][i:stop], cols["prev_piece"][i:stop])
            self._match_sealed()
            cols["tail"][i:stop] = self._tails.publish(cols["first_row"][i:stop], cols["first_step"][i:stop])
            self.pieces = self.pieces or bool(n and first_step.any())
        i, stop = self.tail, self.tail + n
        cols["num_rows"][i:stop] = length + 1
        cols["length"][i:stop] = length
        ends = np.cumsum(length)
        cols["first_index"][i:stop] = self.next_index + ends - length
        self._num_open, self._played_count = n, None
        self.open_total, self._open_longest = (int(ends[-1]), int(length.max())) if n else (0, 0)

    def env_code(self, env_id: str) -> int:
        """The code of ``env_id`` in `env_names` (added if new)."""
        code = self._env_codes.get(env_id)
        if code is None:
            code = self._env_codes[env_id] = len(self.env_names)
            self.env_names.append(env_id)
        return code

    @property
    def longest(self) -> int:
        """Transitions of the longest live episode or open tail (0 when empty)."""
        return max(self._longest.longest, self._open_longest)

    @property
    def first_live_index(self) -> int:
        return self.live_range("index")[0]

    def add_counter(self, name: str, count: Callable[[int], int]) -> None:
        """Keep a serial of ``count(length)`` units per episode, like indices for transitions.

        Live units then form one contiguous range (`live_range`) that `locate` maps
        back to (episode position, offset): uniform sampling over any per-episode
        unit (windows of a sequence length, say) stays O(batch).
        """
        if name in self._counters:
            return
        column = np.zeros(len(self._cols["episode_id"]), np.int64)
        running = 0
        for i in range(self.head, self.tail):
            column[i] = running
            running += count(int(self._cols["length"][i]))
        self._cols[f"first_{name}"] = column
        self._counters[name] = (count, [running])

    def build_lookup(self) -> None:
        """Make `locate` of indices O(1) a unit until the table next changes: for a
        table without an index map (no ``capacity``) that is built once and then
        sampled many times, as a Ray reader's views are (see `arrowbuf.indexing.RunLookup`;
        O(episodes) to build, where the index map is O(transitions))."""
        first, stop = self.live_range()
        self._lookup = run_lookup(self.col("first_index"), stop, 4 * len(self) + 1024)

    def live_range(self, counter: str = "index") -> tuple[int, int]:
        """[first, stop) of the live units of ``counter``."""
        stop = self._counters[counter][1][0]
        if self.tail == self.head:
            return stop, stop
        return int(self._cols["first_" + counter][self.head]), stop

    def col(self, name: str) -> np.ndarray:
        """A view of one column over the live episodes, oldest first."""
        return self._cols[name][self.head:self.tail]

    def append(self, *, first_row: int, num_rows: int, length: int, has_final: bool,
               terminated: bool, truncated: bool, ret: float, env_id: str, metadata: Any = None,
               inserted_at: int | None = None, first_step: int = 0, prev_piece: int = -1) -> int:
        """Add an episode (or a piece of one that starts at step ``first_step``, continuing
        the piece added as the ``prev_piece``-th, if any) as the newest; returns its id.
        ``inserted_at`` (ns) defaults to now. Open tails published before are dropped:
        the writer publishes them again."""
        self._num_open = self.open_total = self._open_longest = 0
        cols = self._cols   # one store per column (a dict of values to loop over costs 2x)
        if self.tail == len(cols["episode_id"]):
            self._make_room()
            cols = self._cols
        code = self._env_codes.get(env_id)
        if code is None:
            code = self._env_codes[env_id] = len(self.env_names)
            self.env_names.append(env_id)
        serial = self.episodes_added
        episode_id = self.id_offset + serial * self.id_stride   # `episode_id_of`
        i = self.tail
        cols["episode_id"][i] = episode_id
        cols["env"][i] = code
        cols["first_row"][i] = first_row
        cols["num_rows"][i] = num_rows
        cols["length"][i] = length
        cols["has_final"][i] = has_final
        cols["terminated"][i] = terminated
        cols["truncated"][i] = truncated
        cols["return"][i] = ret
        cols["inserted_at"][i] = time.time_ns() if inserted_at is None else inserted_at
        cols["first_step"][i] = first_step
        cols["prev_piece"][i] = prev_piece
        cols["tail"][i] = -1   # or the uid of the tail it was: `_match_sealed`
        episode = self._episode_of(code, prev_piece) if prev_piece >= 0 else -1
        root = episode_id if episode < 0 else episode
        cols["episode"][i] = root
        if first_step or episode >= 0:
            self.pieces = True
        if prev_piece >= 0 or not (terminated or truncated):
            self._tips.note(code, prev_piece, serial, root, bool(terminated or truncated))
        counters = self._counters
        index = counters["index"][1]
        first_index = index[0]
        cols["first_index"][i] = first_index
        index[0] = first_index + length
        if len(counters) > 1:
            for name, (count, running) in counters.items():
                if name != "index":
                    cols[f"first_{name}"][i] = running[0]
                    running[0] += count(length)
        if length and self._index_map is not None:
            self._index_map.put(first_index, length, serial)
        self._metadata[i] = metadata
        self._longest.push(serial, length)
        self.tail = i + 1
        self._lookup = self._played_count = None
        self.episodes_added = serial + 1
        return episode_id

    def append_many(self, first_row: np.ndarray, num_rows: np.ndarray, length: Any, has_final: Any, terminated: Any,
                    truncated: Any, ret: Any, env_ids: Sequence[str], metadata: Sequence[Any] | None = None,
                    inserted_at: Any = None, first_step: Any = None, prev_piece: Any = None) -> list[int]:
        """`append` of each episode k (its values at position k of each argument), oldest first, as
        that many appends would, each column written once (a writer's flush of 4,096 pieces, an
        `add_episodes` block: ~7 us an append before); their ids. ``first_step``, ``prev_piece``:
        None for whole episodes."""
        n = len(first_row)
        first_step = np.zeros(n, np.int64) if first_step is None else np.asarray(first_step, np.int64)
        prev_piece = np.full(n, -1, np.int64) if prev_piece is None else np.asarray(prev_piece, np.int64)
        # One at a time when few (the batch's ~65 us of numpy calls then cost more: 32 appends took 70
        # us), when one continues a piece of the batch, or when two continue one.
        going_on = prev_piece[prev_piece >= 0]
        if n < 32 or (going_on >= self.episodes_added).any() or len(np.unique(going_on)) < len(going_on):
            return [self.append(first_row=int(first_row[k]), num_rows=int(num_rows[k]), length=int(length[k]),
                                has_final=bool(has_final[k]), terminated=bool(terminated[k]),
                                truncated=bool(truncated[k]), ret=float(ret[k]), env_id=env_ids[k],
                                metadata=None if metadata is None else metadata[k],
                                inserted_at=None if inserted_at is None else int(inserted_at[k]),
                                first_step=int(first_step[k]), prev_piece=int(prev_piece[k])) for k in range(n)]
        self._num_open = self.open_total = self._open_longest = 0
        if self.tail + n > len(self._cols["episode_id"]):
            self._grow(self.tail + n)
        cols, i, stop = self._cols, self.tail, self.tail + n
        codes = np.fromiter((self.env_code(env_id) for env_id in env_ids), np.int32, n)
        serials = self.episodes_added + np.arange(n, dtype=np.int64)
        ids, length = self.id_offset + serials * self.id_stride, np.asarray(length, np.int64)
        ended = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        episode = self._episodes_of(codes, prev_piece)   # the pieces continued are older than the batch
        root = np.where(episode < 0, ids, episode)
        for name, values in (("episode_id", ids), ("env", codes), ("first_row", first_row), ("num_rows", num_rows),
                             ("length", length), ("has_final", has_final), ("terminated", terminated),
                             ("truncated", truncated), ("return", ret), ("first_step", first_step),
                             ("prev_piece", prev_piece), ("tail", -1), ("episode", root),
                             ("inserted_at", time.time_ns() if inserted_at is None else inserted_at)):
            cols[name][i:stop] = values
        self.pieces = self.pieces or bool(first_step.any() or (episode >= 0).any())
        for k in np.flatnonzero((prev_piece >= 0) | ~ended).tolist():   # in order: an env's tips are a queue
            self._tips.note(int(codes[k]), int(prev_piece[k]), int(serials[k]), int(root[k]), bool(ended[k]))
        for name, (count, running) in self._counters.items():
            units = length if name == "index" else np.fromiter((count(m) for m in length.tolist()), np.int64, n)
            cols[f"first_{name}"][i:stop] = running[0] + np.cumsum(units) - units
            running[0] += int(units.sum())
        if self._index_map is not None:
            self._index_map.put_runs(int(cols["first_index"][i]), length, serials)
        self._metadata[i:stop] = [None] * n if metadata is None else list(metadata)
        self._longest.push_many(serials, length)
        self.tail = stop
        self._lookup = self._played_count = None
        self.episodes_added += n
        return ids.tolist()

    def _episode_of(self, code: int, prev_piece: int) -> int:
        """The episode id of a piece that continues the ``prev_piece``-th one (of env ``code``):
        that piece's, live or remembered; -1 when unknown (no previous piece, or forgotten)."""
        if prev_piece < 0:
            return -1
        pos = prev_piece - (self.episodes_added - len(self))
        if 0 <= pos < len(self):
            return int(self._cols["episode"][self.head + pos])
        return self._tips.get(code, prev_piece)

    def _episodes_of(self, codes: np.ndarray, prev_piece: np.ndarray) -> np.ndarray:
        """`_episode_of` of many pieces (vectorized over the live ones)."""
        pos = prev_piece - (self.episodes_added - len(self))
        live = (prev_piece >= 0) & (pos >= 0) & (pos < len(self))
        episode = np.where(live, self._cols["episode"][self.head:self.tail].take(np.where(live, pos, 0), mode="clip")
                           if len(self) else -1, -1)
        for k in np.flatnonzero((prev_piece >= 0) & ~live).tolist():
            episode[k] = self._episode_of(int(codes[k]), int(prev_piece[k]))
        return episode

    def episode_id_of(self, k: int) -> int:
        """The id of the k-th episode ever added to this table."""
        return self.id_offset + k * self.id_stride

    def pop_oldest(self, count: int) -> None:
        """Drop the ``count`` oldest episodes."""
        self.head += count
        self._tails.forget_before(self.episodes_added - len(self))
        self._lookup = self._played_count = None
        self._longest.drop_before(self.episodes_added - len(self))

    def trim_oldest(self, count: int, dropped_return: float = 0.0) -> None:
        """Drop the oldest piece's first ``count`` (< length) transitions, rewards ``dropped_return``."""
        cols, i = self._cols, self.head
        self._match_sealed()   # its tokens would name later steps now: they name nothing
        self._tails.forget(int(cols["tail"][i]))
        cols["tail"][i], cols["return"][i], length = -1, cols["return"][i] - dropped_return, int(cols["length"][i])
        for name, (units, _) in self._counters.items():
            if name != "index":   # a sampler's units (windows) in what is left of the piece
                cols[f"first_{name}"][i] += units(length) - units(length - count)
        for name in ("first_row", "first_step", "first_index", "num_rows", "length"):
            cols[name][i] += count if name.startswith("first") else -count
        self.pieces = True
        self._lookup = self._played_count = None

    def clear(self) -> None:
        """Drop every episode; ids and indices keep counting, so old indices stay stale."""
        self.head = self.tail = 0
        self._num_open = self.open_total = self._open_longest = 0
        self.pieces = False
        self._tails.clear()
        self._longest.clear()
        self._lookup = self._played_count = None

    def mark_pieces(self) -> None:   # an import of a store whose entries were pieces: `to_arrow` lists first_step
        self.pieces = True

    def resume(self, episodes_added: int, next_index: int) -> None:
        """Continue the numbering of another table: the next episode is the
        ``episodes_added``-th (its id follows) and its first transition gets index
        ``next_index``. Imports use it to keep an export's episode ids and indices.

        Raises:
            ValueError: the table is not empty.
        """
        if len(self):
            raise ValueError(f"resume needs an empty episode table, this one holds {len(self)} episodes")
        self.episodes_added = int(episodes_added)
        self._counters["index"][1][0] = int(next_index)

    # -- state ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything about the live episodes: numpy columns (copies) and JSON values.

        The running serials of counters added by samplers are included; restore
        with `load_state_dict` on a table whose samplers registered the same counters.
        """
        meta = self.metadata()
        return {
            "shard": self.shard, "id_offset": self.id_offset, "id_stride": self.id_stride,
            "episodes_added": self.episodes_added,
            "env_names": list(self.env_names),
            "counters": {name: serial[0] for name, (_, serial) in self._counters.items()},
            "columns": {name: self.col(name).copy() for name in self._cols},
            "metadata": [[i, m] for i, m in enumerate(meta) if m is not None],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this table's contents with a `state_dict`.

        Raises:
            ValueError: the state lacks a column or a counter this table keeps
                (a sampler that numbers windows was not restored first), or its
                columns have unequal lengths.
        """
        columns = state["columns"]
        n = len(columns.get("episode_id", ()))
        columns = {**{name: np.full(n, value, self._cols[name].dtype) for name, value in _OPTIONAL.items()},
                   **columns}
        if "episode" not in columns and "episode_id" in columns:   # written before: each piece its own episode
            columns["episode"] = np.asarray(columns["episode_id"], np.int64).copy()
        missing = sorted(set(self._cols) - set(columns))
        if missing:
            raise ValueError(f"episode table state lacks column(s) {missing}")
        unknown = sorted(set(self._counters) - set(state["counters"]))
        if unknown:
            raise ValueError(f"episode table state lacks counter(s) {unknown}")
        n = len(columns["episode_id"])
        if any(len(columns[name]) != n for name in self._cols):
            raise ValueError(f"episode table state has columns of unequal lengths; expected {n} rows each")
        size = max(16, n)
        for name, array in self._cols.items():
            fresh = np.zeros(size, array.dtype)
            fresh[:n] = columns[name]
            self._cols[name] = fresh
        self._metadata = [None] * size
        for i, text in state["metadata"]:
            self._metadata[int(i)] = text
        self.shard = int(state["shard"])
        self.id_offset, self.id_stride = int(state["id_offset"]), int(state["id_stride"])
        self.env_names = list(state["env_names"])
        self._env_codes = {name: code for code, name in enumerate(self.env_names)}
        self.episodes_added = int(state["episodes_added"])
        for name, (_, serial) in self._counters.items():
            serial[0] = int(state["counters"][name])
        self.head, self.tail = 0, n
        self._num_open = self.open_total = self._open_longest = 0
        self.pieces = bool(np.any(self._cols["first_step"][:n]) or
                           np.any(self._cols["episode"][:n] != self._cols["episode_id"][:n]))
        self._tips.clear()
        tails = self._cols["tail"][:n]
        self._tails = TailIndices({int(u): self.episodes_added - n + k for k, u in enumerate(tails.tolist()) if u >= 0},
                                  int(tails.max()) + 1 if n else 0)
        self._unmatched = self.episodes_added
        self._longest.clear()
        self._lookup = self._played_count = None
        serials = np.arange(self.episodes_added - n, self.episodes_added, dtype=np.int64)
        lengths = self._cols["length"][:n]
        self._longest.push_many(serials, lengths)
        if self._index_map is not None and n:   # the live indices: one run from the oldest's first
            self._index_map.put_runs(int(self._cols["first_index"][0]), lengths, serials)

    def position_of(self, episode_id: np.ndarray | int) -> np.ndarray | int:
        """Live position (0 = oldest) of episode ids; out of [0, len) when not live."""
        if not len(self):
            return np.asarray(episode_id) * 0 - 1
        return (np.asarray(episode_id) - self._cols["episode_id"][self.head]) // self.id_stride

    def locate(self, units: np.ndarray, counter: str = "index") -> tuple[np.ndarray, np.ndarray]:
        """Live positions of the episodes holding ``units`` (all live) and the offsets in them.

        For indices the offset is the step, so the arena row is ``first_row[pos] + offset``.
        Provisional indices of open tails (`sample_range`) get positions >= ``len(self)``:
        read them with `ecol`.
        """
        if counter == "index" and self.open_total:
            return self._locate_open(units)
        if counter == "index" and self._index_map is not None:
            serials = self._index_map.serials_of(units)
            # uint32 arithmetic wraps like the serials in the map (a Python int within
            # uint32 keeps the uint32 loop), converted to intp: every take by uint32
            # positions (here, the rows, the episode ids) would convert them again.
            # Not np.subtract(dtype=np.uint32, out=intp array): 1.5x slower here.
            pos = (serials - ((self.episodes_added - self.tail + self.head) & 0xFFFFFFFF)).astype(np.intp)
            return pos, units - self._cols["first_index"][self.head:self.tail].take(pos)
        first = self.col(f"first_{counter}")
        if counter == "index" and self._lookup is not None:
            pos = self._lookup(units)
        else:
            pos = np.searchsorted(first, units, side="right") - 1
        return pos, units - first.take(pos)

    def _locate_open(self, units: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`locate` of indices that may be provisional (open tails published)."""
        stop = self.next_index
        is_open = units >= stop
        if not is_open.any():
            saved, self.open_total = self.open_total, 0
            try:
                return self.locate(units)
            finally:
                self.open_total = saved
        first = self.ecol("first_index")
        pos = np.searchsorted(first, units, side="right") - 1
        return pos, units - first.take(pos)

    def public_indices(self, indices: np.ndarray, pos: np.ndarray | None = None) -> np.ndarray:
        """``indices`` as users get them: a provisional one (an open tail's) as a token that
        keeps naming its step (`arrowbuf.open_indices`); ``pos``: their `locate` positions."""
        if not self._num_open:
            return indices
        provisional = indices >= self.next_index
        if not provisional.any():
            return indices
        out = np.array(indices, np.int64, copy=True)
        p = self._locate_open(indices[provisional])[0] if pos is None else np.broadcast_to(pos, indices.shape)[provisional]
        out[provisional] = tokens(indices[provisional], self.ecol("first_index").take(p), self.ecol("tail").take(p))
        return out

    def _match_sealed(self) -> None:
        """Give the pieces sealed since the last publish the uids of the tails they were."""
        first = max(self._unmatched, self.episodes_added - len(self))
        if first < self.episodes_added and self._tails.any:
            a, b = self.head + first - (self.episodes_added - len(self)), self.tail
            self._cols["tail"][a:b] = self._tails.seal(self._cols["first_row"][a:b], self._cols["first_step"][a:b],
                                                       np.arange(first, self.episodes_added))
        self._unmatched = self.episodes_added

    def resolve(self, indices: np.ndarray) -> np.ndarray:
        """Users' ``indices`` (tokens included) as this table's indices of the same steps
        now; -1 for a step no longer held (or a number never handed out)."""
        if not len(indices) or indices.max() < self.next_index:   # plain indices (the common case): no copy
            return indices
        out, token = np.where(indices < self.next_index, indices, -1), np.flatnonzero(indices >= TOKEN)
        if not len(token):
            return out
        self._match_sealed()
        uid, offset = split(indices[token])
        base = self.episodes_added - len(self)
        tails = {int(u): len(self) + k for k, u in enumerate(self.ecol("tail")[len(self):].tolist())}
        for k, u, off in zip(token.tolist(), uid.tolist(), offset.tolist()):
            serial = self._tails.sealed.get(u)
            pos = serial - base if serial is not None and serial >= base else tails.get(u, -1)
            if pos >= 0 and off < self.ecol("length")[pos]:
                out[k] = self.ecol("first_index")[pos] + off
        return out

    def rows_of(self, indices: np.ndarray) -> np.ndarray:
        """Arena rows of live transition indices."""
        pos, offset = self.locate(indices)
        return self.col("first_row").take(pos) + offset

    def is_live(self, indices: np.ndarray) -> np.ndarray:
        return (indices >= self.first_live_index) & (indices < self.next_index)

    def is_sampleable(self, indices: np.ndarray) -> np.ndarray:
        """`is_live`, or a provisional index of an open tail (`sample_range`)."""
        first, stop = self.sample_range()
        return (indices >= first) & (indices < stop)

    def metadata(self) -> list[Any]:
        return self._metadata[self.head:self.tail]

    def num_played(self, open_pieces: np.ndarray | None = None) -> int:
        """Played episodes with a stored step whose end is stored too (the rows of `to_arrow`):
        a piece of an episode that goes on does not count it yet (`arrowbuf.played`)."""
        if not self.pieces and open_pieces is None:
            return len(self)
        key = None if open_pieces is None else open_pieces.tobytes()
        if self._played_count is None or self._played_count[0] != key:
            self._played_count = (key, int(np.count_nonzero(~group_played(self, open_pieces).open)))
        return self._played_count[1]

    def to_arrow(self, include_open: bool = False, open_pieces: np.ndarray | None = None,
                 open_returns: np.ndarray | None = None) -> pa.Table:
        """The live episodes as an Arrow table (a snapshot), one row per played episode
        (`arrowbuf.played.episodes_arrow`; ``open_returns``: the open tails' reward sums)."""
        return episodes_arrow(self, include_open, open_pieces, open_returns=open_returns)

    def _grow(self, needed: int) -> None:
        """Room for ``needed`` entries from ``head`` (open tails published after the sealed ones)."""
        self._relocate(max(2 * len(self._cols["episode_id"]), needed - self.head))

    def _make_room(self) -> None:
        size = len(self._cols["episode_id"])
        self._relocate(size * 2 if len(self) > size // 2 else size)

    def _relocate(self, size: int) -> None:
        """Move the live entries to the front of new arrays of ``size`` entries."""
        live = len(self)
        for name, array in self._cols.items():
            fresh = np.zeros(size, array.dtype)
            fresh[:live] = array[self.head:self.tail]
            self._cols[name] = fresh
        self._metadata = self._metadata[self.head:self.tail] + [None] * (size - live)
        self.head, self.tail = 0, live
