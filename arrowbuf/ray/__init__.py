"""The Ray backend: shard actors, each running a `ShardEngine`, behind a router.

Modules, lowest first (each imports only those before it):

- `options`: `RayOptions`, index layout, the lazy ``import ray``;
- `handles`: the shard actors' handles and the sizes they last reported;
- `persist`: what exports, checkpoints and Ray Data share (the shards write their own files);
- `actor`: `ShardServer`, the body of one shard actor;
- `sink`: a writer's route to the shards (batching, delivery, errors);
- `start`: starting a store's named shard actors, or finding a running store's;
- `gae`: `compute_gae` across shards, the value function called by the caller;
- `shipping`: batches for train workers kept in the object store (refs, `resolve`);
- `assemble`: batches out of the shards' answers;
- `router`: `RayBackend`, what `ExperienceStore(backend="ray")` holds (and loads).

Nothing here imports `arrowbuf.store`, and importing this package does not import Ray.
"""

from arrowbuf.ray.shipping import resolve

__all__ = ["resolve"]
