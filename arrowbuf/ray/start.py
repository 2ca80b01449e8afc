"""Starting a store's shard actors, and finding those of a running store by name.

Shard actors are named ``<store name>:<shard>`` in the Ray namespace
``RayOptions.namespace`` (``"arrowbuf"`` by default), so any process of the
cluster can find them. A store starts a Ray cluster only when asked
(``RayOptions(init=True)``, see `connect`), and says what a durable directory
held from an earlier run (``RayOptions.resume``, see `resume_durable`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import socket
from pathlib import Path
from typing import Any, Sequence

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

    Each shard starts with ``capacity // num_shards`` transitions (the first ones one more
    for the remainder), a share that may grow to ``capacity`` (`arrowbuf.ray.shares`), its
    own copies of the sampler and rate limiter, and a seed derived from ``seed``. With a ``durable`` directory, shard k logs into
    ``durable/shard-<k>`` and Ray restarts it when it dies (``max_restarts``), retrying
    the calls in flight.

    Raises:
        ShardError: no Ray cluster is connected and ``options.init`` is False; the
            actors did not start within ``options.start_timeout``.
    """
    ray = connect(options)
    if schema is not None:
        check_object_store(capacity, schema)
    threaded = limits(rate_limiter)
    actor = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ShardServer) if threaded else ray.remote(ShardServer)
    threads = {"max_concurrency": DEFAULT_CONCURRENCY} if threaded else {}
    taken = running_shards(name, num_shards, options.namespace)
    if taken:
        raise InUseError(f"store name {name!r} is taken: shard actor(s) {taken} of a running store have it (in Ray "
                         f"namespace {options.namespace!r}); close that store, attach to it with ExperienceStore.attach("
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
            handle = actor.options(name=f"{name}:{shard}", namespace=options.namespace, num_cpus=options.num_cpus,
                                   max_restarts=restarts, max_task_retries=-1 if restarts else 0,
                                   **threads, **placement).remote(
                rows, shard, num_shards, seeds[shard], copy.deepcopy(sampler), copy.deepcopy(rate_limiter),
                schema.to_json() if schema is not None else None, mode,
                load_from[shard] if load_from is not None else None, track_reuse,
                str(durable / f"shard-{shard}") if durable is not None else None, options.durable_sync,
                (options.block_bytes, options.seal_latency),
                f"shard {shard} of store {name!r}, started by pid {os.getpid()} on {socket.gethostname()!r}",
                room=capacity)
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
    shards = ShardHandles(name, handles, nodes, options, threaded,
                          owner=ray.get_runtime_context().get_worker_id(), durable=durable is not None)
    if durable is not None and load_from is None:
        resume_durable(shards, durable, options.resume)
    return shards


def connect(options: RayOptions) -> Any:
    """The ``ray`` module, connected to a cluster: the one this process joined, or a
    local one started now if ``options.init`` asks for it (logged as a warning naming
    its resources).

    Raises:
        ShardError: no cluster is connected and ``options.init`` is False.
    """
    ray = ray_module()
    if ray.is_initialized():
        return ray
    if not options.init:
        raise ShardError(
            "no Ray cluster is connected in this process, and arrowbuf does not start one unasked (Ray's defaults "
            "take every CPU and an object store of about 30% of memory). Call ray.init(...) first, sized for the "
            "job (e.g. ray.init(num_cpus=8, object_store_memory=4 << 30)), or ray.init(address='auto') to join a "
            "running cluster; or pass ray_options=ab.RayOptions(init=True) to start a local one with Ray's defaults")
    # A new local cluster, as asked: a bare ray.init() would join any cluster it finds on this
    # machine (the latest one started, even another user's).
    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING)
    resources = ray.cluster_resources()
    logger.warning("arrowbuf started a local Ray cluster (RayOptions(init=True)): %g CPUs, %g GPUs, %.1f GB of "
                   "memory, %.1f GB object store; call ray.init(...) yourself to size it", resources.get("CPU", 0),
                   resources.get("GPU", 0), resources.get("memory", 0) / 1e9,
                   resources.get("object_store_memory", 0) / 1e9)
    return ray


def resume_durable(shards: ShardHandles, directory: Path, resume: bool | None) -> None:
    """What a new durable store found in ``directory`` from an earlier run: resumed and
    logged with its count (a warning unless ``resume`` is True), or discarded (False)."""
    readings = shards.broadcast("size")
    transitions = sum(int(r[1]) for r in readings.values())
    episodes = sum(int(r[2]) for r in readings.values())
    if not episodes:
        return
    found = f"{episodes:,} episodes ({transitions:,} transitions) of an earlier run in {str(directory)!r}"
    if resume is False:
        shards.broadcast("clear")
        logger.info("durable store %r discarded %s (RayOptions(resume=False))", shards.name, found)
    elif resume:
        logger.info("durable store %r resumes %s", shards.name, found)
    else:
        logger.warning("durable store %r resumes %s; RayOptions(resume=True) says it is meant (logged at INFO), "
                       "resume=False discards them and starts empty", shards.name, found)


def _last_line(err: BaseException) -> str:
    """The error a failed actor constructor raised, from Ray's text of it (``module.Error: message``)."""
    line = str(err).strip().splitlines()[-1]
    return line.split(": ", 1)[1] if line.startswith("arrowbuf.errors.") and ": " in line else line


def running_shards(name: str, num_shards: int, namespace: str | None = NAMESPACE) -> list[int]:
    """The shards ``0..num_shards-1`` of a store named ``name`` that run in ``namespace``
    (their actor names are taken)."""
    ray = ray_module()
    taken = []
    for shard in range(num_shards):
        try:
            ray.get_actor(f"{name}:{shard}", namespace=namespace)
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
    if not ray.is_initialized():
        raise ShardError(f"cannot attach store {name!r}: this process is connected to no Ray cluster; call "
                         "ray.init(address='auto') (or the cluster's address) first")
    namespace = options.namespace
    try:
        first = ray.get_actor(f"{name}:0", namespace=namespace)
    except ValueError:
        where = f"namespace {namespace!r}" if namespace is not None else \
            f"this job's namespace {ray.get_runtime_context().namespace!r}"
        raise ValueError(f"no arrowbuf store named {name!r} is running in {where} (RayOptions.namespace)") from None
    config = ray.get(first.config.remote())
    handles = [first]
    for shard in range(1, config["num_shards"]):
        try:
            handles.append(ray.get_actor(f"{name}:{shard}", namespace=namespace))
        except ValueError:
            raise ShardError(f"shard {shard} of store {name!r} is not running (dead or closed)") from None
    nodes = ray.get([h.ping.remote() for h in handles])
    configs = ray.get([h.config.remote() for h in handles])
    config["capacity"] = sum(c["capacity"] for c in configs)
    config["schema"] = next((c["schema"] for c in configs if c["schema"] is not None), None)
    return ShardHandles(name, handles, nodes, options, limits(config["rate_limiter"])), config
