"""`Mixture`: batches drawn from several sources in exact, adjustable shares.

Offline-to-online RL (RLPD and its successors) samples a fixed share of every batch
from a dataset of demonstrations and the rest from online replay. A `Mixture` holds
named sources (`arrowbuf.Dataset`, local or Ray `ExperienceStore`, anything with the
store's ``sample``) and their weights; each ``sample(B)`` draws exactly
``round(w * B)`` rows from each source with each source's own sampler (so rows
inside a source are drawn as that source draws them: uniformly, by priority, as
windows...), and marks every row with an int64 ``"source"``: the position of its
source in the mapping. The shares are counts, not probabilities: no batch deviates.

Counts: with the weights normalized to sum to 1, source i gets
``floor(w_i * B + 0.5)`` rows; the rounding remainder (``B`` minus their sum, which
may be negative) goes to the source of the largest weight (the first of equal
ones). Should that leave it below zero (only with many equal weights on tiny
batches), the rest is taken from the next largest weights in turn.

Rows come grouped by source, in the mapping's order (``shuffle=True`` permutes them
with the mixture's seeded generator). A batch's ``"index"`` is the index *within
its source*; for a prioritized source, `Mixture.update_priorities` sends each
source its own rows' indices and priorities (or do it by hand: the rows where
``batch["source"] == mixture.position("demos")`` belong to that source). Sources
without an importance ``"weight"`` get 1.0 in a batch where another source has one.
Ragged fields come as one jagged tensor of every source's rows and text fields as one
``NonTensorStack``; with ``pad=`` each source's padded rows are padded on to the batch's
longest row.

Example:
    >>> import numpy as np, arrowbuf as ab
    >>> def filled(seed):
    ...     store = ab.ExperienceStore(capacity=200, seed=seed)
    ...     _ = store.add_episode({"obs": np.zeros((11, 2), np.float32), "action": np.zeros(10, np.int64),
    ...                            "terminated": np.arange(10) == 9})
    ...     return store
    >>> mixture = ab.Mixture({"demos": filled(0), "online": filled(1)}, weights={"demos": 0.25, "online": 0.75})
    >>> batch = mixture.sample(10)
    >>> batch["source"].tolist()
    [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]
    >>> mixture.set_weights({"demos": 0.0, "online": 1.0})
    >>> mixture.counts(10)
    {'demos': 0, 'online': 10}
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf._checks import check_bool, check_int, check_priorities, check_sample_args, real_numbers
from arrowbuf._mixed import MAX_PLANS, MixedPlan, in_process_source
from arrowbuf._pool import SlotPool
from arrowbuf.errors import EmptyStoreError, describe
from arrowbuf.layout import check_keys, schema_keys
from arrowbuf.ragged import RaggedRows, check_pad, jagged
from arrowbuf.samplers import PrioritizedSampler
from arrowbuf.tensors import make_tensordict

#: Keys a source may lack when another has them, and the value it gets.
_FILLED = {"weight": 1.0}


def split_counts(weights: np.ndarray, batch_size: int) -> np.ndarray:
    """Rows per source of a batch of ``batch_size``: see the module docstring.

    Args:
        weights: non-negative, summing to 1.
        batch_size: rows in the batch.
    """
    counts = np.floor(weights * batch_size + 0.5).astype(np.int64)
    remainder = batch_size - int(counts.sum())
    for k in np.argsort(-weights, kind="stable"):
        if remainder == 0:
            break
        change = max(remainder, -int(counts[k]))
        counts[k] += change
        remainder -= change
    return counts


class Mixture:
    """Batches of several sources in exact per-batch shares (see the module docstring).

    Args:
        sources: name -> a source with the store's ``sample`` (`Dataset`,
            `ExperienceStore`, local or Ray).
        weights: name -> share (>= 0; normalized to sum to 1), one per source.
        seed: seed of the generator that permutes rows with ``shuffle=True``.
        shuffle: permute each batch's rows (default: grouped by source, in order).

    Raises:
        ValueError: no sources, a source without ``sample``, or bad weights.
    """

    def __init__(self, sources: Mapping[str, Any], weights: Mapping[str, float], *, seed: int | None = None,
                 shuffle: bool = False) -> None:
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(f"sources must be a non-empty mapping name -> dataset or store, got {describe(sources)}")
        for name, source in sources.items():
            if not isinstance(name, str) or not callable(getattr(source, "sample", None)):
                raise ValueError(f"sources[{name!r}] must be a Dataset or ExperienceStore (something with "
                                 f"sample()), keyed by a str; got {describe(source)}")
        self._sources = dict(sources)
        # (engine, rows callback) per source when all can take `arrowbuf._mixed`'s path.
        found = [in_process_source(source) for source in self._sources.values()]
        self._direct = found if all(f is not None for f in found) else None
        self._plans: dict[int, MixedPlan] = {}        # by batch size
        self._generic: dict[int, tuple] = {}          # batch size -> the shards it did not apply to
        self._pool = SlotPool()
        self.names = tuple(self._sources)
        self.shuffle = check_bool("shuffle", shuffle)
        self._rng = np.random.default_rng(None if seed is None else check_int("seed", seed, 0))
        self.weights: dict[str, float] = {}
        self.set_weights(weights)

    def __repr__(self) -> str:
        return f"Mixture({', '.join(f'{n}: {w:g}' for n, w in self.weights.items())})"

    def position(self, name: str) -> int:
        """The ``"source"`` value of rows of source ``name``.

        Raises:
            KeyError: no such source.
        """
        if name not in self._sources:
            raise KeyError(f"no source {name!r}; sources: {list(self.names)}")
        return self.names.index(name)

    def __getitem__(self, name: str) -> Any:
        """The source called ``name``."""
        self.position(name)
        return self._sources[name]

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the shares (from the next batch on), e.g. to anneal them.

        Args:
            weights: one finite weight >= 0 per source, not all 0; normalized to sum to 1.

        Raises:
            ValueError: a missing or unknown name, or a bad value (the weights stay as they were).
        """
        if not isinstance(weights, Mapping):
            raise ValueError(f"weights must be a mapping name -> share, got {describe(weights)}")
        if set(weights) != set(self.names):
            raise ValueError(f"weights must name every source once: sources {list(self.names)}, "
                             f"weights for {list(weights)}")
        values = []
        for name in self.names:
            value = weights[name]
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not math.isfinite(value) or value < 0:
                raise ValueError(f"weights[{name!r}] must be a finite number >= 0, got {value!r}")
            values.append(float(value))
        total = math.fsum(values)
        if total <= 0:
            raise ValueError(f"weights must not all be 0, got {dict(weights)}")
        self.weights = {name: value / total for name, value in zip(self.names, values)}
        self._plans.clear()   # their counts were split by the old weights
        self._generic.clear()
        self._weights = np.array([self.weights[n] for n in self.names])

    def counts(self, batch_size: int) -> dict[str, int]:
        """Rows each source gives a batch of ``batch_size``."""
        batch_size = check_int("batch_size", batch_size, 1)
        return dict(zip(self.names, split_counts(self._weights, batch_size).tolist()))

    def sample(self, batch_size: int, **kwargs: Any) -> TensorDict:
        """A batch of ``batch_size`` rows: `counts` rows from each source, each drawn by
        that source's ``sample(count, **kwargs)``, plus ``"source"`` (int64).

        Args:
            batch_size: rows in the batch.
            kwargs: passed to every source's ``sample`` (``n_step``, ``frame_stack``,
                ``keys``, ``device``...).

        Raises:
            ValueError: a bad argument, or sources whose batches have different keys.
            EmptyStoreError: a source with a non-zero share holds nothing.
        """
        if not kwargs and self._direct:
            # Only an int finds a plan: True hashes as 1 (and 1.0 too), which the check refuses.
            plan = self._plans.get(batch_size) if type(batch_size) is int else None
            batch = plan.sample(self._pool) if plan is not None else None
            if batch is None:
                batch = self._sample_direct(check_int("batch_size", batch_size, 1))
            if batch is not None:
                return batch[torch.from_numpy(self._rng.permutation(batch_size))] if self.shuffle else batch
        counts = split_counts(self._weights, check_int("batch_size", batch_size, 1))
        self._refuse_empty(counts)
        self._check_args(counts, kwargs)
        parts = [(k, self._sources[name].sample(int(n), **kwargs))
                 for k, (name, n) in enumerate(zip(self.names, counts)) if n]
        return self._combine(parts, kwargs.get("pad"))

    def _refuse_empty(self, counts: np.ndarray) -> None:
        """Raise `EmptyStoreError` before any source draws when a source asked for rows holds none:
        the sources before it would have drawn (their generators, sample and reuse counts moved)
        for a batch that is never returned. In-process sources only (a Ray store's size is a round
        trip: its shards refuse for themselves)."""
        for name, n in zip(self.names, counts.tolist()):
            source = self._sources[name]
            if n and getattr(source, "backend", "local") == "local" and hasattr(source, "__len__") \
                    and len(source) == 0:
                raise EmptyStoreError(f"Mixture.sample: source {name!r} holds 0 transitions and its weight "
                                      f"{self.weights[name]:g} asks it for {n} rows; nothing was drawn from any "
                                      f"source: add to it first, or set_weights it to 0")

    def _check_args(self, counts: np.ndarray, kwargs: dict) -> None:
        """The options that depend on a source's schema (n-step returns need a scalar reward, ``pad``
        names ragged fields, ``keys`` names gathered fields), checked against every source asked for
        rows before any draws: a later source's refusal came after the earlier ones had drawn and
        counted their rows."""
        n_step, pad, keys = kwargs.get("n_step", 1), kwargs.get("pad"), kwargs.get("keys")
        for name, n in zip(self.names, counts.tolist()):
            schema = getattr(self._sources[name], "schema", None) if n else None
            if schema is None:
                continue
            try:
                check_sample_args(n_step, kwargs.get("gamma", 0.99), kwargs.get("frame_stack", 1),
                                  schema if n_step != 1 else None)
                check_pad(pad, schema)
                check_keys(keys, schema_keys(schema))
            except ValueError as err:
                raise ValueError(f"source {name!r}: {err}; nothing was drawn from any source") from None

    def _sample_direct(self, batch_size: int) -> TensorDict | None:
        """A batch of `arrowbuf._mixed`'s pooled path, through a new plan for ``batch_size``
        (plans are kept per batch size until `set_weights`); None where it does not apply
        (the generic path then draws it)."""
        shards = tuple(engine.shard for engine, _ in self._direct)
        if self._generic.get(batch_size) == shards:   # found not to apply, and no source changed since
            return None
        if len(self._plans) >= MAX_PLANS:
            self._plans.clear()
        counts = split_counts(self._weights, batch_size).tolist()
        plan = MixedPlan.build([(k, *self._direct[k], n) for k, n in enumerate(counts) if n])
        if plan is None:
            self._plans.pop(batch_size, None)
            self._generic[batch_size] = shards
            return None
        self._plans[batch_size] = plan
        return plan.sample(self._pool)

    def sample_iter(self, batch_size: int, **kwargs: Any) -> Iterator[TensorDict]:
        """Endless batches as `sample` gives them, drawn through each source's
        ``sample_iter`` (a Ray store keeps its requests in flight); a source's stream
        is restarted when `set_weights` changes its count.

        Raises:
            ValueError: a bad argument (checked against every source before any starts drawing).
        """
        batch_size = check_int("batch_size", batch_size, 1)
        streams: dict[int, tuple[int, Iterator[TensorDict]]] = {}
        while True:
            counts = split_counts(self._weights, batch_size)
            if any(n and streams.get(k, (0,))[0] != n for k, n in enumerate(counts.tolist())):
                self._check_args(counts, kwargs)   # before a new stream's first draw
            parts = []
            for k, (name, n) in enumerate(zip(self.names, counts.tolist())):
                if not n:
                    streams.pop(k, None)
                    continue
                if k not in streams or streams[k][0] != n:
                    streams[k] = (n, iter(self._sources[name].sample_iter(n, **kwargs)))
                parts.append((k, next(streams[k][1])))
            yield self._combine(parts, kwargs.get("pad"))

    def update_priorities(self, batch: TensorDict, priority: Any) -> dict[str, int]:
        """Send each prioritized source the priorities of its own rows of ``batch``.

        Args:
            batch: a batch of this mixture (its ``"source"`` and ``"index"``).
            priority: one priority per row (e.g. ``td_error.abs()``).

        Returns:
            Per prioritized source with rows in the batch, how many of its indices were live.

        Raises:
            ValueError: not a batch of this mixture, or ``priority`` does not have one value per row,
                or holds values a source refuses (every source's are checked before any is sent).
        """
        if not all(key in batch.keys() for key in ("source", "index")):
            raise ValueError(f"batch must be a batch of this mixture (with 'source' and 'index'), got keys "
                             f"{sorted(map(str, batch.keys()))}")
        source, index = batch["source"].cpu().numpy(), batch["index"].cpu().numpy()
        priority = real_numbers(priority, "priority").reshape(-1)
        if priority.shape[0] != source.shape[0]:
            raise ValueError(f"priority must have one value per row of the batch ({source.shape[0]}), "
                             f"got {priority.shape[0]}")
        updates = []
        for k, name in enumerate(self.names):   # every source's part checked before any is sent
            target = self._sources[name]
            sampler = getattr(target, "sampler", None)
            rows = source == k
            if isinstance(sampler, PrioritizedSampler) and rows.any():
                check_priorities(index[rows], priority[rows], sampler.alpha, sampler.eps,
                                 getattr(target, "capacity", None) or max(len(target), 1))
                updates.append((name, target, rows))
        return {name: target.update_priorities(index[rows], priority[rows]) for name, target, rows in updates}

    def _combine(self, parts: list[tuple[int, TensorDict]], pad: Any = None) -> TensorDict:
        """One batch of the sources' batches, rows in order, with ``"source"``: ragged fields
        joined into one jagged tensor, text fields into one NonTensorStack, and fields padded
        by ``pad`` (``sample(pad=...)``) padded on to the longest row of the whole batch."""
        leaves = [_leaves(part) for _, part in parts]
        first, sizes = parts[0][1], [part.shape[0] for _, part in parts]
        if pad:
            _pad_on(leaves, pad)
        if all(leaf.keys() == leaves[0].keys() for leaf in leaves):   # sources of one schema and sampler
            tensors = {key: _join([leaf[key] for leaf in leaves]) for key in leaves[0]} if len(parts) > 1 \
                else dict(leaves[0])
        else:
            tensors = self._union(leaves, sizes)
        inner = tuple(first.batch_size[1:])
        source = np.repeat(np.array([k for k, _ in parts], np.int64), sizes)
        source = torch.from_numpy(source.reshape(-1, *([1] * len(inner)))).expand(-1, *inner) if inner \
            else torch.from_numpy(source)
        tensors[("source",)] = source.to(first.device) if first.device is not None else source
        apart = {key: value for key, value in tensors.items() if _is_apart(value)}
        if self.shuffle:
            order = self._rng.permutation(sum(sizes))
            tensors = {key: _take_apart(value, order) if key in apart else value[torch.from_numpy(order)]
                       for key, value in tensors.items()}
            apart = {key: tensors[key] for key in apart}
        batch = make_tensordict({k: v for k, v in tensors.items() if k not in apart}, (sum(sizes), *inner),
                                first.device)
        for key, value in apart.items():
            batch.set(key, value)
        return batch

    @staticmethod
    def _union(leaves: list[dict], sizes: list[int]) -> dict:
        """The concatenated leaves of batches whose keys differ only by `_FILLED` ones.

        Raises:
            ValueError: another key is in some of the batches only.
        """
        sets = [set(leaf) for leaf in leaves]
        common = set.intersection(*sets)
        extra = set.union(*sets) - common
        unfilled = sorted(key for key in extra if key[-1] not in _FILLED or len(key) > 1)
        if unfilled:
            raise ValueError(f"the sources' batches have different keys: {unfilled} are in some only; give them "
                             "the same fields (or pass keys=[...] naming common ones)")
        tensors = {}
        for key in [*leaves[0], *sorted(extra - sets[0])]:
            like = next(leaf[key] for leaf in leaves if key in leaf)
            pieces = [leaf[key] if key in leaf else
                      torch.full((size, *like.shape[1:]), _FILLED[key[-1]], dtype=like.dtype, device=like.device)
                      for leaf, size in zip(leaves, sizes)]
            tensors[key] = _join(pieces)
        return tensors


