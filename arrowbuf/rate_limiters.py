"""Rate limiters: when sampling and inserting may proceed (in the spirit of Reverb).

A limiter is configuration: given the transitions inserted and sampled so far
(`Counts`, kept by the shard engine that counts them), it answers two questions:
may a batch of n be sampled now, and may n more transitions be inserted now. The
store raises `RateLimited` when the answer is no, or waits up to ``timeout``
seconds for another thread to change it. A Ray store applies its limiter to each
shard with that shard's counts, as Reverb does for a table on several servers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from arrowbuf._checks import check_int, is_int


@dataclass
class Counts:
    """Transitions inserted into and sampled from one shard engine."""

    inserts: int = 0
    samples: int = 0

    def add(self, inserts: int = 0, samples: int = 0) -> None:
        """Count ``inserts`` more transitions written and ``samples`` more drawn."""
        self.inserts += inserts
        self.samples += samples


class RateLimiter:
    """The base class allows everything."""

    def can_sample(self, n: int, size: int, counts: Counts) -> bool:
        return True

    def can_insert(self, n: int, counts: Counts) -> bool:
        return True

    def why_not_sample(self, n: int, size: int, counts: Counts, where: str = "the store") -> str:
        """Why a sample of ``n`` from a store of ``size`` transitions waits: a sentence
        whose subject is ``where`` ("the store", or on Ray the shard that applies it)."""
        return ""

    def why_not_insert(self, n: int, counts: Counts, where: str = "the store") -> str:
        """Why an insert of ``n`` transitions waits: a sentence."""
        return ""

    def state(self, counts: Counts) -> dict:
        return {"type": type(self).__name__, "inserts": counts.inserts, "samples": counts.samples}

    def config(self) -> dict:
        """The constructor arguments that rebuild this limiter (JSON values)."""
        return {}

    def state_dict(self, counts: Counts) -> dict:
        """Type, `config` and the counters it was judging."""
        return {"type": type(self).__name__, "config": self.config(), "inserts": counts.inserts,
                "samples": counts.samples}

    def counts_of(self, state: dict) -> Counts:
        """The counters of a `state_dict` saved by a limiter of this type and configuration.

        Raises:
            ValueError: the state is of another limiter type or configuration, or
                its counters are not ints >= 0.
        """
        if state.get("type") != type(self).__name__ or dict(state.get("config", {})) != self.config():
            raise ValueError(f"rate limiter state of {state.get('type')}({state.get('config')}) cannot be "
                             f"loaded into {type(self).__name__}({self.config()})")
        inserts, samples = state["inserts"], state["samples"]
        if not all(is_int(c, 0) for c in (inserts, samples)):
            raise ValueError(f"rate limiter counters must be ints >= 0, got inserts={inserts!r}, samples={samples!r}")
        return Counts(inserts, samples)


def scope(shard: int, num_shards: int) -> str:
    """What a shard's limiter counts cover, for its messages: the store, or (on Ray) the shard."""
    if num_shards == 1:
        return "the store"
    return (f"shard {shard} of {num_shards} (each shard applies its own copy of the rate limiter to its own "
            "transitions and counts)")


def limits(rate_limiter: RateLimiter) -> bool:
    """Whether ``rate_limiter`` can make calls wait (the base class never does, and only
    counts): its engine waits on a condition, and its Ray shards are threaded."""
    return type(rate_limiter) is not RateLimiter


class MinSize(RateLimiter):
    """Sampling waits until the store holds at least ``min_size`` transitions.

    Args:
        min_size: transitions needed before the first sample (>= 1).

    Raises:
        ValueError: min_size < 1.

    Example:
        >>> import arrowbuf as ab
        >>> store = ab.ExperienceStore(capacity=1000, rate_limiter=ab.MinSize(100))
    """

    def __init__(self, min_size: int) -> None:
        self.min_size = check_int("min_size", min_size, 1)

    def can_sample(self, n: int, size: int, counts: Counts) -> bool:
        return size >= self.min_size

    def why_not_sample(self, n: int, size: int, counts: Counts, where: str = "the store") -> str:
        return (f"Cannot sample {n} transitions yet: {where} holds {size} transitions, MinSize needs "
                f"{self.min_size} before the first sample. Add episodes first, or pass timeout= to wait for writers.")

    def state(self, counts: Counts) -> dict:
        return {**super().state(counts), "min_size": self.min_size}

    def config(self) -> dict:
        return {"min_size": self.min_size}


