"""The plain uniform sample, drawn and gathered straight into its pooled batch.

The generic path (`ShardEngine.sample`) draws a `Selection`, computes the batch's
extras (``index``, ``episode_id``, ``step``) as arrays of their own, then the
gather copies them into the pooled slot beside the fields. For the most common
call of off-policy replay (a uniform ``sample(batch_size)`` onto the CPU, no
n-step, no frame stack) this path claims the slot first and writes each extra
where the batch keeps it: the draw into ``index``, the episode ids by a take
with ``out=``, the steps by one assignment. W1 (256 rows from a million, numpy
ideal 38.4 us a batch here, min of interleaved timeit runs): the generic path
41.6 us, this one 32.5 us (a prototype of it).

The same path serves ``min_version`` (a uniform draw over the spans of qualifying
steps, `arrowbuf._version_spans`) and a `arrowbuf.mixture.Mixture`, whose sources
each fill their share of one pooled batch (`fill_plain_uniform` into given views).

It draws from the generator exactly as `UniformSampler.sample` does (same calls,
same order), so a seeded store samples the same batches either way
(tests/test_direct.py compares them); with ``min_version``, as
`arrowbuf.versions.fresh_selection` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


from arrowbuf._bounds import check_batch
from arrowbuf.samplers import UniformSampler, select_indices
from arrowbuf.tensors import take_fields
from arrowbuf.versions import fresh_spans, no_fresh_step, span_selection

if TYPE_CHECKING:
    from tensordict import TensorDict

    import numpy as np

    from arrowbuf.shard import Shard

_UNIFORM = UniformSampler()


def sample_plain_uniform(shard: Shard, rng: np.random.Generator, batch_size: int,
                         keys: frozenset | None, min_version: int | None = None) -> TensorDict:
    """A uniform batch of ``batch_size`` transitions of ``shard`` (which holds some; of
    version >= ``min_version`` when given), its fields ``keys`` (checked; None: all), on
    the CPU, in a pooled slot.

    Raises:
        ResourceError: the batch cannot be allocated (nothing drawn).
        EmptyStoreError: no transition of ``min_version`` (nothing drawn).
    """
    check_batch(shard.schema, _UNIFORM, shard.table, batch_size)
    plain = shard.gatherer.plain_layout(batch_size, keys)
    spans = None
    if min_version is not None:
        spans = fresh_spans(shard, min_version)
        if spans is None:
            raise no_fresh_step(shard, min_version)
    outs, batch = shard.gatherer.claim(plain[0])
    fill_plain_uniform(shard, rng, batch_size, plain, outs, spans)
    return batch


def fill_plain_uniform(shard: Shard, rng: np.random.Generator, batch_size: int, plain: tuple,
                       outs: list[np.ndarray], spans: object = None) -> None:
    """Draw ``batch_size`` transitions (among ``spans`` when given: `arrowbuf._version_spans.Spans`)
    and gather them into ``outs``, views laid out as ``plain`` (`Gather.plain_layout`) says."""
    layout, at_index, at_episode, at_step = plain
    table = shard.table
    if spans is None:   # every sampleable transition (sealed episodes, then open tails): `UniformSampler.sample`'s draw
        chosen = select_indices(table, _UNIFORM.draw(rng, batch_size, table, outs[at_index]))
    else:   # steps of policy_version >= v: the draw `fresh_selection` makes
        chosen = span_selection(rng, batch_size, spans, table, outs[at_index])
    if table.open_total:   # open steps' indices as tokens that keep naming their step
        outs[at_index][...] = table.public_indices(chosen.indices, chosen.pos)
    table.ecol("episode").take(chosen.pos, 0, outs[at_episode], "clip")
    outs[at_step][...] = chosen.step
    take_fields(layout, outs, (chosen.rows, chosen.rows, None))


def draw_ahead(shard: Shard, rng: np.random.Generator, batch_size: int) -> tuple[np.ndarray, ...]:
    """(index, episode_id, step, row) of ``batch_size`` transitions drawn as `fill_plain_uniform`
    draws them (the same generator calls: ``k`` batches drawn at once are the draws of ``k``
    calls in turn), for `fill_drawn` to gather a slice at a time."""
    table = shard.table
    chosen = select_indices(table, _UNIFORM.draw(rng, batch_size, table))
    return (table.public_indices(chosen.indices, chosen.pos), table.ecol("episode").take(chosen.pos), chosen.step,
            chosen.rows)


def fill_drawn(plain: tuple, outs: list[np.ndarray], drawn: tuple[np.ndarray, ...], start: int, stop: int) -> None:
    """Gather the transitions ``start:stop`` of `draw_ahead`'s ``drawn`` into ``outs`` (as
    `fill_plain_uniform` lays them out)."""
    layout, at_index, at_episode, at_step = plain
    index, episode_id, step, rows = drawn
    outs[at_index][...] = index[start:stop]
    outs[at_episode][...] = episode_id[start:stop]
    outs[at_step][...] = step[start:stop]
    rows = rows[start:stop]
    take_fields(layout, outs, (rows, rows, None))
