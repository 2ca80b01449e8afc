"""Rate limiters: when sampling and inserting may proceed (in the spirit of Reverb).

A limiter counts transitions inserted and sampled and answers two questions:
may a batch of n be sampled now, and may n more transitions be inserted now. The
store raises `RateLimited` when the answer is no, or waits up to ``timeout``
seconds for another thread to change it.
"""

from __future__ import annotations

import math


class RateLimiter:
    """Counts inserts and samples; the base class allows everything."""

    def __init__(self) -> None:
        self.inserts = 0
        self.samples = 0

    def can_sample(self, n: int, size: int) -> bool:
        return True

    def can_insert(self, n: int) -> bool:
        return True

    def why_not_sample(self, n: int, size: int) -> str:
        """Why a sample of ``n`` from a store of ``size`` transitions waits: a sentence."""
        return ""

    def why_not_insert(self, n: int) -> str:
        """Why an insert of ``n`` transitions waits: a sentence."""
        return ""

    def state(self) -> dict:
        return {"type": type(self).__name__, "inserts": self.inserts, "samples": self.samples}

    def config(self) -> dict:
        """The constructor arguments that rebuild this limiter (JSON values)."""
        return {}

    def state_dict(self) -> dict:
        """Type, `config` and the insert / sample counters."""
        return {"type": type(self).__name__, "config": self.config(), "inserts": self.inserts,
                "samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters of a `state_dict` into a limiter built from its ``config``.

        Raises:
            ValueError: the state is of another limiter type or configuration.
        """
        if state.get("type") != type(self).__name__ or dict(state.get("config", {})) != self.config():
            raise ValueError(f"rate limiter state of {state.get('type')}({state.get('config')}) cannot be "
                             f"loaded into {type(self).__name__}({self.config()})")
        self.inserts, self.samples = int(state["inserts"]), int(state["samples"])


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
        super().__init__()
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
        self.min_size = min_size

    def can_sample(self, n: int, size: int) -> bool:
        return size >= self.min_size

    def why_not_sample(self, n: int, size: int) -> str:
        return (f"Cannot sample {n} transitions yet: the store holds {size} transitions, MinSize needs "
                f"{self.min_size} before the first sample. Add episodes first, or pass timeout= to wait for writers.")

    def state(self) -> dict:
        return {**super().state(), "min_size": self.min_size}

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
        super().__init__()
        if not (math.isfinite(samples_per_insert) and samples_per_insert > 0):
            raise ValueError(f"samples_per_insert must be a finite number > 0, got {samples_per_insert!r}")
        if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 1:
            raise ValueError(f"min_size must be an int >= 1, got {min_size!r}")
        if not (math.isfinite(error_buffer) and error_buffer >= 0):
            raise ValueError(f"error_buffer must be a finite number >= 0, got {error_buffer!r}")
        self.samples_per_insert = float(samples_per_insert)
        self.min_size = min_size
        self.error_buffer = float(error_buffer)
        offset = self.samples_per_insert * min_size
        self.min_diff = offset - self.error_buffer
        self.max_diff = offset + self.error_buffer

    def _diff(self) -> float:
        return self.inserts * self.samples_per_insert - self.samples

    def can_sample(self, n: int, size: int) -> bool:
        return self.inserts >= self.min_size and self._diff() >= self.min_diff

    def can_insert(self, n: int) -> bool:
        # Inserts are always allowed before min_size is reached, else sampling could never start.
        return self.inserts < self.min_size or self._diff() <= self.max_diff

    def why_not_sample(self, n: int, size: int) -> str:
        if self.inserts < self.min_size:
            return (f"Cannot sample {n} transitions yet: {self.inserts} transitions inserted, SampleToInsertRatio "
                    f"needs min_size={self.min_size} before the first sample. Insert more, or pass timeout= to wait "
                    "for writers.")
        return (f"Cannot sample {n} transitions: samples ({self.samples}) are too far ahead of inserts "
                f"({self.inserts}) for samples_per_insert={self.samples_per_insert}, "
                f"error_buffer={self.error_buffer} (inserts x samples_per_insert - samples = {self._diff():g} "
                f"must stay >= {self.min_diff:g}). Insert more, or pass timeout= to wait for writers.")

    def why_not_insert(self, n: int) -> str:
        return (f"Cannot insert {n} transitions: inserts ({self.inserts}) are too far ahead of samples "
                f"({self.samples}) for samples_per_insert={self.samples_per_insert}, "
                f"error_buffer={self.error_buffer} (inserts x samples_per_insert - samples = {self._diff():g} "
                f"must stay <= {self.max_diff:g}). Sample more, or pass timeout= to wait for trainers.")

    def state(self) -> dict:
        return {**super().state(), "samples_per_insert": self.samples_per_insert, "min_size": self.min_size,
                "error_buffer": self.error_buffer, "diff": self._diff()}

    def config(self) -> dict:
        return {"samples_per_insert": self.samples_per_insert, "min_size": self.min_size,
                "error_buffer": self.error_buffer}
