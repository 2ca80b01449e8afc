"""The Ray backend: shard actors, each running a `ShardEngine`, behind a router.

Modules, lowest first (each imports only those before it; tests/test_layers.py checks
that this list names every module here, in such an order):

- `options`: `RayOptions`, index layout, the lazy ``import ray``;
- `apart`: ragged and text fields in sealed blocks, and gathered into a batch beside the pooled ones;
- `ranks`: a reader's share of each global batch for one data-parallel rank (token lengths from the blocks);
- `handles`: the shard actors' handles and the sizes they last reported;
- `blocks`: `BlockRing`, a shard's rows sealed into immutable blocks of the object store;
- `lent`: `UnfilledRows`, lent episodes a shard placed without copying their rows until it reads them;
- `tails`: `OpenPieces`, a shard's stored pieces of episodes still open (transitions, not episodes);
- `shares`: `CapacityShares`, each shard's share of the capacity, following the writers' envs routed to it, and
  whether episodes fit their shards' shares (`unfit`);
- `dropped`: `DroppedWriters`, the deliveries of writers dropped without flush or close, their errors kept;
- `bundles`: a write request's many short episodes shipped as one array a field;
- `sink`: a writer's route to the shards (batching, delivery, errors);
- `persist`: what exports, checkpoints and Ray Data share (the shards write their own files);
- `shipping`: batches for train workers kept in the object store (refs, `resolve`);
- `actor`: `ShardServer`, the body of one shard actor;
- `start`: starting a store's named shard actors, or finding a running store's;
- `cache`: `BlockCache`, the blocks a reader fetched, within ``reader_cache_bytes``;
- `fresh`: fresh steps (``policy_version >= v``, or weighted by a `FreshnessSampler`)
  drawn by a reader from its views;
- `across`: reads that cross blocks: an episode's pieces sealed apart, read as one (`ViewRows`, `JoinedItems`);
- `block_reads`: `BlockReads`, a draw's items planned block by block, in drawn order;
- `gather`: `BlockGather`, ordered items of many blocks into one pooled TensorDict per batch;
- `views`: `ShardView`, a shard's blocks and episode table as a reader sees them;
- `reader`: `BlockReader`, a process's views of the shards' blocks, where samples are drawn (or asked of the
  shards: PER, rate limiters) and gathered, one `DrawLoop` per request;
- `priorities`: `PriorityUpdates`, priority updates waited for or left in flight, their errors kept;
- `gae`: `compute_gae` across shards, the value function called by the caller;
- `router`: `RayBackend`, what `ExperienceStore(backend="ray")` holds (and loads).

Nothing here imports `arrowbuf.store`, and importing this package does not import Ray.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arrowbuf.ray.shipping import resolve

__all__ = ["resolve"]


def __getattr__(name: str):
    # `resolve` loads on first use: importing a module of this package (`RayOptions`
    # from `options`) imports this package first, and need not import shipping's torch.
    import importlib
    import os

    if name == "resolve":
        from arrowbuf.ray.shipping import resolve

        return resolve
    # `arrowbuf.ray.options` after a bare `import arrowbuf.ray`
    if name.isidentifier() and not name.startswith("__") and os.path.isfile(
            os.path.join(os.path.dirname(__file__), name + ".py")):
        return importlib.import_module(f"arrowbuf.ray.{name}")
    raise AttributeError(f"module 'arrowbuf.ray' has no attribute {name!r}")
