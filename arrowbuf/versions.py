"""Policy versions: which policy chose each step, draws of fresh steps, eviction of stale ones.

Asynchronous trainers collect with one policy version while they train another; a
step's ``"policy_version"`` (int64, a step field like any other: sampled, exported,
checkpointed) says which policy chose its action. A step without one has version 0
(the column is derived, `VERSION_FIELD`).

- Writes: `attach_versions` gives read episodes their column (`with_version`: an
  int, one per step, or one per episode), and a writer's steps get theirs checked
  non-decreasing per env (`step_versions`, `next_versions`). A local store gains
  the column at its first versioned write (0 in every row written before); a Ray
  store needs it from its first write on.
- Draws: `fresh_selection` draws transitions of version >= ``min_version``,
  uniformly over the qualifying ones kept as spans of episode steps
  (`arrowbuf._version_spans`: no rejection, O(batch) once they are known), or
  weighted by a `arrowbuf.freshness.FreshnessSampler` above the bound.
  `span_selection` is the one uniform draw over spans: a local store's generic
  and plain paths (`arrowbuf.direct`) and a Ray reader's views
  (`arrowbuf.ray.fresh`) all draw through it. `fresh_indices` lists the
  qualifying transitions for epochs; `sample_fresh`, `check_fresh_iter` and
  `epochs_fresh` take the store's ``min_version`` keywords to its backend.
- Eviction: `stale_episodes` counts the oldest episodes that hold only steps
  older than a version, which `evict_stale` frees (`ShardEngine.evict`; the
  store's `evict` through `evict_older`). Eviction stays FIFO: it stops at the
  first episode with a step of that version or newer, so it never leaves a hole
  in the ring (older episodes behind a fresher one stay until the ring
  overwrites them).
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from arrowbuf._checks import check_int
from arrowbuf._version_spans import VERSION, Spans, fresh_spans, newest
from arrowbuf.errors import EmptyStoreError
from arrowbuf.fields import Field
from arrowbuf.sample_args import SampleArgs
from arrowbuf.samplers import Selection, UniformSampler, select_indices, uniform_indices

if TYPE_CHECKING:
    from arrowbuf.schema import Schema
    from arrowbuf.shard import Episode, Shard
    from arrowbuf.table import EpisodeTable



def newest_version(shard: Shard | None) -> int | None:
    """The newest version among the live transitions; None when there are none."""
    return None if shard is None or not shard.table.num_transitions else newest(shard)


def no_fresh_step(shard: Shard | None, min_version: int) -> EmptyStoreError:
    return no_fresh(min_version, newest_version(shard))


def no_fresh(min_version: int, newest: int | None) -> EmptyStoreError:
    """The error of a draw of ``min_version`` where none qualifies, naming the ``newest`` version held."""
    held = "no transition" if newest is None else f"the newest version held is {newest}"
    return EmptyStoreError(f"cannot sample: no transition has policy_version >= {min_version} ({held}); "
                           "lower min_version or wait for fresher steps")


def fresh_selection(rng: np.random.Generator, n: int, shard: Shard, min_version: int, sampler: Any) -> Selection:
    """``n`` transitions drawn uniformly among those of version >= ``min_version``
    (`arrowbuf._version_spans`: no rejection).

    Raises:
        ValueError: ``sampler`` is not a plain `UniformSampler` (other samplers do not take
            ``min_version``).
        EmptyStoreError: none qualifies (naming the newest version held).
    """
    if type(sampler).__name__ == "FreshnessSampler":   # weighted by freshness above the bound
        return sampler.sample(rng, n, shard.table, min_version)
    if type(sampler) is not UniformSampler:
        raise ValueError(f"min_version needs a UniformSampler or a FreshnessSampler; this store uses {sampler!r}")
    spans = fresh_spans(shard, min_version)
    if spans is None:
        raise no_fresh_step(shard, min_version)
    return span_selection(rng, n, spans, shard.table)


def span_selection(rng: np.random.Generator, n: int, spans: Spans, table: EpisodeTable,
                   out: np.ndarray | None = None) -> Selection:
    """``n`` transitions drawn uniformly among those of ``spans`` (of ``table``'s live episodes),
    their indices written into ``out`` (int64 ``[n]``) when given: the one draw of ``min_version``
    (a local store's `fresh_selection`, its plain path `arrowbuf.direct`, a Ray reader's views)."""
    if spans.first >= 0:   # one run of indices (`Spans.first`): the draw below, located as a plain sample's
        return select_indices(table, uniform_indices(rng, n, spans.first, spans.first + spans.total, out))
    k, offset = spans.draw(uniform_indices(rng, n, 0, spans.total))
    pos = spans.pos.take(k)
    step = spans.step0.take(k) + offset
    rows = spans.row0.take(k) + offset
    if table.pieces:   # the step within the episode of a piece that continues one
        step += table.col("first_step").take(pos)
    return Selection(rows, np.add(spans.index0.take(k), offset, out=out), pos, {}, step)


def fresh_indices(shard: Shard, min_version: int) -> np.ndarray:
    """The live transition indices of version >= ``min_version``, oldest first.

    Raises:
        EmptyStoreError: none (naming the newest version held).
    """
    spans = fresh_spans(shard, min_version)
    if spans is None:
        raise no_fresh_step(shard, min_version)
    return spans.indices()


def evict_stale(shard: Shard, sampler: Any, min_version: int) -> int:
    """Free the `stale_episodes` of ``shard`` (its sampler told, as a write's eviction tells it); how many."""
    count = stale_episodes(shard, min_version)
    if count:
        shard.placement.evict_oldest(count)   # tells the sampler
    return count


def stale_episodes(shard: Shard, min_version: int) -> int:
    """How many of the oldest live episodes have every step older than ``min_version``."""
    table = shard.table
    if VERSION not in shard.schema.fields:
        return len(table) if min_version > 0 else 0
    column = shard.reader(VERSION)
    steps = table.col("num_rows") - table.col("has_final")
    count = 0
    for first, n in zip(table.col("first_row").tolist(), steps.tolist()):
        if n and int(np.max(column[first:first + n])) >= min_version:
            break
        count += 1
    return count


def check_versions(versions: Any, count: int, what: str) -> np.ndarray:
    """``versions`` (an int, or one per ``what``) as ``count`` int64 values >= 0.

    Raises:
        ValueError: not ints >= 0, past int64 (out of range), or not one per ``what``.
    """
    array = np.asarray(versions.cpu() if hasattr(versions, "cpu") else versions)
    values = list(versions) if isinstance(versions, (list, tuple)) else array.ravel().tolist() \
        if array.dtype == object or np.issubdtype(array.dtype, np.unsignedinteger) else ()
    if any(isinstance(v, int) and not isinstance(v, bool) and v > _MAX for v in values):   # numpy: uint64 or objects
        raise ValueError(f"policy_version out of range: got {versions!r}; versions are int64, from 0 to "
                         f"{_MAX:,} (2**63 - 1)")
    if array.dtype == bool or not np.issubdtype(array.dtype, np.integer) or (array.size and array.min() < 0) \
            or array.ndim > 1 or (array.ndim == 1 and len(array) != count):
        raise ValueError(f"policy_version must be an int >= 0 or {count} of them (one per {what}), "
                         f"got {versions!r}")
    return np.broadcast_to(array.astype(np.int64), (count,))


_MAX = int(np.iinfo(np.int64).max)


#: The column of versions: derived, so writes without it store version 0.
VERSION_FIELD = Field("int64", derived=True)


def with_version(episode: Episode, schema: Schema, version: Any) -> tuple[Episode, Schema]:
    """A read episode with its steps' ``policy_version`` column, and the schema that holds it.

    Raises:
        ValueError: a bad version, or the episode carries a ``policy_version`` field too.
    """
    if VERSION in episode.columns:
        raise ValueError("the episode has a policy_version field and policy_version= was given too; give one")
    column = np.ascontiguousarray(check_versions(version, episode.num_steps, "step"))
    if VERSION not in schema.fields:
        schema = schema.extended({VERSION: VERSION_FIELD})
    elif schema.fields[VERSION].dtype != "int64" or schema.fields[VERSION].shape:
        raise ValueError(f"the store's policy_version field is {schema.fields[VERSION]}; versions need int64 scalars")
    return dataclasses.replace(episode, columns={**episode.columns, VERSION: column}), schema


def ensure_version_column(engine: Any, schema: Schema) -> None:
    """Give ``engine``'s shard the version column of ``schema`` (zero: version 0 in every row
    written before), so that a versioned episode's column is stored."""
    with engine.lock:
        shard = engine.shard
        if shard is not None and VERSION in schema.fields and VERSION not in shard.schema.fields:
            shard.add_fields(shard.schema.extended({VERSION: VERSION_FIELD}))


def keyword_schema(schema: Schema | None, version: Any) -> Schema | None:
    """The schema an episode given ``policy_version=`` is read against: ``schema``, where a
    declared ``policy_version`` field is not asked of the data (the keyword fills it,
    `with_version`); ``schema`` itself without the keyword.

    Raises:
        ValueError: the declared field is not int64 scalars, which versions are.
    """
    if version is None or schema is None or VERSION not in schema.fields or schema.fields[VERSION].derived:
        return schema
    field = schema.fields[VERSION]
    if field.dtype != "int64" or field.shape:
        raise ValueError(f"policy_version={version!r} fills the store's policy_version field, declared as {field}; "
                         "versions are int64 scalars per step: declare it Field('int64')")
    return as_version_schema(schema)


def attach_versions(store: Any, episodes: Episode | list[Episode], schema: Schema, version: Any,
                    per_episode: bool = False) -> tuple[Episode | list[Episode], Schema]:
    """``store``'s read episode (or list of them, with ``per_episode``) with its
    ``policy_version`` column (``version``: an int, one per step of the one episode, or one
    per episode), the schema holding them, and the store's shard given the column
    (`ensure_version_column`). Unchanged when ``version`` is None.

    Raises:
        ValueError: a bad version, or a Ray store whose schema was fixed without the column.
    """
    if store.schema is None:   # a first write's policy_version field: the column every write path shares
        schema = as_version_schema(schema)
    if version is None:
        return episodes, schema
    if store.backend != "local" and store.schema is not None and VERSION not in store.schema.fields:
        raise ValueError("this Ray store's schema has no policy_version column (its shards cannot add one yet): "
                         "give policy_version from the store's first write on, or declare the field in its schema")
    if not per_episode:
        out, schema = with_version(episodes, schema, version)
    else:
        out = []
        for episode, each in zip(episodes, check_versions(version, len(episodes), "episode")):
            episode, schema = with_version(episode, schema, each)
            out.append(episode)
    if store.backend == "local":
        ensure_version_column(store.engine, schema)
    return out, schema


def sample_fresh(backend: Any, min_version: Any, batch_size: int, args: SampleArgs, device: Any, pin_memory: bool,
                 timeout: float | None, num_workers: int | None, worker_nodes: Any, keys: Any) -> Any:
    """`ExperienceStore.sample` of steps of ``policy_version`` >= ``min_version`` (a Ray
    store's readers draw them from their views: `arrowbuf.ray.fresh`).

    Raises:
        ValueError: a bad ``min_version``, or a sampler that does not take it.
    """
    min_version = check_int("min_version", min_version, 0)
    return backend.sample(batch_size, args, device, pin_memory, timeout, num_workers, worker_nodes, keys,
                           min_version)


def check_fresh_iter(store: Any, min_version: Any) -> int | None:
    """``sample_iter``'s ``min_version`` checked (None stays None).

    Raises:
        ValueError: not an int >= 0, or a sampler that does not take it.
    """
    if min_version is None:
        return None
    min_version = check_int("min_version", min_version, 0)
    if type(store.sampler).__name__ not in ("UniformSampler", "FreshnessSampler"):
        raise ValueError(f"min_version needs a UniformSampler or a FreshnessSampler; this store uses "
                         f"{store.sampler!r}")
    return min_version


def epochs_fresh(backend: Any, min_version: Any, batch_size: int, shuffle: bool, drop_last: bool, epochs: int,
                 device: Any, keys: Any) -> Iterator[Any]:
    """`ExperienceStore.iter_batches` over the steps of ``policy_version`` >= ``min_version``.

    Raises:
        ValueError: a bad ``min_version``.
        EmptyStoreError: no step qualifies (at the first epoch's start).
    """
    min_version = check_int("min_version", min_version, 0)
    first = backend.iter_batches(batch_size, shuffle, drop_last, device, keys, min_version)   # raises now locally

    def batches() -> Iterator[Any]:
        yield from first
        for _ in range(epochs - 1):
            yield from backend.iter_batches(batch_size, shuffle, drop_last, device, keys, min_version)

    return batches()


def evict_older(backend: Any, min_version: Any) -> int:
    """`ExperienceStore.evict`: free the oldest episodes older than ``min_version`` (`evict_stale`;
    on Ray, every shard its own, FIFO each).

    Raises:
        ValueError: a bad ``min_version``.
    """
    min_version = check_int("min_version", min_version, 0)
    return backend.evict(min_version)


def writer_fields(schema: Schema) -> dict[str, Field]:
    """The fields a writer's steps carry: the input fields, and ``policy_version`` when the
    store has it (a derived column, 0 where a write lacks it: a writer fills the 0s, so
    that its steps' rows never keep what the arena held before)."""
    fields = schema.input_fields
    if VERSION in schema.fields and VERSION not in fields:
        fields = {**fields, VERSION: schema.fields[VERSION]}
    return fields


def as_version_schema(schema: Schema) -> Schema:
    """``schema`` with its ``policy_version`` field (inferred from a writer's first step) as
    the derived column every write path shares (`VERSION_FIELD`)."""
    field = schema.fields.get(VERSION)
    if field is None or field.derived:
        return schema
    if field.dtype != "int64" or field.shape:
        raise ValueError(f"policy_version must be int64 scalars per step, got {field}")
    from arrowbuf.schema import Schema   # noqa: the module's Schema is a type-checking import

    return Schema({n: f for n, f in schema.fields.items() if n != VERSION}).extended({VERSION: VERSION_FIELD})


def step_versions(writer_versions: np.ndarray, extra: dict, schema: Schema | None, sink: Any) -> np.ndarray | None:
    """A writer step's ``policy_version`` in ``extra``: checked (`next_versions`, against each
    env's ``writer_versions``) when given, else 0 for every env when the store has the column.
    Nothing is recorded yet: the step may still be refused. Once it is known to be good,
    `commit_versions` records the returned versions (None when none were given) and gives a
    local store without the column the column (0 in every row written before).

    Raises:
        ValueError: bad, out-of-range or decreasing versions, or a Ray store whose schema lacks
            the column.
    """
    if VERSION in extra:
        extra[VERSION] = next_versions(extra[VERSION], writer_versions)
        if schema is not None and VERSION not in schema.fields and getattr(sink, "add_version_column", None) is None:
            raise ValueError("this Ray store's schema has no policy_version column (its shards cannot add one "
                             "yet): give policy_version from the store's first write on, or declare the field "
                             "in its schema")
        return extra[VERSION]
    if schema is not None and VERSION in schema.fields:
        extra[VERSION] = np.zeros(len(writer_versions), np.int64)
    return None


def read_schema(schema: Schema | None, versions: np.ndarray | None) -> Schema | None:
    """The schema a writer step is read against: the store's, with the version column when the
    step gives versions that the store lacks (`commit_versions` adds it once the step is good)."""
    if versions is None or schema is None or VERSION in schema.fields:
        return schema
    return schema.extended({VERSION: VERSION_FIELD})


def commit_versions(writer_versions: np.ndarray | None, versions: np.ndarray | None, sink: Any) -> None:
    """Record a good step's ``versions`` (from `step_versions`) as each env's last (not with
    ``writer_versions`` None), and give the store the column if it lacks it."""
    if versions is None:
        return
    if VERSION not in sink.schema.fields:
        sink.add_version_column()
    if writer_versions is not None:
        writer_versions[...] = versions


def next_versions(value: Any, last: np.ndarray) -> np.ndarray:
    """A writer step's versions (one int for every env, or one per env), checked to be no lower
    than each env's ``last`` (not updated: `commit_versions` records them).

    Raises:
        ValueError: not ints >= 0, out of range, or lower than an env's previous version.
    """
    versions = np.ascontiguousarray(check_versions(value, len(last), "env"))
    older = np.flatnonzero(versions < last)
    if len(older):
        env = int(older[0])
        raise ValueError(f"policy_version of env {env} went back from {int(last[env])} to {int(versions[env])}; "
                         "versions are non-decreasing in each writer's order")
    return versions
