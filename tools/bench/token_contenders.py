"""TOKENS' data and contenders: token sequences of lognormal lengths, an arrowbuf store of them,
the ideal gather, and TorchRL's two storages that hold tensors of varying shapes.

- `Tokens`: every row's int32 tokens in one flat array with its offsets (Arrow's list layout);
  lengths lognormal (median 600, sigma 0.8: mean ~826), at least 1; values uniform in a
  32k vocabulary. `episode_rows` makes one episode's rows on the fly, for a store filled
  without holding the source (the memory probe).
- `TokenStore`: ``ExperienceStore`` whose one field is ``Field("int32", (None,))``, filled by
  ``add_episode({"tokens": [one array per step]})``; ``sample(B)`` gives a jagged nested tensor.
- `IdealGather`: the floor of a jagged batch: B uniform rows of the flat array (or a rank's
  share of a global batch), their offsets by cumsum, their values copied by one
  ``np.concatenate`` of their slices into a preallocated, pre-touched buffer (the fastest of a
  loop of slice copies, ``np.take`` of a repeated index and this), wrapped by
  ``torch.nested.nested_tensor_from_jagged``. The padded floor fills a preallocated
  ``[B, L_max]`` with the pad value and copies each row into it.
- `TorchRLList`: ``ReplayBuffer(ListStorage(n), RandomSampler())`` of per-row tensors, the batch
  (a list of tensors) made a jagged tensor by ``torch.nested.as_nested_tensor(rows,
  layout=torch.jagged)``, or padded by ``torch.nn.utils.rnn.pad_sequence``.
- `TorchRLStack`: ``ReplayBuffer(LazyStackStorage(n))`` of per-row TensorDicts, the sample a
  ``LazyStackedTensorDict`` read by ``get("tokens", as_nested_tensor=True, layout=torch.jagged)``
  (or ``as_padded_tensor=True``). ``LazyTensorStorage`` cannot hold a jagged field: its
  preallocated storage refuses the first write (``index_put_`` on a jagged tensor).
"""

from __future__ import annotations

from typing import Any

import numpy as np

VOCAB = 32_000
MEDIAN, SIGMA = 600, 0.8


