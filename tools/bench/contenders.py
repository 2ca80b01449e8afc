"""The replay implementations under test (W1, W2, W3, PER, RAY).

- ``ideal``: preallocated, pre-touched numpy columns laid out like the arena
  (an episode's T+1 observation rows contiguous); add = slice assignment,
  sample = ``rng.integers`` + one ``np.take`` per column + ``obs[idx + 1]``.
- ``ideal_checked`` (add only): the ideal's add plus the least a store that
  checks its input must do per episode.
- ``ideal_torch`` (sample only, information): the ideal's columns gathered with
  ``torch.index_select``.
- ``ideal_out`` (sample only, information): the ideal's takes into preallocated,
  pre-touched outputs reused by every call (``out=``, ``mode="clip"``).
- ``ideal_td`` (sample only): the ideal's gather returned as arrowbuf's sample
  contract, a TensorDict: the floor of any Python store that hands out TensorDicts.
- ``arrowbuf``: ``ExperienceStore(capacity, seed=0)``; ``add_episode(dict)``,
  ``sample(batch)`` -> TensorDict.
- ``torchrl``: ``ReplayBuffer(LazyTensorStorage(capacity), RandomSampler())`` of
  transition TensorDicts with ("next", "obs"); ``extend`` per episode.
- `NaiveReplay`: the ideal as a Ray actor (RAY's baseline).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping

import numpy as np

from .specs import ReplaySpec


class Contender:
    """A replay implementation under test. Subclasses set ``name`` and implement the hooks."""

    name = "?"
    label = "?"
    can_add = True
    can_sample = True
    probe_memory = True
    needs_torch = True   # its memory probe imports torch before the baseline

    @staticmethod
    def preload() -> None:
        """Import what it needs (before a memory probe takes its baseline)."""

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, "Contender"]) -> None:
        self.spec = spec

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        """The episode in this contender's input format (not timed)."""
        return episode

    def lap(self) -> int:
        """Episodes that fill the store once."""
        raise NotImplementedError

    def add(self, item: Any) -> None:
        raise NotImplementedError

    def sample(self, batch_size: int) -> Any:
        raise NotImplementedError

    def rows_stored(self) -> int:
        """Rows held now (the unit of the raw-bytes denominator)."""
        raise NotImplementedError


class Ideal(Contender):
    """Preallocated, pre-touched numpy columns; slice-assignment add, ``np.take`` sample."""

    name = "ideal"
    label = "ideal (numpy)"
    needs_torch = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.T = spec.episode_len
        self.slot_rows = self.T + 1
        self.slots = spec.capacity // self.slot_rows
        self.cols = {}
        for name, f in spec.fields.items():
            col = np.empty((self.slots * self.slot_rows, *f.shape), np.dtype(f.dtype))
            col.reshape(-1).view(np.uint8)[:] = 0          # pre-touch every page
            self.cols[name] = col
        self.obs_names = [n for n, f in spec.fields.items() if f.observation]
        self.next_slot = 0
        self.live = 0
        self.rng = np.random.default_rng(0)

    def lap(self) -> int:
        return self.slots

    def add(self, item: dict[str, np.ndarray]) -> int:
        start = self.next_slot * self.slot_rows
        for name, array in item.items():
            self.cols[name][start:start + len(array)] = array
        self.next_slot = (self.next_slot + 1) % self.slots
        self.live = min(self.live + 1, self.slots)
        return self.live

    def indices(self, batch_size: int) -> np.ndarray:
        """Transition indices drawn uniformly: ``T`` a slot."""
        return self.rng.integers(0, self.live * self.T, batch_size)

    def rows_of(self, indices: np.ndarray) -> np.ndarray:
        return indices + indices // self.T             # skip each slot's final-observation row

    def rows(self, batch_size: int) -> np.ndarray:
        return self.rows_of(self.indices(batch_size))

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        rows = self.rows(batch_size)
        out = {name: np.take(col, rows, axis=0) for name, col in self.cols.items()}
        if self.obs_names:
            rows1 = rows + 1
            for name in self.obs_names:
                out["next_" + name] = np.take(self.cols[name], rows1, axis=0)
        return out

    def rows_stored(self) -> int:
        return self.live * self.slot_rows


