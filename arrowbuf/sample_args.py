"""`SampleArgs`: what a sample looks up beyond its drawn rows (n-step returns, stacked frames).

One small frozen value, checked once by the store facade (`arrowbuf._checks.check_sample_args`)
and handed unchanged to every layer that draws or gathers: the engine, a Ray shard's
`select`, the reader's staging, the n-step and frame look-ups (`arrowbuf.indexing`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SampleArgs:
    """A sample's look-ups: ``n_step`` rewards discounted by ``gamma``, ``frame_stack`` frames.

    Example:
        >>> SampleArgs(3, 0.99).plain, PLAIN.plain
        (False, True)
    """

    n_step: int = 1
    gamma: float = 1.0
    frame_stack: int = 1

    @property
    def plain(self) -> bool:
        """No look-up: the drawn rows, their next rows, one frame."""
        return self.n_step == 1 and self.frame_stack == 1


#: A plain sample's arguments (gamma is unused, hence 1.0).
PLAIN = SampleArgs()
