"""The Ray backend: shard actors, each running a `ShardEngine`, behind a router.

Modules, lowest first (each imports only those before it):

- `options`: `RayOptions`, index layout, the lazy ``import ray``;
- `handles`: the shard actors' handles and the sizes they last reported;
- `persist`: what exports, checkpoints and Ray Data share (the shards write their own files);
- `blocks`: `BlockRing`, a shard's rows sealed into immutable blocks of the object store;
- `actor`: `ShardServer`, the body of one shard actor;
- `sink`: a writer's route to the shards (batching, delivery, errors);
- `start`: starting a store's named shard actors, or finding a running store's;
- `gae`: `compute_gae` across shards, the value function called by the caller;
- `shipping`: batches for train workers kept in the object store (refs, `resolve`);
- `staging`: `Staged`, a draw's items planned block by block, in drawn order;
- `gather`: `BlockGather`, staged items of many blocks into one pooled TensorDict per batch;
- `views`: `ShardView`, a shard's blocks and episode table as a reader sees them;
- `reader`: `BlockReader`, a process's views of the shards' blocks, where samples are drawn (or asked of the
  shards: PER, rate limiters) and gathered, one `DrawLoop` per request;
- `router`: `RayBackend`, what `ExperienceStore(backend="ray")` holds (and loads).

Nothing here imports `arrowbuf.store`, and importing this package does not import Ray.
"""

from arrowbuf.ray.shipping import resolve

__all__ = ["resolve"]