class IdealChecked(Ideal):
    """The ideal's add plus the least a checked store must do per episode (add
    only): the dict's names, dtypes, shapes and lengths checked, the copy, one
    episode-table row (first row, length, flags, return, first index) in a numpy
    record and the index -> episode map filled for O(1) sampling. The floor of a
    Python store that validates its input."""

    name = "ideal_checked"
    label = "ideal + checks"
    can_sample = False
    probe_memory = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.specs = [(n, np.dtype(f.dtype), len(f.shape) + 1, tuple(f.shape), f.observation)
                      for n, f in spec.fields.items()]
        self.table = np.zeros(self.slots, [("first_row", "i8"), ("length", "i8"), ("terminated", "?"),
                                           ("truncated", "?"), ("return", "f8"), ("first_index", "i8")])
        self.index_map = np.zeros(self.slots * self.T, np.uint32)
        self.next_index = 0

    def add(self, item: dict[str, np.ndarray]) -> int:
        if type(item) is not dict or len(item) != len(self.specs):
            raise ValueError("fields do not match the schema")
        steps = -1
        for name, dtype, ndim, shape, observation in self.specs:
            array = item.get(name)
            if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != ndim \
                    or array.shape[1:] != shape or (not observation and steps not in (-1, len(array))):
                raise ValueError(f"field {name!r} does not match the schema")
            if not observation:
                steps = len(array)
        slot, index = self.next_slot, self.next_index
        live = super().add(item)
        flag = (lambda name: bool(item[name][-1]) if name in item else False)
        reward = float(np.add.reduce(item["reward"], axis=None, dtype=np.float64)) if "reward" in item else 0.0
        self.table[slot] = (slot * self.slot_rows, steps, flag("terminated"), flag("truncated"), reward, index)
        start = index % len(self.index_map)
        self.index_map[start:start + steps] = slot   # episodes of T steps: never wraps
        self.next_index = index + steps
        return live


class IdealView(Contender):
    """A sample-only variant of the ideal that reads the ideal's own columns."""

    can_add = False
    probe_memory = False

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        import torch
        self.torch = torch
        self.ideal: Ideal = peers["ideal"]  # type: ignore[assignment]


class IdealTorch(IdealView):
    """The ideal's columns gathered with torch.index_select (sample only)."""

    name = "ideal_torch"
    label = "ideal (torch)"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        self.cols = {n: self.torch.from_numpy(c) for n, c in self.ideal.cols.items()}

    def sample(self, batch_size: int) -> dict:
        torch = self.torch
        rows = torch.from_numpy(self.ideal.rows(batch_size))
        out = {name: torch.index_select(col, 0, rows) for name, col in self.cols.items()}
        if self.ideal.obs_names:
            rows1 = rows + 1
            for name in self.ideal.obs_names:
                out["next_" + name] = torch.index_select(self.cols[name], 0, rows1)
        return out


class IdealOut(IdealView):
    """The ideal's gather into preallocated, pre-touched outputs (sample only,
    information): one ``np.take(..., out=, mode="clip")`` per column into the same
    arrays every call, as ONPOLICY's ideal does. Faster than the ideal by its
    allocations, but each sample overwrites the last one, which a store that hands
    out batches cannot do."""

    name = "ideal_out"
    label = "ideal (np.take, out=)"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        ideal = self.ideal
        columns = {**ideal.cols, **{"next_" + n: ideal.cols[n] for n in ideal.obs_names}}
        self.out = {}
        for name, col in columns.items():
            out = np.empty((spec.batch_size, *col.shape[1:]), col.dtype)
            out.reshape(-1).view(np.uint8)[:] = 0          # pre-touch every page
            self.out[name] = out

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        ideal, out = self.ideal, self.out
        rows = ideal.rows(batch_size)
        for name, col in ideal.cols.items():
            col.take(rows, axis=0, out=out[name], mode="clip")   # "raise" would buffer the output
        rows1 = rows + 1
        for name in ideal.obs_names:
            ideal.cols[name].take(rows1, axis=0, out=out["next_" + name], mode="clip")
        return out