def _leaves(td: TensorDict, prefix: tuple = ()) -> dict[tuple, torch.Tensor]:
    """The leaves of a (nested) TensorDict by key path: ``keys(include_nested=True)`` and a
    ``get`` per key cost ~4x this walk over its items."""
    out = {}
    for key, value in td.items():
        if isinstance(value, TensorDict):
            out.update(_leaves(value, (*prefix, key)))
        else:
            out[(*prefix, key)] = value
    return out


def _is_apart(value: Any) -> bool:
    """A ragged field's jagged nested tensor or a text field's NonTensorStack."""
    return not isinstance(value, torch.Tensor) or value.is_nested


def _join(values: list) -> Any:
    """The sources' values of one key, rows in order: tensors concatenated, jagged tensors
    joined on their values (``torch.cat`` does not take them), text stacks as one list."""
    first = values[0]
    if isinstance(first, torch.Tensor) and not first.is_nested:
        return torch.cat(values)
    if isinstance(first, torch.Tensor):
        offsets = [first.offsets().cpu().numpy()]
        for value in values[1:]:
            offsets.append(value.offsets().cpu().numpy()[1:] + offsets[-1][-1])
        return _jagged_like(first, torch.cat([v.values() for v in values]), np.concatenate(offsets))
    from tensordict import NonTensorStack

    return NonTensorStack.from_list([s for v in values for s in v.tolist()])


