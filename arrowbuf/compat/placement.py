"""Where a DataBuffer's data lives, from RLightning's own inputs: `resolve_placement`.

Inputs, in the seed's order of precedence:

- ``storage.num_shards`` in the buffer config (overrides everything);
- the ``cluster`` section passed as ``DataBuffer(config, cluster=...)``, as is:
  ``remote_storage`` (default True), ``buffer_worker_num`` (an int or ``"auto"``)
  and ``train_worker_num``;
- without it, what the seed reads: the ``RLIGHTNING_REMOTE_STORAGE`` environment
  variable and, when ``rlightning`` is importable and has one, its global resource
  manager (buffer and train worker counts, and the component distribution
  ``{node: {"buffer"|"train"|"env": {"ids": [...]}}}`` that node affinity uses).

Rules (the seed's): unified storage is one shard, a local one unless storage is
remote (then one Ray shard actor); sharded storage needs remote storage and has
one shard per buffer worker (``"auto"``: one per node that holds train workers).

Node affinity, as the seed's ``EpisodeTable``: with ``node_affinity_env`` env
worker ``<uuid>-<k>`` writes to a shard on env worker k's node; with
``node_affinity_train`` each shard serves the train workers on its node (a
node's train workers are split into contiguous blocks over the node's shards).
Without a component distribution everything is on the driver's node, so a
one-node cluster maps as the seed does.
"""

from __future__ import annotations

import difflib
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from arrowbuf._checks import is_int
from arrowbuf.compat.config import BufferSettings, plain_section

_CLUSTER_KEYS = ("remote_storage", "buffer_worker_num", "train_worker_num")


@dataclass(frozen=True)
class Placement:
    """A resolved placement.

    Attributes:
        backend: "local" (in the driver) or "ray" (shard actors).
        num_shards: storage shards.
        num_train_workers: batches `DataBuffer.sample` returns.
        shard_nodes: node id of each shard (None: Ray places them).
        env_nodes: env worker index -> node id (node_affinity_env).
        worker_shards: per train worker, the shards its batch is drawn from
            (node_affinity_train; None: drawn over all shards).
    """

    backend: str
    num_shards: int
    num_train_workers: int
    shard_nodes: tuple[str, ...] | None = None
    env_nodes: dict[int, str] = field(default_factory=dict)
    worker_shards: tuple[tuple[int, ...], ...] | None = None
    env_default_node: str | None = None   # node of env workers a defaulted (one-node) distribution does not list

    def shard_of_env(self, env_id: str) -> int | None:
        """The shard env worker ``env_id`` (``<uuid>-<k>``) writes to under node affinity, else None."""
        if not (self.env_nodes or self.env_default_node) or self.shard_nodes is None:
            return None
        head = env_id.split("/", 1)[0]
        suffix = head.rsplit("-", 1)[-1]
        node = self.env_nodes.get(int(suffix)) if suffix.isdigit() else None
        node = node if node is not None else self.env_default_node
        if node is None:
            raise ValueError(f"node_affinity_env: env id {env_id!r} does not end in '-<env worker index>' of a "
                             f"known env worker (known: {sorted(self.env_nodes)})")
        local = [s for s, n in enumerate(self.shard_nodes) if n == node]
        if not local:
            raise ValueError(f"node_affinity_env: env worker {suffix} is on node {node!r}, which holds no shard "
                             f"(shard nodes: {list(self.shard_nodes)})")
        return local[int(suffix) % len(local) if suffix.isdigit() else 0]


def _fail(path: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"cluster config {path!r}: got {value!r}, expected {expected}")


def _count(value: Any, path: str, allow_auto: bool = False) -> int | str | None:
    if value is None:
        return None
    if allow_auto and value == "auto":
        return "auto"
    if not is_int(value, 1):
        raise _fail(path, value, "an int >= 1" + (" or 'auto'" if allow_auto else ""))
    return int(value)