class IdealTensorDict(IdealView):
    """The ideal's gather returned as arrowbuf's sample contract (sample only): the
    same np.take per column, then the keys a trainer gets from ``store.sample`` -
    ``("next", obs)``, ``"index"``, ``"episode_id"``, ``"step"`` - wrapped as a
    TensorDict with torch.from_numpy and TensorDict's unchecked constructor. The
    floor of any Python store that returns TensorDicts."""

    name = "ideal_td"
    label = "ideal + TensorDict"

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender]) -> None:
        super().__init__(spec, peers)
        from tensordict import TensorDict
        self.new_td = getattr(TensorDict, "_new_unsafe", TensorDict)

    def sample(self, batch_size: int) -> Any:
        ideal, from_numpy, T = self.ideal, self.torch.from_numpy, self.ideal.T
        indices = ideal.indices(batch_size)
        rows = ideal.rows_of(indices)
        out = {name: from_numpy(np.take(col, rows, axis=0)) for name, col in ideal.cols.items()}
        rows1 = rows + 1
        out["next"] = {name: from_numpy(np.take(ideal.cols[name], rows1, axis=0)) for name in ideal.obs_names}
        out["index"] = from_numpy(indices)
        out["episode_id"] = from_numpy(indices // T)
        out["step"] = from_numpy((indices % T).astype(np.int32))
        return self.new_td(out, batch_size=self.torch.Size([batch_size]))


class Arrowbuf(Contender):
    """``ExperienceStore(capacity, seed=0)`` (or with ``sampler``): add_episode, sample."""

    name = "arrowbuf"
    label = "arrowbuf"

    @staticmethod
    def preload() -> None:
        # `import arrowbuf` loads its modules on first use (and tensordict with them): the store's
        # and its batches' modules are imported here, or the probe's growth counts their imports
        # (W1: 2.27x raw bytes where the store's own rows take 1.08x).
        import tensordict  # noqa: F401

        import arrowbuf.store  # noqa: F401
        import arrowbuf.tensors  # noqa: F401

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender], sampler: Any = None) -> None:
        super().__init__(spec, peers)
        import arrowbuf as ab
        self.store = ab.ExperienceStore(spec.capacity, seed=0, sampler=sampler)

    def lap(self) -> int:
        return self.spec.capacity // (self.spec.episode_len + 1)

    def add(self, item: dict[str, np.ndarray]) -> None:
        self.store.add_episode(item)

    def sample(self, batch_size: int) -> Any:
        return self.store.sample(batch_size)

    def rows_stored(self) -> int:
        # Every episode is given with its final observation: transitions + 1 rows each.
        return len(self.store) + self.store.num_episodes


class TorchRL(Contender):
    """``ReplayBuffer(storage, sampler)``: LazyTensorStorage and RandomSampler unless given."""

    name = "torchrl"
    label = "torchrl"

    @staticmethod
    def preload() -> None:
        import torchrl.data  # noqa: F401
        logging.getLogger("torchrl").setLevel(logging.WARNING)

    def __init__(self, spec: ReplaySpec, peers: Mapping[str, Contender], **buffer_args: Any) -> None:
        super().__init__(spec, peers)
        self.preload()
        from torchrl.data import LazyTensorStorage, RandomSampler, ReplayBuffer
        buffer_args.setdefault("storage", LazyTensorStorage(spec.capacity))
        buffer_args.setdefault("sampler", RandomSampler())
        self.rb = ReplayBuffer(**buffer_args)

    def prepare(self, episode: dict[str, np.ndarray]) -> Any:
        import torch
        from tensordict import TensorDict
        T = self.spec.episode_len
        data: dict[str, Any] = {}
        nxt: dict[str, Any] = {}
        for name, array in episode.items():
            tensor = torch.from_numpy(array)
            if self.spec.fields[name].observation:
                data[name], nxt[name] = tensor[:T], tensor[1:T + 1]
            else:
                data[name] = tensor
        data["next"] = nxt
        return TensorDict(data, batch_size=[T])

    def lap(self) -> int:
        return -(-self.spec.capacity // self.spec.episode_len)

    def add(self, item: Any) -> None:
        self.rb.extend(item)

    def sample(self, batch_size: int) -> Any:
        return self.rb.sample(batch_size)

    def rows_stored(self) -> int:
        return len(self.rb)


class NaiveReplay(Ideal):
    """The naive Ray baseline: the ideal in one actor, ``add(episode_dict)`` and
    ``sample(n)`` -> dict of numpy arrays, one call per batch."""

    def __init__(self, spec: ReplaySpec) -> None:
        super().__init__(spec, {})


CONTENDERS: dict[str, type[Contender]] = {c.name: c for c in (Ideal, IdealChecked, IdealTorch, IdealOut,
                                                                IdealTensorDict, Arrowbuf, TorchRL)}


def build_contender(name: str, spec: ReplaySpec, peers: Mapping[str, Contender],
                    episodes: list[dict[str, np.ndarray]]) -> tuple[Contender, list[Any]]:
    """The contender and its inputs (the episodes in its format)."""
    contender = CONTENDERS[name](spec, peers)
    items = [contender.prepare(ep) for ep in episodes] if contender.can_add else []
    return contender, items


def fill(contender: Contender, items: list[Any]) -> float:
    """Add one lap of episodes; returns rows/s."""
    lap = contender.lap()
    start = time.perf_counter()
    for i in range(lap):
        contender.add(items[i % len(items)])
    return lap * contender.spec.episode_len / (time.perf_counter() - start)
