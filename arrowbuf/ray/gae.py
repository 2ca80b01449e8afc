"""`compute_gae` on a Ray store: every shard computes its own episodes' advantages.

Episodes never cross shards, so each shard runs its engine's GAE. Only the
values of final observations need the caller: ``bootstrap_value`` is the
user's value function and runs in the caller's process. So there are two
steps: every shard sends the final observations of its episodes that
bootstrap from them (after checking its fields), the caller calls
``bootstrap_value`` once on all of them together (as a local store does), and
every shard writes its columns with its share of the values, matched by
episode id.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from arrowbuf.advantages import as_observations, bootstrap_values
from arrowbuf.ray.handles import ShardHandles
from arrowbuf.schema import Schema


def compute_gae(shards: ShardHandles, gamma: float, lam: float, value_key: str,
                bootstrap_value: Callable | None, schema: Schema) -> tuple[int, Schema | None]:
    """Advantages and value targets on every shard (``schema``: the store's): (transitions written,
    the schema with the derived fields, or None when no shard holds data).

    An episode cut after a final observation that is stored between the two
    steps has no value: its shard raises ValueError (the others have written;
    call again). Derived columns are not in durable shards' logs: a restarted
    shard holds zeros there until the next call.

    Raises:
        ValueError: as the local `compute_gae` (missing fields, no or a bad
            ``bootstrap_value``), raised before any shard writes.
        ShardError: a dead shard.
    """
    found = shards.broadcast("gae_final_observations", value_key)
    cut = {shard: ids for shard, (ids, _) in found.items() if len(ids)}
    values: dict[int, np.ndarray] = {}
    if cut:
        import torch

        # The shards send numpy arrays (a shard never imports torch: the first GAE of a new store took
        # ~3 s a shard to import torch and tensordict there); the TensorDict is made here.
        observations = torch.cat([as_observations(found[shard][1], schema, len(ids)) for shard, ids in cut.items()],
                                 dim=0)
        every = bootstrap_values(bootstrap_value, observations)
        bounds = np.cumsum([len(ids) for ids in cut.values()])[:-1]
        values = dict(zip(cut, np.split(every, bounds)))
    refs = {shard: shards.call(shard, "compute_gae", gamma, lam, value_key, ids, values.get(shard, np.zeros(0)))
            for shard, (ids, _) in found.items()}
    written, schema = 0, None
    for count, schema_json in shards.get(refs).values():
        written += count
        if schema_json is not None:
            schema = Schema.from_json(schema_json)
    return written, schema