def lognormal_lengths(rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` sequence lengths (int64, >= 1): lognormal, median `MEDIAN`, sigma `SIGMA`."""
    return np.maximum(1, np.rint(rng.lognormal(np.log(MEDIAN), SIGMA, n))).astype(np.int64)


def episode_rows(rng: np.random.Generator, steps: int) -> list[np.ndarray]:
    """One episode's rows: ``steps`` int32 arrays of lognormal lengths (views of one draw)."""
    lengths = lognormal_lengths(rng, steps)
    values = rng.integers(0, VOCAB, int(lengths.sum()), dtype=np.int32)
    return np.split(values, np.cumsum(lengths)[:-1])


class Tokens:
    """``rows`` rows of tokens: ``values`` (int32, every row one after another) and ``offsets``."""

    def __init__(self, rows: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.lengths = lognormal_lengths(rng, rows)   # kept: the ideal's split reads them every global batch
        self.offsets = np.zeros(rows + 1, np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])
        self.values = rng.integers(0, VOCAB, int(self.offsets[-1]), dtype=np.int32)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, first: int, count: int) -> list[np.ndarray]:
        """Rows ``[first, first + count)`` as views, one per step."""
        bounds = self.offsets[first:first + count + 1]
        return np.split(self.values[bounds[0]:bounds[-1]], bounds[1:-1] - bounds[0])

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]


class TokenStore:
    """An arrowbuf store of ``capacity`` rows of one ragged int32 field, ``tokens``."""

    def __init__(self, capacity: int) -> None:
        import arrowbuf as ab

        self.store = ab.ExperienceStore(capacity, seed=0, schema={"tokens": ab.Field("int32", (None,))})
        self.first_row: dict[int, int] = {}   # episode id -> the source row of its step 0

    def add(self, rows: list[np.ndarray], first: int = -1) -> None:
        """One episode of ``rows`` (one array a step); ``first``: the source row of its step 0."""
        self.first_row[self.store.add_episode({"tokens": rows})] = first

    def fill(self, tokens: Tokens, episode_len: int) -> None:
        """Every row of ``tokens``, in episodes of ``episode_len`` steps."""
        for first in range(0, len(tokens), episode_len):
            self.add(tokens.rows(first, min(episode_len, len(tokens) - first)), first)

    def sample(self, batch_size: int, pad: int | None = None) -> Any:
        return self.store.sample(batch_size, pad=None if pad is None else {"tokens": pad})

    @property
    def column(self) -> Any:
        """The ``tokens`` column of the store's one shard (an `arrowbuf.ragged.RaggedColumn`)."""
        return self.store.engine.shard.arena["tokens"]

    def source_rows(self, batch: Any) -> np.ndarray:
        """The source rows a batch's rows were written from, by ``episode_id`` and ``step``."""
        firsts = np.array([self.first_row[e] for e in batch["episode_id"].tolist()], np.int64)
        return firsts + batch["step"].numpy()


class IdealGather:
    """Rows of ``tokens`` copied into a preallocated buffer (reused by every call): B uniform rows
    a `sample`, or given rows (`take`: a rank's share)."""

    def __init__(self, tokens: Tokens, batch_size: int, seed: int = 1) -> None:
        longest = int(tokens.lengths.max())
        self.tokens, self.batch_size = tokens, batch_size
        self.out = np.zeros(batch_size * longest, np.int32)   # pre-touched: the most a batch can hold
        self.rng = np.random.default_rng(seed)

    def draw(self) -> np.ndarray:
        """B rows, uniformly with replacement."""
        return self.rng.integers(0, len(self.tokens), self.batch_size)

    def sample(self) -> Any:
        """A jagged nested tensor of B random rows."""
        return self.take(self.draw())

    def take(self, rows: np.ndarray) -> Any:
        """A jagged nested tensor of ``rows`` (in a new buffer where they outgrow the preallocated one)."""
        import torch

        starts, ends = self.tokens.offsets[rows], self.tokens.offsets[rows + 1]
        lengths = ends - starts
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values, total = self.tokens.values, int(offsets[-1])
        out = self.out[:total] if total <= len(self.out) else np.empty(total, np.int32)
        np.concatenate([values[a:b] for a, b in zip(starts.tolist(), ends.tolist())], out=out)
        return torch.nested.nested_tensor_from_jagged(torch.from_numpy(out), offsets=torch.from_numpy(offsets),
                                                      max_seqlen=int(lengths.max()))

    def padded(self, pad: int) -> tuple[Any, Any]:
        """B random rows as ``[B, L_max]`` padded with ``pad``, and their lengths."""
        import torch

        rows = self.draw()
        starts, ends = self.tokens.offsets[rows], self.tokens.offsets[rows + 1]
        lengths = ends - starts
        longest = int(lengths.max())
        out = self.out[:self.batch_size * longest].reshape(self.batch_size, longest)
        out.fill(pad)
        values = self.tokens.values
        for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            out[i, :b - a] = values[a:b]
        return torch.from_numpy(out), torch.from_numpy(lengths)


class TorchRLList:
    """``ReplayBuffer(ListStorage(n), RandomSampler())`` of the first ``n`` rows, own tensors each."""

    def __init__(self, tokens: Tokens, rows: int, batch_size: int) -> None:
        import logging

        import torch
        from torchrl.data import ListStorage, RandomSampler, ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.rb = ReplayBuffer(storage=ListStorage(rows), sampler=RandomSampler(), batch_size=batch_size,
                               collate_fn=list)
        self.rb.extend([torch.from_numpy(row.copy()) for row in tokens.rows(0, rows)])

    def __len__(self) -> int:
        return len(self.rb)

    def sample(self) -> Any:
        import torch

        return torch.nested.as_nested_tensor(self.rb.sample(), layout=torch.jagged)

    def padded(self, pad: int) -> tuple[Any, Any]:
        import torch

        rows = self.rb.sample()
        return (torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad),
                torch.tensor([len(r) for r in rows]))


class TorchRLStack:
    """``ReplayBuffer(LazyStackStorage(n))`` of the first ``n`` rows, a TensorDict (own tensor) each."""

    def __init__(self, tokens: Tokens, rows: int, batch_size: int) -> None:
        import logging

        import torch
        from tensordict import TensorDict
        from torchrl.data import LazyStackStorage, RandomSampler, ReplayBuffer

        logging.getLogger("torchrl").setLevel(logging.WARNING)
        self.rb = ReplayBuffer(storage=LazyStackStorage(rows), sampler=RandomSampler(), batch_size=batch_size)
        self.rb.extend([TensorDict({"tokens": torch.from_numpy(row.copy())}, batch_size=[])
                        for row in tokens.rows(0, rows)])

    def __len__(self) -> int:
        return len(self.rb)

    def sample(self) -> Any:
        import torch

        return self.rb.sample().get("tokens", as_nested_tensor=True, layout=torch.jagged)

    def padded(self, pad: int) -> Any:
        return self.rb.sample().get("tokens", as_padded_tensor=True, padding_value=pad)
