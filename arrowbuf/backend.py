"""`Backend`: what `ExperienceStore` needs of the backend it holds.

The store checks every argument, reads episodes against the schema and keeps
the named writers; everything else is a call on its backend. Two implement this
protocol: `arrowbuf.local.LocalBackend` (one `ShardEngine` in this process) and
`arrowbuf.ray.router.RayBackend` (shard actors, each running the same engine).
`tests/test_layers.py` checks that both have every member below with these
parameter names, and `tests/test_contract.py` that they behave alike.

Arguments arrive checked. ``args`` is a `SampleArgs` (a sample's n-step and
frame-stack look-ups, one frozen value); indices are int64 transition indices
(``shard << 48 | local index`` on Ray); ``device`` is a `torch.device` or None.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping, Protocol, Sequence

import numpy as np
import pyarrow as pa

from arrowbuf.engine import ShardEngine
from arrowbuf.sample_args import SampleArgs
from arrowbuf.schema import Schema
from arrowbuf.shard import Episode

if TYPE_CHECKING:
    from tensordict import TensorDict


class EpisodeSink(Protocol):
    """Where a `StepWriter` sends sealed episodes: a local store, or Ray shards."""

    @property
    def schema(self) -> Schema | None: ...

    @property
    def capacity(self) -> int | None:
        """Transitions one episode may hold at most (a shard's capacity); None when unknown."""

    def set_schema(self, schema: Schema) -> None:
        """Adopt ``schema`` if none is set yet."""

    def retime(self, timeout: float | None) -> None:
        """Each later write waits at most ``timeout`` (a claimed restored writer's)."""

    def write(self, episode: Episode) -> None:
        """Store one sealed episode (or queue it); raise what the store refuses."""

    def commit(self) -> None:
        """End of a writer call: send what was written during it."""

    def flush(self) -> None:
        """Wait until everything written is stored; raise any error from it."""

    def close(self) -> None:
        """`flush`, then release what delivers the writes (a Ray sink's timer thread)."""


class Backend(Protocol):
    """The members `ExperienceStore` calls (see the module docstring)."""

    #: "local" or "ray": the store's ``backend`` argument.
    kind: str

    @property
    def num_shards(self) -> int: ...

    @property
    def name(self) -> str | None:
        """A Ray store's name (for `ExperienceStore.attach`); None locally."""

    @property
    def engine(self) -> ShardEngine | None:
        """The in-process engine of a local store; None on Ray (its engines live in the actors)."""

    @property
    def storage_device(self) -> Any:
        """The torch device of a torch arena (`arrowbuf.arena`), or None."""

    @property
    def schema(self) -> Schema | None: ...

    def size(self, exact: bool = True) -> tuple[int, int]:
        """(transitions, episodes); on Ray asked of every shard, or with ``exact=False``
        as last reported, never waiting."""

    # -- writing -------------------------------------------------------------------

    def add(self, episode: Episode, schema: Schema | None, timeout: float | None) -> int:
        """Store one checked episode (routed by its env id); its id."""

    def add_many(self, episodes: list[Episode], schema: Schema | None, timeout: float | None,
                 shard: int | None) -> list[int]:
        """Store checked episodes in order (on ``shard`` if given); their ids. One refused
        episode does not take the others with it: they are stored, then the error says how
        many were refused (`arrowbuf.errors.refused_in_batch`)."""

    def pin(self, env_id: str, shard: int) -> None:
        """Route the `add` episodes of ``env_id`` to ``shard`` unless it already has one."""

    def sink(self, timeout: float | None, env_ids: Sequence[str] | None) -> Any:
        """A new `StepWriter`'s sink (`EpisodeSink`)."""

    def import_episodes(self, episodes: Iterable[Episode]) -> int:
        """Store the checked episodes of an import, never refused by the rate limiter; how many."""

    def flush(self) -> None:
        """Wait for this process's writes (and on Ray refresh sizes and manifests)."""

    def clear(self) -> None: ...

    def close(self) -> None:
        """Release what the backend holds (a Ray store ends its shard actors)."""

    # -- reading -------------------------------------------------------------------

    def sample(self, batch_size: int, args: SampleArgs, device: Any, pin_memory: bool, timeout: float | None,
               num_workers: int | None, worker_nodes: Sequence[str] | None,
               keys: Any = None, min_version: int | None = None) -> TensorDict | list[TensorDict]:
        """A batch drawn by the store's sampler, split into ``num_workers`` when given; of steps
        of ``policy_version >= min_version`` only, when given (`arrowbuf.versions`)."""

    def sample_iter(self, batch_size: int, args: SampleArgs, device: Any, prefetch: int,
                    batches_per_request: int | None, min_version: int | None = None,
                    keys: Any = None) -> Iterator[TensorDict]:
        """Endless batches as `sample` gives them (Ray: requests kept in flight); of steps of
        ``policy_version >= min_version`` only, when given (`arrowbuf.versions`); ``keys``
        (checked before it returns) as in `sample`."""

    def iter_batches(self, batch_size: int, shuffle: bool, drop_last: bool, device: Any,
                     keys: Any = None, min_version: int | None = None, split: Any = None) -> Iterator[TensorDict]:
        """One epoch: every live transition (of ``policy_version >= min_version``, when
        given) once, skipping those evicted meanwhile; ``split``: this rank's share of each
        batch (`arrowbuf.groups.rank_split`; the embedded store's only, for now)."""

    def evict(self, min_version: int) -> int:
        """Free the oldest episodes whose steps are all older than ``min_version``; how many."""

    def gather(self, index: np.ndarray, device: Any) -> TensorDict:
        """The transitions of ``index`` in that order; KeyError naming how many are not live."""

    def gather_refs(self, indices: list[np.ndarray], extras: list[dict], flat_next: bool) -> list:
        """ObjectRefs of batches left in Ray's object store (ValueError locally)."""

    def live_ranges(self) -> list[tuple[int, int]]: ...

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def update_priorities(self, index: np.ndarray, priority: np.ndarray, wait: bool = True) -> int | None:
        """How many indices were live; None for a Ray update left in flight (``wait=False``)."""

    def compute_gae(self, gamma: float, lam: float, value_key: str, bootstrap_value: Any) -> int: ...

    def episodes(self, include_open: bool = False) -> pa.Table: ...

    def episode(self, episode_id: int) -> pa.RecordBatch: ...

    def to_arrow(self) -> pa.Table: ...

    def stats(self) -> dict: ...

    # -- persistence ---------------------------------------------------------------

    def export_steps(self, steps_dir: Path, schema: pa.Schema, **options: Any) -> tuple[pa.Table, list]:
        """Write every shard's rows as Parquet parts into ``steps_dir`` (`arrowbuf.parquet`);
        (episode table, file entries)."""

    def save(self, path: str | Path, info: Mapping[str, Any], writer_states: Callable[[], dict],
             progress: bool | None) -> Path:
        """Checkpoint into ``path`` with the store's ``info`` (`arrowbuf.checkpoint`,
        `arrowbuf.ray.persist`); ``writer_states()`` gives the open episodes of the
        store's writers (a Ray checkpoint does not keep them)."""

    def to_ray_dataset(self) -> Any:
        """The rows as a `ray.data.Dataset` (`arrowbuf.ray.persist`; ValueError locally)."""
