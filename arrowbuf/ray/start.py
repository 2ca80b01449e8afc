"""Starting a store's shard actors, and finding those of a running store by name.

Shard actors are named ``<store name>:<shard>`` in the Ray namespace
``arrowbuf``, so any process of the cluster can find them.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
from pathlib import Path
from typing import Sequence

import numpy as np

from arrowbuf.errors import FormatError, InUseError, ShardError
from arrowbuf.rate_limiters import RateLimiter, limits
from arrowbuf.ray.actor import ShardServer
from arrowbuf.ray.blocks import check_object_store
from arrowbuf.ray.handles import CONCURRENCY_GROUPS, DEFAULT_CONCURRENCY, ShardHandles
from arrowbuf.ray.options import NAMESPACE, RayOptions, ray_module
from arrowbuf.samplers import Sampler
from arrowbuf.schema import Schema

logger = logging.getLogger(__name__)


def start_shards(name: str, capacity: int, num_shards: int, *, seed: int | None, sampler: Sampler,
                 rate_limiter: RateLimiter, schema: Schema | None, mode: str, track_reuse: bool,
                 options: RayOptions, load_from: Sequence[str] | None = None,
                 durable: Path | None = None) -> ShardHandles:
    """Start the named shard actors of a store (``ray.init()`` first if no cluster runs).

    Each shard gets ``capacity // num_shards`` rows (the first ones one more for the
    remainder), its own copies of the sampler and rate limiter, and a seed derived
    from ``seed``. With a ``durable`` directory, shard k logs into
    ``durable/shard-<k>`` and Ray restarts it when it dies (``max_restarts``), retrying
    the calls in flight.

    Raises:
        ShardError: the actors did not start within ``options.start_timeout``.
    """
    ray = ray_module()
    if not ray.is_initialized():
        logger.info("no Ray cluster is running: starting a local one (ray.init())")
        ray.init(logging_level=logging.WARNING)
    if schema is not None:
        check_object_store(capacity, schema)
    threaded = limits(rate_limiter)
    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ShardServer) if threaded else ray.remote(ShardServer)
    threads = {"max_concurrency": DEFAULT_CONCURRENCY} if threaded else {}
    taken = running_shards(name, num_shards)
    if taken:
        raise InUseError(f"store name {name!r} is taken: shard actor(s) {taken} of a running store have it (in Ray "
                         f"namespace {NAMESPACE!r}); close that store, attach to it with ExperienceStore.attach("
                         f"{name!r}), or pass another name=")
    seeds = np.random.SeedSequence(seed).generate_state(num_shards).tolist()
    restarts = options.max_restarts if options.max_restarts is not None else -1 if durable is not None else 0
    handles = []
    for shard in range(num_shards):
        placement = {}
        if options.nodes:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node = options.nodes[shard % len(options.nodes)]
            placement["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)
        rows = capacity // num_shards + (shard < capacity % num_shards)
        try:
            handle = actor.options(name=f"{name}:{shard}", namespace=NAMESPACE, num_cpus=options.num_cpus,
                                   max_restarts=restarts, max_task_retries=-1 if restarts else 0,
                                   **threads, **placement).remote(
                rows, shard, num_shards, seeds[shard], copy.deepcopy(sampler), copy.deepcopy(rate_limiter),
                schema.to_json() if schema is not None else None, mode,
                load_from[shard] if load_from is not None else None, track_reuse,
                str(durable / f"shard-{shard}") if durable is not None else None, options.durable_sync,
                (options.block_bytes, options.seal_latency),
                f"shard {shard} of store {name!r}, started by pid {os.getpid()} on {socket.gethostname()!r}")
        except ValueError as err:   # Ray's ActorAlreadyExistsError: a store of that name started meanwhile
            for started in handles:
                ray.kill(started)
            raise InUseError(f"store name {name!r} is taken: {err}; pass another name=") from None
        handles.append(handle)
    limit = None if math.isinf(options.start_timeout) else options.start_timeout
    try:
        nodes = ray.get([h.ping.remote() for h in handles], timeout=limit)
    except BaseException as err:   # no half-started store: its named actors would block the name
        for handle in handles:
            ray.kill(handle)
        if isinstance(err, ray.exceptions.GetTimeoutError):
            raise ShardError(f"the {num_shards} shard actors of store {name!r} did not start within "
                             f"{options.start_timeout} s; does the cluster have RayOptions.num_cpus="
                             f"{options.num_cpus} free CPUs for each?") from None
        if isinstance(err, ray.exceptions.RayActorError) and err.actor_init_failed and "InUseError" in str(err):
            raise InUseError(f"a shard of store {name!r} could not open its durable directory: "
                             f"{_last_line(err)}") from None
        if isinstance(err, ray.exceptions.RayActorError) and err.actor_init_failed and "FormatError" in str(err):
            # A shard refused its checkpoint or log: the typed error a local load gives,
            # not Ray's (which keeps the cause only as text).
            raise FormatError(f"a shard of store {name!r} could not load its data: {_last_line(err)}") from None
        raise
    return ShardHandles(name, handles, nodes, options, threaded,
                        owner=ray.get_runtime_context().get_worker_id(), durable=durable is not None)


def _last_line(err: BaseException) -> str:
    """The error a failed actor constructor raised, from Ray's text of it (``module.Error: message``)."""
    line = str(err).strip().splitlines()[-1]
    return line.split(": ", 1)[1] if line.startswith("arrowbuf.errors.") and ": " in line else line


def running_shards(name: str, num_shards: int) -> list[int]:
    """The shards ``0..num_shards-1`` of a store named ``name`` that run (their actor names are taken)."""
    ray = ray_module()
    taken = []
    for shard in range(num_shards):
        try:
            ray.get_actor(f"{name}:{shard}", namespace=NAMESPACE)
            taken.append(shard)
        except ValueError:
            pass
    return taken


def release_durable(shards: ShardHandles, timeout: float = 10.0) -> None:
    """Have the shards close their durable logs, releasing their directories' locks
    (a dead shard's lock went with its process)."""
    ray = ray_module()
    refs = [handle.release.remote() for handle in shards.handles]
    for ref in refs:
        try:
            ray.get(ref, timeout=timeout)
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            pass


def find_shards(name: str, options: RayOptions) -> tuple[ShardHandles, dict]:
    """The handles of the running store ``name``'s shards, and the configuration of
    its shard 0 (with ``capacity`` the total over the shards and ``schema`` the JSON
    of the first shard that has one).

    Raises:
        ValueError: no store of that name is running.
        ShardError: one of its shards is not running.
    """
    ray = ray_module()
    try:
        first = ray.get_actor(f"{name}:0", namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no arrowbuf store named {name!r} is running in namespace {NAMESPACE!r}") from None
    config = ray.get(first.config.remote())
    handles = [first]
    for shard in range(1, config["num_shards"]):
        try:
            handles.append(ray.get_actor(f"{name}:{shard}", namespace=NAMESPACE))
        except ValueError:
            raise ShardError(f"shard {shard} of store {name!r} is not running (dead or closed)") from None
    nodes = ray.get([h.ping.remote() for h in handles])
    configs = ray.get([h.config.remote() for h in handles])
    config["capacity"] = sum(c["capacity"] for c in configs)
    config["schema"] = next((c["schema"] for c in configs if c["schema"] is not None), None)
    return ShardHandles(name, handles, nodes, options, limits(config["rate_limiter"])), config