def driver_node() -> str | None:
    """This process's Ray node id, when Ray is imported and initialized (None otherwise)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return None
    return ray.get_runtime_context().get_node_id()


def _manager() -> Any:
    """RLightning's global resource manager, when rlightning is importable and has one."""
    try:
        from rlightning.utils.placement import get_global_resource_manager
    except ImportError:
        return None
    return get_global_resource_manager()


def _ids(components: Mapping[str, Any], kind: str) -> list[int]:
    return [int(i) for i in (components.get(kind) or {}).get("ids", [])]


def _distribution(given: Any, num_shards: int, num_workers: int, driver_node: str | None) -> dict[str, dict]:
    if given:
        return {str(node): dict(components) for node, components in dict(given).items()}
    node = driver_node or "driver"
    return {node: {"buffer": {"ids": list(range(num_shards))}, "train": {"ids": list(range(num_workers))},
                   "env": {"ids": []}}}


def _affinity(settings: BufferSettings, distribution: dict[str, dict], num_shards: int,
              num_workers: int) -> tuple[tuple[str, ...], dict[int, str], tuple[tuple[int, ...], ...] | None]:
    shard_nodes: list[str | None] = [None] * num_shards
    for node, components in distribution.items():
        for shard in _ids(components, "buffer"):
            if not 0 <= shard < num_shards:
                raise ValueError(f"component distribution: node {node!r} lists buffer {shard}, expected ids in "
                                 f"[0, {num_shards})")
            shard_nodes[shard] = node
    missing = [s for s, n in enumerate(shard_nodes) if n is None]
    if missing:
        raise ValueError(f"component distribution places no node for buffer shard(s) {missing}; every shard "
                         "needs a node with node affinity")
    env_nodes = {k: node for node, components in distribution.items() for k in _ids(components, "env")}
    worker_shards = None
    if settings.node_affinity_train:
        table: list[tuple[int, ...] | None] = [None] * num_workers
        for node, components in distribution.items():
            shards = [s for s, n in enumerate(shard_nodes) if n == node]
            workers = _ids(components, "train")
            if workers and not shards:
                raise ValueError(f"node_affinity_train: node {node!r} has train workers {workers} but no shard")
            for j, worker in enumerate(workers):
                if not 0 <= worker < num_workers:
                    raise ValueError(f"component distribution: node {node!r} lists train worker {worker}, "
                                     f"expected ids in [0, {num_workers})")
                table[worker] = (shards[j * len(shards) // len(workers)],)
        if any(entry is None for entry in table):
            raise ValueError(f"node_affinity_train: train workers {[w for w, e in enumerate(table) if e is None]} "
                             "are on no node of the component distribution")
        worker_shards = tuple(table)
    return tuple(shard_nodes), env_nodes, worker_shards


#: RLightning's ``ClusterConfig`` fields (and Hydra's ``defaults`` list, which cluster YAML files carry).
CLUSTER_KEYS = ("ray_address", "train_worker_num", "eval_worker_num", "train_each_gpu_num", "eval_each_gpu_num",
                "buffer_worker_num", "remote_train", "remote_eval", "remote_storage", "remote_env", "is_colocated",
                "enable_offload", "rollout_env_interaction", "placement", "resource_pool", "defaults")


class ClusterKeyWarning(UserWarning):
    """A ``cluster`` key RLightning's config does not know (its pydantic model accepts it silently)."""


def warn_unknown_cluster_keys(section: Mapping[str, Any]) -> None:
    """Warn, naming the key and listing the known ones, for every key of ``section`` not in `CLUSTER_KEYS`.

    A warning, not an error: the seed accepts any key, and one of RLightning's own example
    configs (wbc_tracking 1train_1eval.yaml) spells ``remote_storge``; its value is ignored,
    as the seed ignores it, so ``remote_storage`` keeps its default."""
    for key in section:
        if key in CLUSTER_KEYS:
            continue
        close = difflib.get_close_matches(str(key), CLUSTER_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        default = "" if not close else (f"; {close[0]} is {section[close[0]]!r}" if close[0] in section
                                        else f"; {close[0]} keeps its default")
        warnings.warn(ClusterKeyWarning(
            f"cluster config: unknown key {key!r} (value {section[key]!r}) is ignored{hint}{default}; known keys: "
            f"{', '.join(CLUSTER_KEYS)}"), stacklevel=4)


def resolve_placement(settings: BufferSettings, cluster: Any = None, *, num_train_workers: int | None = None,
                      backend: str | None = None, num_shards: int | None = None,
                      component_distribution: Mapping[str, Any] | None = None,
                      driver_node: str | None = None) -> Placement:
    """Resolve shards, backend, train workers and affinity (see the module docstring).

    Args:
        settings: the checked buffer config.
        cluster: RLightning's ``cluster`` section (dict or object), or None.
        num_train_workers, backend, num_shards: explicit overrides (None: from the inputs).
        component_distribution: RLightning's node -> component ids map (None: the
            resource manager's, else everything on ``driver_node``).
        driver_node: the node id of this process (for one-node defaults).

    Raises:
        ValueError: a bad cluster value or override, sharded storage without
            remote storage, or an affinity map that does not cover the shards.
    """
    manager = None
    if cluster is not None:
        section = plain_section(cluster, "cluster")
        warn_unknown_cluster_keys(section)
        remote = section.get("remote_storage", True)
        if not isinstance(remote, bool):
            raise _fail("remote_storage", remote, "true or false")
        buffer_workers = _count(section.get("buffer_worker_num"), "buffer_worker_num", allow_auto=True)
        workers = _count(section.get("train_worker_num"), "train_worker_num")
    else:
        remote = os.environ.get("RLIGHTNING_REMOTE_STORAGE", "0") == "1"
        manager = _manager()
        buffer_workers = workers = None
        if manager is not None:
            scheduling = manager.get_scheduling()
            workers = getattr(getattr(scheduling, "train_worker", None), "worker_num", None)
            buffer_workers = getattr(getattr(scheduling, "buffer_worker", None), "worker_num", None)
            if component_distribution is None:
                component_distribution = manager.get_component_distribution()
    if num_train_workers is not None:
        workers = _count(num_train_workers, "num_train_workers")
    workers = workers or 1
    if backend not in (None, "local", "ray"):
        raise ValueError(f"backend must be 'local', 'ray' or None, got {backend!r}")
    if num_shards is not None:
        _count(num_shards, "num_shards")

    if settings.storage_type == "sharded":
        if backend == "local" or (cluster is not None and not remote):
            raise ValueError("buffer config 'storage.type' is 'sharded', which needs remote storage (Ray shard "
                             f"actors); got {'backend=local' if backend == 'local' else 'cluster.remote_storage=false'}")
        if buffer_workers == "auto":
            nodes = [n for n, c in dict(component_distribution or {}).items() if _ids(c, "train")]
            buffer_workers = max(len(nodes), 1)
        shards = settings.num_shards or num_shards or buffer_workers or 1
        kind = "ray"
    else:
        if num_shards not in (None, 1):
            raise ValueError(f"num_shards={num_shards} needs storage.type='sharded' in the config")
        shards = 1
        kind = backend or ("ray" if remote else "local")

    if kind == "local" or not (settings.node_affinity_env or settings.node_affinity_train):
        return Placement(kind, int(shards), int(workers))
    distribution = _distribution(component_distribution, shards, workers, driver_node)
    shard_nodes, env_nodes, worker_shards = _affinity(settings, distribution, shards, workers)
    default_node = None if component_distribution else (driver_node or "driver")
    if not settings.node_affinity_env:
        env_nodes, default_node = {}, None
    return Placement(kind, int(shards), int(workers), shard_nodes, env_nodes, worker_shards, default_node)


def check_env_nodes(placement: Placement, env_ids: Sequence[str]) -> None:
    """Every env id resolves to a shard under node affinity (raises at `init`, not at the first write)."""
    for env_id in env_ids:
        placement.shard_of_env(env_id)
