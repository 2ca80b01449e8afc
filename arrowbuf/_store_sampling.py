"""Sampling from `ExperienceStore`, and what training writes back: priorities and advantages.

`StoreSampling` holds these methods of the store (the facade in `arrowbuf.store`
is its only subclass): samples, endless sample streams, epochs, gathers by index,
the live index ranges, priority updates and GAE. Each checks its arguments once
and hands the work to the store's backend.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from tensordict import TensorDict

from arrowbuf._checks import (check_bool, check_choice, check_device, check_fraction, check_index_batches,
                              check_int, check_priorities, check_sample_args, check_timeout, check_worker_nodes,
                              check_workers, to_numpy)
from arrowbuf.errors import EmptyStoreError, describe
from arrowbuf.samplers import PrioritizedSampler, WithoutReplacementSampler
from arrowbuf.torchrl_layout import check_layout, to_torchrl


class StoreSampling:
    """The sampling methods of `arrowbuf.ExperienceStore`."""

    def sample(self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
               device: torch.device | str | None = None, pin_memory: bool = False,
               timeout: float | None = None, num_workers: int | None = None,
               worker_nodes: Sequence[str] | None = None,
               keys: list | None = None, layout: str = "arrowbuf") -> TensorDict | list[TensorDict]:
        """Sample transitions with the store's sampler.

        Args:
            batch_size: transitions (or windows, or episodes) to draw.
            n_step: with n > 1, ``"reward"`` is the discounted sum of the next n
                rewards (fewer at the episode end), ``("next", obs)`` the observation
                after them, ``"terminated"``/``"truncated"`` the flags of the last of
                them, ``"discount"`` gamma^k and ``"n_steps"`` k.
            gamma: discount of the n-step return.
            frame_stack: with k > 1, observation fields (and their ``next``) hold the
                last k frames on a new axis after the batch dims, oldest first, the
                episode's first frame repeated before it starts.
            device: where the tensors go (default: CPU).
            pin_memory: gather into pinned host memory (ignored without CUDA).
            timeout: seconds to wait for the rate limiter; None raises at once.
            num_workers: split the batch into this many disjoint, equal batches
                (one per train worker) and return them as a list.
            worker_nodes: with ``num_workers`` on a Ray store, the node id of each
                worker: each draws from the shards on its node.
            keys: gather only these fields (names or key tuples; ``("next", k)``
                only when named), plus ``"index"``, ``"episode_id"``, ``"step"``
                and the sampler's extras; None gathers every field.
            layout: "arrowbuf", or "torchrl": the keys TorchRL's losses read
                (``"observation"``, ``("next", "reward" / "done" / "terminated" /
                "truncated")``, ``"priority_weight"``; `arrowbuf.torchrl_layout`).

        Returns:
            A TensorDict of batch size [batch_size] ([batch_size, L] for sequence
            and episode samplers): every field at t, ``("next", obs)`` for
            observation fields, ``"index"`` (transition indices, for
            `update_priorities`), ``"episode_id"`` and ``"step"``, plus the
            sampler's ``"weight"`` or ``"mask"``. Its memory is reused by a later
            sample once nothing refers to it (the batch, its tensors, or views,
            slices or numpy arrays of them): what you keep is never overwritten.

        Raises:
            ValueError: a bad argument.
            EmptyStoreError: the store holds no transition.
            RateLimited: the rate limiter refuses the sample (after ``timeout``).
        """
        batch_size = check_int("batch_size", batch_size, 1)
        # The schema matters only for n_step > 1 (and is 4 calls deep): not read otherwise.
        args = check_sample_args(n_step, gamma, frame_stack, self.schema if n_step != 1 else None)
        device = check_device(device)
        timeout = check_timeout(timeout)
        pin_memory = check_bool("pin_memory", pin_memory)
        num_workers = check_workers(batch_size, num_workers)
        check_worker_nodes(self.backend, num_workers, worker_nodes)
        if num_workers is not None and isinstance(self.sampler, WithoutReplacementSampler) \
                and not self.sampler.drop_last:
            raise ValueError("num_workers needs full batches; WithoutReplacementSampler(drop_last=False) "
                             "returns a short one at each epoch's end: use drop_last=True")
        torchrl = check_layout(layout) == "torchrl"
        try:
            batch = self._backend.sample(batch_size, args, device, pin_memory, timeout, num_workers, worker_nodes,
                                         keys)
        except EmptyStoreError as err:
            raise self._empty_error(err) from None
        if not torchrl:
            return batch
        schema = self.schema
        return [to_torchrl(b, schema) for b in batch] if num_workers is not None else to_torchrl(batch, schema)

    def _empty_error(self, err: EmptyStoreError) -> EmptyStoreError:
        """``err``, saying what this process's writers hold in open episodes (not stored yet)."""
        held = {name: int(w.open_steps.sum()) for name, w in self._writers.live().items()}
        held = {name: steps for name, steps in held.items() if steps}
        if not held:
            return err
        return EmptyStoreError(
            f"{err}. This process's writers hold {sum(held.values())} steps of open episodes "
            f"({', '.join(f'{n!r}: {k}' for n, k in held.items())}), which are stored when their episodes end: "
            "call writer.flush() to cut and store them now (e.g. at the end of a rollout), or sample once an "
            "episode has ended")

    def sample_iter(self, batch_size: int, prefetch: int = 4, batches_per_request: int | None = None, *,
                    n_step: int = 1, gamma: float = 0.99, frame_stack: int = 1,
                    device: torch.device | str | None = None, layout: str = "arrowbuf") -> Iterator[TensorDict]:
        """Endless batches, as `sample` would give them. A Ray store keeps ``prefetch``
        requests in flight per shard so that sampling overlaps training.

        Args:
            batch_size: items per batch.
            prefetch: on a Ray store whose samplers draw in the shards (prioritized,
                rate-limited, without replacement), index requests kept in flight.
            batches_per_request: on a Ray store that draws here (uniform, sequence,
                episode samplers), batches drawn and gathered together (each an
                independent draw, in drawn order); default: as many as fit in
                ``arrowbuf.ray.staging.STAGE_BYTES`` (8 MiB of the fields staged
                block by block: large rows such as pixels are copied straight from
                the blocks and do not count), at most 16. A write of
                this process, a `flush` or new manifests drop the batches not yet
                returned (the next one holds the write). Batches of a draw are
                gathered into one pooled buffer of at most
                ``arrowbuf.ray.gather.GROUP_BYTES`` (4 MiB): a batch you keep is never
                overwritten, and keeps that buffer from reuse. Ignored by a local store.
            n_step, gamma, frame_stack, device, layout: as in `sample`.

        Raises:
            ValueError: a bad argument.
        """
        batch_size = check_int("batch_size", batch_size, 1)
        prefetch = check_int("prefetch", prefetch, 1)
        if batches_per_request is not None:
            batches_per_request = check_int("batches_per_request", batches_per_request, 1)
        args = check_sample_args(n_step, gamma, frame_stack, self.schema)
        device = check_device(device)
        torchrl = check_layout(layout) == "torchrl"
        batches = self._backend.sample_iter(batch_size, args, device, prefetch, batches_per_request)
        return self._torchrl(batches) if torchrl else batches

    def iter_batches(self, batch_size: int, shuffle: bool = True, drop_last: bool = False, *,
                     epochs: int = 1, device: torch.device | str | None = None,
                     keys: list | None = None, layout: str = "arrowbuf") -> Iterator[TensorDict]:
        """Every stored transition once per epoch (on-policy PPO epochs), in batches.

        Each epoch gathers each transition once, in a fresh random order (from the
        store's generator; the first epoch's order is drawn by this call, each
        later one when it starts). Transitions evicted while an epoch runs are
        skipped, not replaced; those added join the next epoch.

        With ``shuffle=False`` on a local store, a batch whose transitions lie on
        contiguous arena rows (inside one episode) is a view of the arena, not a
        copy: it aliases the store and changes when the ring overwrites those rows.

        Args:
            batch_size: transitions per batch.
            shuffle: random order, else insertion order.
            drop_last: drop each epoch's last batch if it is short.
            epochs: passes over the store.
            device: where the tensors go.
            keys: the fields to gather, as in `sample`.
            layout: "arrowbuf" or "torchrl", as in `sample`.

        Raises:
            ValueError: a bad argument.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(100, seed=0)
            >>> _ = store.add_episode({"obs": np.zeros((11, 2)), "action": np.zeros(10),
            ...                        "terminated": np.arange(10) == 9})
            >>> [len(b) for b in store.iter_batches(4, epochs=2)]
            [4, 4, 2, 4, 4, 2]
        """
        batch_size = check_int("batch_size", batch_size, 1)
        shuffle = check_bool("shuffle", shuffle)
        drop_last = check_bool("drop_last", drop_last)
        epochs = check_int("epochs", epochs, 1)
        device = check_device(device)
        torchrl = check_layout(layout) == "torchrl"
        first = self._backend.iter_batches(batch_size, shuffle, drop_last, device, keys)
        if epochs > 1:
            first = self._epochs(first, epochs, batch_size, shuffle, drop_last, device, keys)
        return self._torchrl(first) if torchrl else first

    def _torchrl(self, batches: Iterator[TensorDict]) -> Iterator[TensorDict]:
        for batch in batches:
            yield to_torchrl(batch, self.schema)

    def _epochs(self, first: Iterator[TensorDict], epochs: int, *args: Any) -> Iterator[TensorDict]:
        yield from first
        for _ in range(epochs - 1):
            yield from self._backend.iter_batches(*args)

    def gather(self, index: Any, *, device: torch.device | str | None = None) -> TensorDict:
        """The transitions of ``index`` (values of a batch's ``"index"``), in that order.

        Reads by index, as a trainer that keeps indices or the RLightning API
        does; it is not counted as a sample.

        Raises:
            ValueError: ``index`` is not a 1-D array of ints.
            KeyError: some of the indices are not live (evicted, cleared, never written).
        """
        array, _ = to_numpy(index, "index")
        if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"index must be a 1-D array of ints, got {describe(array)}")
        return self._backend.gather(array.astype(np.int64), check_device(device))

    def gather_refs(self, indices: Sequence[Any], *, extras: Sequence[Mapping[str, Any]] | None = None,
                    next_keys: str = "nested") -> list:
        """Ray only: batches for train workers, left in Ray's object store; their ObjectRefs.

        The shards gather each batch and keep it in the object store (a batch drawn
        from several shards is assembled by a Ray task next to them), so this
        process holds refs, never rows: hand them to train workers, where
        ``ray.get(ref)``, `arrowbuf.ray.resolve`, or Ray resolving a ref passed as
        a task or actor argument gives a TensorDict of read-only views of the
        object store (clone before writing in place). Waits until every batch is
        gathered, so errors are raised here.

        Args:
            indices: one array of indices (values of a batch's ``"index"``) per
                batch, 1-D, or 2-D for a [n, L] batch.
            extras: per batch, more fields (name -> array shaped like its indices,
                e.g. a ``"mask"``).
            next_keys: "nested" (``batch["next", "obs"]``) or "flat" (``"next_obs"``,
                RLightning's names).

        Raises:
            ValueError: a bad argument, or a local store.
            KeyError: some indices are not live (nothing is handed out).
        """
        check_choice("next_keys", next_keys, ("nested", "flat"))
        batches, fields = check_index_batches(indices, extras)
        return self._backend.gather_refs(batches, fields, next_keys == "flat")

    def live_ranges(self) -> list[tuple[int, int]]:
        """[first, stop) of the live indices of each shard (a shard's indices are contiguous)."""
        return self._backend.live_ranges()

    def episode_spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard, first index, transitions) of every live episode, shard by shard, oldest first."""
        return self._backend.episode_spans()

    def update_priorities(self, index: Any, priority: Any, *, wait: bool = True) -> int | None:
        """Set the priorities of sampled transitions (`PrioritizedSampler` only).

        Args:
            index: a batch's ``"index"`` (tensor or array of ints).
            priority: new priorities (e.g. ``td_error.abs()``), same length, >= 0.
            wait: on a Ray store, False sends the update and returns None at once,
                sparing the learner a round trip per step: the shards apply it before
                any later sample of this process draws from them (in call order;
                with a rate limiter not guaranteed), its error (a dead shard) is
                raised by the next ``update_priorities``, ``sample``, ``flush`` or
                ``close``, and at most ``RayOptions.max_in_flight`` updates per shard
                stay unanswered (`arrowbuf.ray.priorities`). A local store applies
                the update at once either way.

        Returns:
            How many indices were still live; the others (evicted since the sample)
            are ignored, never applied to the rows that replaced them. None for an
            update left in flight (``wait=False`` on a Ray store).

        Raises:
            ValueError: not a prioritized store, or mismatched / negative / non-finite input
                (nothing is sent).
        """
        sampler = self.sampler
        if not isinstance(sampler, PrioritizedSampler):
            raise ValueError(f"update_priorities needs a PrioritizedSampler; this store uses {sampler!r}")
        wait = check_bool("wait", wait)
        index, priority = check_priorities(index, priority, sampler.alpha, sampler.eps, self.capacity)
        return self._backend.update_priorities(index, priority, wait)

    def compute_gae(self, gamma: float = 0.99, lam: float = 0.95, *, value_key: str = "value",
                    bootstrap_value: Callable[[TensorDict], Any] | None = None) -> int:
        """Generalized advantages of every stored transition, written as new columns.

        Writes ``"advantage"`` and ``"value_target"`` (advantage + value; TorchRL's
        names), float32 per step. They extend the schema as *derived* fields: they
        are sampled like any field (``batch["advantage"]``) and exported to
        Parquet; episodes written later need not carry them and hold zeros until
        the next call; rows that are no transitions (an episode's final
        observation) hold 0 in both. Vectorized over all episodes (one vector
        step per step index, not a Python loop over steps), reading and writing
        the arena's rows as slices where the episodes lie close together.

        What the last transition of an episode bootstraps from:
            - terminated: nothing (the return ends);
            - cut after its final observation (truncated, or cut by a writer's
              ``flush()`` at the end of a rollout): the value of that final
              observation, ``bootstrap_value(final_obs)``, where ``final_obs`` is
              a TensorDict [n] of the observation fields of those n episodes and
              the result holds n values (on a local store its tensors may view the
              store's rows: read them during the call, clone what you keep);
            - stored without a final observation: the value of its last stored
              step (that step has no next observation, so it is no transition).

        Args:
            gamma: discount in [0, 1].
            lam: GAE's lambda in [0, 1].
            value_key: the scalar step field holding V(s_t).
            bootstrap_value: the value function for final observations; needed
                only when some episode was cut after its final observation.

        Returns:
            The number of transitions written.

        Raises:
            ValueError: a bad argument, no scalar ``reward`` / ``value_key`` field,
                cut episodes without ``bootstrap_value``, or a callable that does
                not return one finite value per episode. Nothing is changed then.

        Example:
            >>> import numpy as np, arrowbuf as ab
            >>> store = ab.ExperienceStore(100)
            >>> _ = store.add_episode({"obs": np.zeros((3, 2), np.float32), "reward": np.ones(2, np.float32),
            ...                        "value": np.zeros(2, np.float32), "terminated": np.array([False, True]),
            ...                        "truncated": np.zeros(2, bool)})
            >>> store.compute_gae(gamma=1.0, lam=1.0)
            2
            >>> store.episode(0).column("advantage").to_pylist()
            [2.0, 1.0, 0.0]
        """
        gamma, lam = check_fraction("gamma", gamma), check_fraction("lam", lam)
        schema = self.schema
        if not isinstance(value_key, str) or schema is None or value_key not in schema.fields:
            raise ValueError(f"value_key {value_key!r} is not a field of the store; fields: "
                             f"{list(schema.fields) if schema else 'none yet'}")
        if bootstrap_value is not None and not callable(bootstrap_value):
            raise ValueError(f"bootstrap_value must be a callable (final_obs TensorDict -> values) or None, "
                             f"got {describe(bootstrap_value)}")
        return self._backend.compute_gae(gamma, lam, value_key, bootstrap_value)
