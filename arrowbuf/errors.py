"""The errors arrowbuf raises.

Every error says which argument or field was wrong, the value received and what
was expected. A failed call leaves the store as it was before the call.
"""


class ArrowbufError(Exception):
    """Base class of every arrowbuf error."""


class SchemaError(ArrowbufError, ValueError):
    """Data does not match the store's schema (field name, dtype, shape or length)."""


class CapacityError(ArrowbufError):
    """An episode does not fit: longer than the capacity, or a full `mode="fixed"` store.

    ``retryable`` is True when the same episode could fit later (a full fixed
    store that is cleared), False when it never can (longer than the capacity).
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class ResourceError(CapacityError):
    """A request the store or the machine cannot serve, refused before any work is done.

    An arena that does not fit in the memory available, or a batch too large to
    gather (`arrowbuf._bounds`). The message names the request, the bytes it needs,
    the bytes available and the largest request that fits.
    """


class EmptyStoreError(ArrowbufError):
    """Sampling from a store that holds no transitions."""


class RateLimited(ArrowbufError):
    """A sample or insert would break the store's rate limiter."""


class ShardError(ArrowbufError):
    """A shard of a distributed store failed or is unreachable."""


class WriterClosedError(ArrowbufError, RuntimeError):
    """A step writer used after `close` (or after its ``with`` block): nothing is written.

    A closed local writer's rows belong to the writers opened after it, so a stale
    reference must never write again; open a new writer with ``store.writer(...)``.
    """


class ObservationMismatchError(ArrowbufError, ValueError):
    """A writer step whose ``obs`` differs from the env's last ``next_obs`` mid-episode.

    A writer stores each observation once: observation t + 1 is the ``next_obs`` of
    step t. A different ``obs`` would replace one of the two, so the step is refused
    (nothing of it is recorded); the message names the env, the step and the fix.
    """


class InUseError(ArrowbufError, ValueError):
    """A name or durable directory is held by another running store.

    A durable directory is locked (``fcntl.flock``) by the process that writes it
    and released by the OS when that process ends, however it ends. The message
    names the holder (pid, host) and what to do.
    """


class FormatError(ArrowbufError, ValueError):
    """A file or directory is not a (complete, readable) arrowbuf export or checkpoint.

    The message names the file and what is wrong with it: missing, truncated, of
    another schema, or written by a newer arrowbuf.
    """


def refused_in_batch(refused: list[Exception], total: int, where: str) -> Exception:
    """The first of a write's refused episodes' errors, saying how many of the ``total``
    were refused (dropped) and that the others were stored (``where``: "shard 1", ...); the
    error as it is when the write was of that one episode."""
    err = refused[0]
    if total == 1:
        return err
    err.args = (f"{err.args[0] if err.args else err} [{where} refused {len(refused)} of the {total} episodes of "
                "this write (they are dropped); it stored the others]", *err.args[1:])
    return err


def describe(value: object) -> str:
    """A short, readable description of a bad value for an error message."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(value).__name__} of dtype {dtype} and shape {tuple(shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
