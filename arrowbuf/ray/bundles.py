"""Many small episodes of one write request shipped as one set of arrays (`RaySink.write_many_now`).

A rollout's end on Ray is thousands of short episodes in one ``add_episodes`` request (a
vector env's sub-envs, `arrowbuf.compat`'s pieces). Sent as a list, each episode is its own
pickled dataclass with an array per field: for the WBC shape (4,312 episodes of 9 fields)
pickling them took ~0.5 s of a rollout's ~1 s on Ray. `Bundle` is that list; it pickles as each
field's rows of every episode back to back (one array a field, which Ray ships without a
copy in the shard) and each episode's row counts and table values, and unpickles as the
plain list of `Episode` views of those arrays: the shard's code takes it as it was sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from arrowbuf.shard import Episode


class Bundle(list):
    """A list of episodes that pickles as one array a field (see the module docstring)."""

    def __reduce__(self) -> tuple:
        names = list(self[0].columns)
        columns = {name: np.concatenate([e.columns[name] for e in self]) for name in names}
        rows = {name: np.array([len(e.columns[name]) for e in self], np.int64) for name in names}
        table = [(e.num_steps, e.has_final, e.env_id, e.metadata, e.owned, e.inserted_at, e.first_step, e.open,
                  e.prev_piece) for e in self]
        return _unbundle, (columns, rows, table)


def bundled(episodes: list[Episode]) -> list[Episode]:
    """``episodes`` as a `Bundle` where they form one (two or more, whose columns are numpy arrays
    of one dtype and row shape a field: a concatenation keeps every value exact), else as given."""
    if len(episodes) < 2:
        return episodes
    first = episodes[0].columns
    if not all(type(value) is np.ndarray for value in first.values()):
        return episodes
    for episode in episodes[1:]:
        columns = episode.columns
        if columns.keys() != first.keys() or not all(_like(columns[name], like) for name, like in first.items()):
            return episodes
    return Bundle(episodes)


def _like(value: Any, first: np.ndarray) -> bool:
    """Whether ``value`` is a numpy array that concatenates with ``first`` exactly (dtype and row shape)."""
    return type(value) is np.ndarray and value.dtype == first.dtype and value.shape[1:] == first.shape[1:]


def _unbundle(columns: dict[str, np.ndarray], rows: dict[str, np.ndarray],
              table: list[tuple[Any, ...]]) -> list[Episode]:
    """The episodes a `Bundle` pickled: views of ``columns``, in order."""
    ends = {name: np.cumsum(counts).tolist() for name, counts in rows.items()}
    episodes, starts = [], {name: 0 for name in columns}
    for k, (steps, final, env_id, metadata, owned, inserted_at, first_step, is_open, prev_piece) in enumerate(table):
        views = {}
        for name, column in columns.items():
            views[name] = column[starts[name]:ends[name][k]]
            starts[name] = ends[name][k]
        episodes.append(Episode(views, steps, final, env_id=env_id, metadata=metadata, owned=owned,
                                inserted_at=inserted_at, first_step=first_step, open=is_open, prev_piece=prev_piece))
    return episodes
