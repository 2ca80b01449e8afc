"""Data shapes of the replay workloads and the synthetic episodes they are filled with."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np


@dataclass(frozen=True)
class FieldSpec:
    """One column: dtype, per-row shape, and whether it is an observation (T + 1 rows)."""

    dtype: str
    shape: tuple[int, ...] = ()
    observation: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype of the column (bfloat16, which numpy lacks: its uint16 bits)."""
        return np.dtype("uint16" if self.dtype == "bfloat16" else self.dtype)

    @property
    def row_bytes(self) -> int:
        return int(self.numpy_dtype.itemsize * math.prod(self.shape))


def describe_fields(fields: Mapping[str, FieldSpec]) -> str:
    """``"obs float32[17], action float32[6], ..."``."""
    return ", ".join(f"{n} {f.dtype}{list(f.shape) if f.shape else ''}" for n, f in fields.items())


@dataclass(frozen=True)
class ReplaySpec:
    """A uniform-replay workload: whole episodes in, uniform batches out."""

    fields: Mapping[str, FieldSpec]
    capacity: int            # rows (arrowbuf, ideal) / transitions (torchrl)
    episode_len: int         # T transitions; observation fields get T + 1 rows
    batch_size: int
    source_episodes: int = 4  # distinct episodes generated, then cycled

    @property
    def row_bytes(self) -> int:
        return sum(f.row_bytes for f in self.fields.values())

    def short(self) -> str:
        return (f"capacity {self.capacity:,}, episodes of {self.episode_len:,} steps, "
                f"batch {self.batch_size}, {self.row_bytes:,} B/row")

    def describe(self) -> str:
        return (f"{describe_fields(self.fields)}; capacity {self.capacity:,}; episodes of {self.episode_len:,} steps "
                f"(+ final obs); batch {self.batch_size}; {self.row_bytes:,} B/row")


def make_episodes(spec: ReplaySpec, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Distinct source episodes: observation fields with T + 1 rows, others T."""
    rng = np.random.default_rng(seed)
    T = spec.episode_len
    episodes = []
    for _ in range(spec.source_episodes):
        ep = {}
        for name, f in spec.fields.items():
            shape = (T + 1 if f.observation else T, *f.shape)
            if f.dtype == "bool":
                ep[name] = np.zeros(shape, bool)
                if name == "terminated":
                    ep[name][-1] = True
            elif np.issubdtype(np.dtype(f.dtype), np.floating):
                ep[name] = rng.standard_normal(shape, dtype=np.dtype(f.dtype))
            else:
                info = np.iinfo(np.dtype(f.dtype))
                ep[name] = rng.integers(max(info.min, 0), min(info.max, 255) + 1, shape, dtype=np.dtype(f.dtype))
        episodes.append(ep)
    return episodes


def rows_text(n: int) -> str:
    """``1000000`` -> ``"1M"``, ``100000`` -> ``"100k"``."""
    return f"{n / 10**6:g}M" if n >= 10**6 else f"{n / 10**3:g}k"


W1_FIELDS = {
    "obs": FieldSpec("float32", (17,), observation=True),
    "action": FieldSpec("float32", (6,)),
    "reward": FieldSpec("float32"),
    "terminated": FieldSpec("bool"),
    "truncated": FieldSpec("bool"),
}
W2_FIELDS = {
    "obs": FieldSpec("uint8", (84, 84, 3), observation=True),
    "action": FieldSpec("int64"),
    "reward": FieldSpec("float32"),
    "terminated": FieldSpec("bool"),
    "truncated": FieldSpec("bool"),
}
SMALL_FIELDS = {
    "obs": FieldSpec("float32", (4,), observation=True),
    "action": FieldSpec("int8"),
    "reward": FieldSpec("float32"),
    "terminated": FieldSpec("bool"),   # a store refuses episodes without terminal flags unless told
    "truncated": FieldSpec("bool"),
}


def w1(capacity: int, batch_size: int = 256) -> ReplaySpec:
    """W1's state rows: episodes of 1,000 steps."""
    return ReplaySpec(W1_FIELDS, capacity=capacity, episode_len=1000, batch_size=batch_size)


def w2(capacity: int) -> ReplaySpec:
    """W2's pixel rows: episodes of 500 steps, batches of 32."""
    return ReplaySpec(W2_FIELDS, capacity=capacity, episode_len=500, batch_size=32)
