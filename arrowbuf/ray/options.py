"""`RayOptions`, the layout of a Ray store's indices, and the lazy ``import ray``.

Nothing here imports Ray: `arrowbuf` exports `RayOptions` without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from arrowbuf._checks import check_bool, check_int
from arrowbuf.errors import describe

NAMESPACE = "arrowbuf"               # default Ray namespace of the named shard actors (RayOptions.namespace)
INDEX_SHIFT = 48                     # a batch's "index" = shard << 48 | local index
LOCAL_MASK = (1 << INDEX_SHIFT) - 1


def ray_module() -> Any:
    """The ``ray`` module, imported now.

    Raises:
        ImportError: Ray is not installed (with the install hint).
    """
    try:
        import ray
    except ImportError:
        raise ImportError("backend='ray' needs Ray: pip install 'arrowbuf[ray]'") from None
    return ray


def _check_seconds(name: str, value: Any, zero_ok: bool, finite: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
            or not (value >= 0 if zero_ok else value > 0) or (finite and math.isinf(value)):
        raise ValueError(f"RayOptions.{name} must be a {'finite ' if finite else ''}number "
                         f"{'>= 0' if zero_ok else '> 0'}, got {value!r}")
    return float(value)


@dataclass
class RayOptions:
    """How shard actors are started and how writers reach them.

    Attributes:
        num_cpus: CPUs each shard actor reserves (default 0: shards are mostly idle
            between requests and must not starve the env runners of CPUs).
        max_in_flight: unanswered writes per shard and writer before a write waits.
        nodes: node ids to place shards on (round robin, hard affinity); None lets
            Ray spread them.
        node_affinity: writers send an env's episodes to a shard on their own node
            when there is one.
        allow_partial: `len` and `sample` skip dead shards instead of raising
            (every call raises `ShardError` otherwise, until `close`). A request that
            a shard dies answering is drawn again from the survivors; a write it
            took raises `ShardError` at the writer's next call or `flush`.
        write_batch_bytes: episodes smaller than this are copied and sent together
            once this many bytes are waiting, or once the oldest has waited
            ``delivery_latency``: each Ray call has a fixed cost of about a
            millisecond, so small episodes travel in batches.
        delivery_latency: seconds a writer's finished episode may wait before it
            is sent to its shard without `flush` (a timer thread per writer sends
            it); also how often that thread checks the answers, so that a dead
            shard is reported at the writer's next call.
        size_refresh: seconds after which `ExperienceStore.cached_size` asks the
            shards for their sizes again, in the background (it never waits for
            them; `len(store)` and ``num_episodes`` ask them and wait).
        start_timeout: seconds to wait for the shard actors to start (they wait for
            ``num_cpus`` free CPUs) before `ShardError`.
        max_restarts: times Ray restarts a shard actor that died (-1: always); None
            is -1 for a durable store (it recovers its episodes) and 0 otherwise (a
            restarted shard would come back empty). Calls in flight are retried.
        durable_sync: a durable shard flushes its log to disk (``fdatasync``) before it
            answers a write; False leaves the flush to the OS: writes survive a dead
            actor (the kernel holds them) but not a crash of the node.
        block_bytes: a shard seals its newest episodes into a block of the object
            store once they reach this size (`arrowbuf.ray.blocks`): larger blocks
            mean fewer ``np.take`` calls per batch, smaller ones less memory held
            by readers after eviction. An episode of ``block_bytes / 8`` or more
            written in the process that started the store is put once by its
            writer and becomes a block of its own without a copy (a lent block).
        seal_latency: seconds a shard's newest episodes may wait before they are
            sealed (readers see rows about one to two of these after they reach
            the shard; ``store.flush()`` seals at once); also how often a reader
            asks each shard for its manifest.
        reader_cache_bytes: bytes of blocks a reading process keeps fetched (least
            recently used dropped first); None keeps every listed block. On the
            shard's node a fetched block costs no memory of its own (a view of the
            object store) but keeps the block alive after eviction; from another
            node it is a local copy. The records the reader packs from a block's
            small step fields count as well. Below the store's size, batches fetch
            blocks again (latency for memory).
        copy_blocks: copy each fetched block into the reading process's memory, as
            a block that comes from another node is: frees the shared memory of
            evicted blocks at once, costs a copy per fetch (also how tests run
            the remote-reader path on one node). The copies get transparent huge
            pages (numpy asks for them), which the object store's tmpfs does not
            give by default: gathers of large rows run faster from them (W2
            `sample_iter` 10-13% per batch here; docs/ray.md).
        init: with no Ray cluster connected in this process, start a new local one
            (``ray.init(address="local")`` with Ray's defaults: every CPU, an object
            store of about 30% of memory; no dashboard), logged as a warning naming its
            resources. False (the
            default) refuses with `ShardError`: call ``ray.init(...)`` first, sized
            for the job, or ``ray.init(address="auto")`` to join a running cluster.
        namespace: the Ray namespace the shard actors are named in
            (``<store name>:<shard>``), where `attach` (and a store pickled into a
            task or actor) finds them: by default ``"arrowbuf"``, shared by every job
            of the cluster; None is the namespace of the job that starts the store
            (``ray.init(namespace=...)``; Ray's default is one per job, so other
            jobs cannot attach).
        resume: a durable store (``durable=``) whose directory holds episodes of an
            earlier run: None resumes them and logs a warning with their count;
            True resumes them (logged at INFO); False discards them (the shards'
            logs are cleared) and starts empty.

    Example:
        >>> import arrowbuf as ab
        >>> ab.RayOptions(num_cpus=1, delivery_latency=0.05).max_in_flight
        8
    """

    num_cpus: float = 0.0
    max_in_flight: int = 8
    nodes: Sequence[str] | None = None
    node_affinity: bool = True
    allow_partial: bool = False
    write_batch_bytes: int = 4 << 20
    delivery_latency: float = 0.1
    size_refresh: float = 0.5
    start_timeout: float = 120.0
    max_restarts: int | None = None
    durable_sync: bool = True
    block_bytes: int = 64 << 20
    seal_latency: float = 0.1
    reader_cache_bytes: int | None = None
    copy_blocks: bool = False
    init: bool = False
    namespace: str | None = NAMESPACE
    resume: bool | None = None

    def __post_init__(self) -> None:
        self.num_cpus = _check_seconds("num_cpus", self.num_cpus, zero_ok=True)
        self.delivery_latency = _check_seconds("delivery_latency", self.delivery_latency, zero_ok=False, finite=True)
        self.size_refresh = _check_seconds("size_refresh", self.size_refresh, zero_ok=True)
        self.start_timeout = _check_seconds("start_timeout", self.start_timeout, zero_ok=False)
        check_int("RayOptions.max_in_flight", self.max_in_flight, 1)
        check_int("RayOptions.write_batch_bytes", self.write_batch_bytes, 0)
        check_bool("RayOptions.node_affinity", self.node_affinity)
        check_bool("RayOptions.allow_partial", self.allow_partial)
        check_bool("RayOptions.durable_sync", self.durable_sync)
        check_int("RayOptions.block_bytes", self.block_bytes, 1)
        # Infinite: nothing sealed but by flush(), no manifest polled, dead shards unnoticed.
        self.seal_latency = _check_seconds("seal_latency", self.seal_latency, zero_ok=False, finite=True)
        if self.reader_cache_bytes is not None:
            check_int("RayOptions.reader_cache_bytes", self.reader_cache_bytes, 0)
        check_bool("RayOptions.copy_blocks", self.copy_blocks)
        check_bool("RayOptions.init", self.init)
        if self.namespace is not None and (not isinstance(self.namespace, str) or not self.namespace):
            raise ValueError(f"RayOptions.namespace must be a non-empty str or None (the job's namespace), "
                             f"got {self.namespace!r}")
        if self.resume is not None:
            check_bool("RayOptions.resume", self.resume)
        if self.max_restarts is not None:
            check_int("RayOptions.max_restarts", self.max_restarts, -1)
        if self.nodes is not None and (isinstance(self.nodes, str) or not all(isinstance(n, str) for n in self.nodes)):
            raise ValueError(f"RayOptions.nodes must be a list of node ids or None, got {self.nodes!r}")


def as_ray_options(value: Any) -> RayOptions:
    """``value`` (None: the defaults) as `RayOptions`, or ValueError."""
    if value is None:
        return RayOptions()
    if not isinstance(value, RayOptions):
        raise ValueError(f"ray_options must be an arrowbuf.RayOptions or None, got {describe(value)}")
    return value
