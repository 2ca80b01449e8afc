"""How a store gets its `Backend`: a new one, one attached by name, or one loaded
from a checkpoint of either kind.

`ExperienceStore` checks the settings every backend shares, then calls these:
they check the arguments of one kind of backend (``num_shards``, ``name``,
``durable`` only on Ray), pick `LocalBackend` or `arrowbuf.ray.router.RayBackend`,
and say what a loaded or attached store was made with (`Opened`). Ray is imported
only for a Ray store.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ContextManager, Mapping

from arrowbuf._checks import check_bool, check_choice, check_int, check_name, check_storage_device
from arrowbuf.backend import Backend
from arrowbuf.byte_heap import check_bounded_mode
from arrowbuf.engine import ShardEngine
from arrowbuf.errors import describe
from arrowbuf.local import LocalBackend
from arrowbuf.rate_limiters import RateLimiter, limits
from arrowbuf.groups import GroupSampler
from arrowbuf.samplers import EpisodeSampler, Sampler, UniformSampler, WithoutReplacementSampler
from arrowbuf.schema import Schema
from arrowbuf.shard import MODES

BACKENDS = ("local", "ray")

#: `ExperienceStore.load`'s default: columns go back to the saved store's ``storage_device``.
AS_SAVED = "as saved"


@dataclass
class Opened:
    """A running backend and the settings of the store it belongs to."""

    backend: Backend
    capacity: int
    seed: int | None
    sampler: Sampler
    mode: str
    rate_limiter: RateLimiter
    track_reuse: bool
    created_at: float
    writers: Mapping[str, Any] = field(default_factory=dict)   # saved writers' states, by name
    typed_errors: Callable[[], ContextManager[Any]] = nullcontext   # wraps restoring them


def check_settings(seed: Any, sampler: Any, mode: Any, backend: Any, rate_limiter: Any, track_reuse: Any
                   ) -> tuple[int | None, Sampler, str, str, RateLimiter, bool]:
    """The settings every backend shares, checked, defaults filled in: (seed, sampler, mode,
    backend, rate_limiter, track_reuse)."""
    if seed is not None:
        seed = check_int("seed", seed, 0)   # a plain int (it is saved as JSON)
    check_choice("mode", mode, MODES)
    check_choice("backend", backend, BACKENDS)
    sampler = UniformSampler() if sampler is None else sampler
    if not isinstance(sampler, Sampler):
        raise ValueError(f"sampler must be an arrowbuf Sampler (UniformSampler(), PrioritizedSampler(), ...), "
                         f"got {describe(sampler)}")
    rate_limiter = RateLimiter() if rate_limiter is None else rate_limiter
    if not isinstance(rate_limiter, RateLimiter):
        raise ValueError(f"rate_limiter must be an arrowbuf RateLimiter (MinSize, SampleToInsertRatio), "
                         f"got {describe(rate_limiter)}")
    return seed, sampler, mode, backend, rate_limiter, check_bool("track_reuse", track_reuse)


def new_backend(store: Any, schema: Any, num_shards: int, name: Any, ray_options: Any, durable: Any,
                storage_device: Any) -> Backend:
    """The backend of a new store, from its checked settings (``store.capacity``, ``.seed``, ...)."""
    if schema is not None and not isinstance(schema, Schema):
        schema = Schema(schema)
    if schema is not None:   # here: a Ray shard refusing it in its constructor dies (ActorDiedError)
        store.sampler.check_schema(schema)
    if store.backend == "local":
        if num_shards != 1 or name is not None or ray_options is not None:
            raise ValueError(f"num_shards={num_shards!r}, name={name!r} and ray_options={ray_options!r} "
                             "need backend='ray'; the local backend has one unnamed shard")
        if durable is not False:
            raise ValueError(f"durable={durable!r} needs backend='ray' (durable shard actors); a local store is "
                             "saved with save()")
        return LocalBackend(ShardEngine(
            store.capacity, sampler=store.sampler, rate_limiter=store.rate_limiter, mode=store.mode, seed=store.seed,
            schema=schema, track_reuse=store.track_reuse, storage_device=storage_device))
    from arrowbuf.durable import durable_directory
    from arrowbuf.ray.options import as_ray_options
    from arrowbuf.ray.apart import refuse_durable_apart
    from arrowbuf.ray.router import RayBackend
    from arrowbuf.ray.start import start_shards

    if durable is True and name is None:   # a random name: a directory nobody finds again, kept forever
        raise ValueError("durable=True keeps the shards' logs in ~/.cache/arrowbuf/<name>: pass name= (so a "
                         "new driver finds the store's directory again) or a directory, durable='some/dir'")
    name = check_name(name) or RayBackend.new_name()
    directory = durable_directory(durable, name)
    ray_options = as_ray_options(ray_options)
    check_shard_settings(store.sampler, num_shards, store.rate_limiter, store.track_reuse)
    if directory is not None:
        refuse_durable_apart(schema)
    store.sampler.check_unused()   # as a local store's first bind would: the shards get copies of it
    if schema is not None:   # as a local store's shard refuses it, before any actor starts (not its death)
        check_bounded_mode(schema.fields, store.mode)
    shards = start_shards(name, store.capacity, num_shards, seed=store.seed, sampler=store.sampler,
                          rate_limiter=store.rate_limiter, schema=schema, mode=store.mode,
                          track_reuse=store.track_reuse, options=ray_options, durable=directory)
    return RayBackend(shards, capacity=store.capacity, sampler=store.sampler, seed=store.seed, schema=schema,
                      schema_fixed=schema is not None)


def check_shard_settings(sampler: Sampler, num_shards: int, rate_limiter: RateLimiter, track_reuse: bool) -> None:
    """A Ray store's sampler on ``num_shards`` shards, made or loaded from a checkpoint.

    Raises:
        ValueError: a sampler that several shards cannot draw (whole groups, padded episodes,
            epochs without replacement, `check_fresh_shards`).
    """
    if isinstance(sampler, GroupSampler) and num_shards > 1:
        raise ValueError("GroupSampler draws whole groups, which shards drawing their own shares would split; "
                         "use num_shards=1")
    if isinstance(sampler, EpisodeSampler) and num_shards > 1:
        raise ValueError("EpisodeSampler returns episodes padded to the longest one, which shards "
                         "cannot agree on; use num_shards=1 or a SequenceSampler")
    check_fresh_shards(sampler, num_shards, rate_limiter, track_reuse)
    if isinstance(sampler, WithoutReplacementSampler) and num_shards > 1:
        raise ValueError("WithoutReplacementSampler keeps one epoch per shard, and shards end their epochs at "
                         "different times; use num_shards=1, or iter_batches() for epochs across shards")


def check_fresh_shards(sampler: Sampler, num_shards: int, rate_limiter: RateLimiter, track_reuse: bool) -> None:
    """A `FreshnessSampler` over several shards is drawn by readers, from every shard's
    versions at once (`arrowbuf.ray.fresh`): a shard drawing alone would count lags from
    its own newest version.

    Raises:
        ValueError: several shards, a FreshnessSampler and a rate limiter or ``track_reuse``
            (which make each shard draw its share).
    """
    if type(sampler).__name__ == "FreshnessSampler" and num_shards > 1 and (limits(rate_limiter) or track_reuse):
        made = f"rate_limiter={type(rate_limiter).__name__}" if limits(rate_limiter) else "track_reuse=True"
        raise ValueError(f"FreshnessSampler on num_shards={num_shards} weighs steps by their lag behind the newest "
                         f"version of every shard, so the sampling process draws them; {made} makes each shard "
                         "draw its share alone: drop it, or use num_shards=1")


def attach_backend(name: Any, seed: int | None, ray_options: Any) -> Opened:
    """The backend of the running Ray store ``name`` (see `ExperienceStore.attach`)."""
    from arrowbuf.ray.options import as_ray_options
    from arrowbuf.ray.router import RayBackend

    if check_name(name) is None:
        raise ValueError("name must be the name of a running Ray store, got None")
    backend, config = RayBackend.attach(name, seed=seed, options=as_ray_options(ray_options))
    return Opened(backend, config["capacity"], seed, config["sampler"], config["mode"], config["rate_limiter"],
                  config["track_reuse"], time.time())


def reduce_store(store: Any, backend: Any) -> tuple:
    """`ExperienceStore.__reduce__`: a Ray store pickles (into Ray tasks and actors) as its
    name and arrives as a handle attached to the same shards, with its own generator
    (freshly seeded: handles must not draw the same batches), writers and sizes.

    Raises:
        TypeError: a local store, whose rows live in this process.
    """
    if store.backend != "ray":
        raise TypeError("a local ExperienceStore cannot be pickled (its rows live in this process): make it with "
                        "backend='ray' to pass it to Ray tasks and actors (it arrives attached), or save(path) it "
                        "and ExperienceStore.load(path) it there")
    return type(store).attach, (store.name, None, backend.options)


def load_backend(path: str | Path, progress: bool | None, num_shards: Any, name: Any, ray_options: Any,
                 storage_device: Any) -> Opened:
    """The backend saved in ``path``, local or Ray (see `ExperienceStore.load`)."""
    from arrowbuf.checkpoint import load_engine
    from arrowbuf.ray.persist import is_ray_checkpoint

    if is_ray_checkpoint(path):
        from arrowbuf.ray.options import as_ray_options

        if storage_device != AS_SAVED:
            check_storage_device(storage_device, "ray")
        if num_shards is not None:
            check_int("num_shards", num_shards, 1)
        return _load_ray(Path(path), num_shards, check_name(name), as_ray_options(ray_options))
    if (num_shards, name, ray_options) != (None, None, None):
        raise ValueError(f"num_shards, name and ray_options apply to Ray checkpoints only; {path} is a local one")
    if storage_device != AS_SAVED:
        storage_device = check_storage_device(storage_device, "local")
    loaded = load_engine(path, progress, storage_device=storage_device)
    engine = loaded.engine
    return Opened(LocalBackend(engine), engine.capacity, engine.seed, engine.sampler, engine.mode,
                  engine.rate_limiter, engine.track_reuse, float(loaded.info["created_at"]), loaded.writers,
                  loaded.typed_errors)


def _load_ray(path: Path, num_shards: int | None, name: str | None, options: Any) -> Opened:
    """A Ray backend from a Ray checkpoint (`arrowbuf.ray.persist.save_ray_store`), into
    ``num_shards`` shards (default: as saved).

    With the saved number of shards every shard actor loads its own directory
    (sampler, limiter and generator state included). Into another number, the
    episodes of each saved shard are streamed into the new shards by tasks in
    parallel, the way writers send them; their ids are renumbered and sampler
    state starts fresh.

    Raises:
        FormatError: no complete Ray checkpoint in ``path``.
    """
    from arrowbuf.checkpoint import load_engine
    from arrowbuf.ray.options import ray_module
    from arrowbuf.ray.persist import checkpoint_dirs, reshard_task
    from arrowbuf.ray.router import RayBackend
    from arrowbuf.ray.start import start_shards

    manifest, dirs = checkpoint_dirs(path)
    num_shards = len(dirs) if num_shards is None else num_shards
    loaded = load_engine(dirs[0], progress=False)   # shard 0 keeps the writers' states
    first = loaded.engine
    sampler = type(first.sampler)(**first.sampler.config())
    limiter = type(first.rate_limiter)(**first.rate_limiter.config())
    capacity, mode, seed = int(manifest["capacity"]), manifest["mode"], manifest["seed"]
    check_shard_settings(sampler, num_shards, limiter, first.track_reuse)   # as a new store of them would be
    shards = start_shards(name or RayBackend.new_name(), capacity, num_shards, seed=seed, sampler=sampler,
                          rate_limiter=limiter, schema=first.schema, mode=mode, track_reuse=first.track_reuse,
                          options=options, load_from=[str(d) for d in dirs] if num_shards == len(dirs) else None)
    backend = RayBackend(shards, capacity=capacity, sampler=sampler, seed=seed, schema=first.schema,
                         schema_fixed=first.schema is not None)
    if num_shards != len(dirs):
        ray = ray_module()
        reshard = ray.remote(reshard_task)
        ray.get([reshard.remote(str(d), backend.sink(None, None)) for d in dirs])
        backend.flush()
    created_at = float(manifest.get("created_at", time.time()))   # the saved store's, as a local load keeps it
    return Opened(backend, capacity, seed, sampler, mode, limiter, first.track_reuse, created_at, loaded.writers,
                  loaded.typed_errors)