class SampleToInsertRatio(RateLimiter):
    """Keeps sampled transitions per inserted transition near ``samples_per_insert``.

    With ``offset = samples_per_insert * min_size``, the quantity
    ``diff = inserts * samples_per_insert - samples`` is kept within
    ``[offset - error_buffer, offset + error_buffer]``: sampling waits when
    trainers run ahead of the actors, inserting waits when they fall behind. Both
    checks look at the state before the call, so one batch or one episode can
    overshoot the bound (whole episodes are never split, and a batch larger than
    the buffer never deadlocks).

    Args:
        samples_per_insert: target sampled / inserted transitions (> 0).
        min_size: transitions inserted before the first sample (>= 1).
        error_buffer: slack around the target, in sampled transitions (>= 0).

    Raises:
        ValueError: a bad argument.

    Example:
        >>> import arrowbuf as ab
        >>> limiter = ab.SampleToInsertRatio(samples_per_insert=8.0, min_size=1000, error_buffer=4096)
    """

    def __init__(self, samples_per_insert: float, min_size: int, error_buffer: float) -> None:
        if not (math.isfinite(samples_per_insert) and samples_per_insert > 0):
            raise ValueError(f"samples_per_insert must be a finite number > 0, got {samples_per_insert!r}")
        min_size = check_int("min_size", min_size, 1)
        if not (math.isfinite(error_buffer) and error_buffer >= 0):
            raise ValueError(f"error_buffer must be a finite number >= 0, got {error_buffer!r}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size = min_size
        self.error_buffer = float(error_buffer)
        offset = self.samples_per_insert * min_size
        self.min_diff = offset - self.error_buffer
        self.max_diff = offset + self.error_buffer

    def _diff(self, counts: Counts) -> float:
        return counts.inserts * self.samples_per_insert - counts.samples

    def can_sample(self, n: int, size: int, counts: Counts) -> bool:
        return counts.inserts >= self.min_size and self._diff(counts) >= self.min_diff

    def can_insert(self, n: int, counts: Counts) -> bool:
        # Inserts are always allowed before min_size is reached, else sampling could never start.
        return counts.inserts < self.min_size or self._diff(counts) <= self.max_diff

    def why_not_sample(self, n: int, size: int, counts: Counts, where: str = "the store") -> str:
        if counts.inserts < self.min_size:
            return (f"Cannot sample {n} transitions yet from {where}: {counts.inserts} transitions inserted, "
                    f"SampleToInsertRatio "
                    f"needs min_size={self.min_size} before the first sample. Insert more, or pass timeout= to wait "
                    "for writers.")
        return (f"Cannot sample {n} transitions: samples ({counts.samples}) are too far ahead of inserts "
                f"({counts.inserts}) in {where} for samples_per_insert={self.samples_per_insert}, "
                f"error_buffer={self.error_buffer} (inserts x samples_per_insert - samples = "
                f"{self._diff(counts):g} must stay >= {self.min_diff:g}). Insert more, or pass timeout= to wait for "
                "writers.")

    def why_not_insert(self, n: int, counts: Counts, where: str = "the store") -> str:
        return (f"Cannot insert {n} transitions: inserts ({counts.inserts}) are too far ahead of samples "
                f"({counts.samples}) in {where} for samples_per_insert={self.samples_per_insert}, "
                f"error_buffer={self.error_buffer} (inserts x samples_per_insert - samples = "
                f"{self._diff(counts):g} must stay <= {self.max_diff:g}). Sample more, or pass timeout= to wait for "
                "trainers.")

    def state(self, counts: Counts) -> dict:
        return {**super().state(counts), "samples_per_insert": self.samples_per_insert, "min_size": self.min_size,
                "error_buffer": self.error_buffer, "diff": self._diff(counts)}

    def config(self) -> dict:
        return {"samples_per_insert": self.samples_per_insert, "min_size": self.min_size,
                "error_buffer": self.error_buffer}