def _take_apart(value: Any, order: np.ndarray) -> Any:
    """Rows ``order`` of a jagged tensor (its values gathered once) or of a text stack."""
    if isinstance(value, torch.Tensor):
        offsets = value.offsets().cpu().numpy()
        # where each taken row's values lie, and the new offsets (`RaggedRows` of the value positions)
        at = RaggedRows(np.arange(int(offsets[-1])), offsets)[order]
        return _jagged_like(value, value.values()[torch.from_numpy(at.values).to(value.device)], at.offsets)
    from tensordict import NonTensorStack

    texts = value.tolist()
    return NonTensorStack.from_list([texts[i] for i in order.tolist()])


def _jagged_like(like: Any, values: Any, offsets: np.ndarray) -> Any:
    """A jagged tensor of ``values`` and ``offsets`` on ``like``'s device, its longest and shortest
    row recorded as a store's batch records them (`arrowbuf.ragged.jagged`: padding reads them)."""
    lengths = np.diff(offsets)
    return jagged(values, torch.from_numpy(np.ascontiguousarray(offsets, np.int64)).to(like.device),
                  int(lengths.max(initial=0)), int(lengths.min(initial=0)))


def _pad_on(leaves: list[dict], pad: Mapping) -> None:
    """Pad each padded field (``pad``'s keys) of the sources' batches on, with its pad value,
    to the widest of them: each source padded to its own longest row."""
    for name, value in pad.items():
        key = tuple(name.split("."))
        found = [leaf.get(key) for leaf in leaves]
        if any(v is None or not isinstance(v, torch.Tensor) or v.ndim < 2 for v in found):
            continue
        width = max(v.shape[1] for v in found)
        for leaf, v in zip(leaves, found):
            if v.shape[1] < width:
                filler = torch.full((v.shape[0], width - v.shape[1], *v.shape[2:]), value, dtype=v.dtype,
                                    device=v.device)
                leaf[key] = torch.cat([v, filler], dim=1)
