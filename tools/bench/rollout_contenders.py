"""The stores ONPOLICY replays a rollout from: a whole-rollout sample, and PPO epochs of minibatches.

- ``ideal``: one contiguous numpy column per field; a sample is one
  ``np.take`` per field into a preallocated, pre-touched output.
- ``rlightning``: the real seed (`real_seed`): RLightning's own ``ReplayBuffer``
  (uniform sampler, transition unit), filled with its ``add_episode``; the rollout
  sample is its ``sample(n)``, a minibatch its storage's ``[idx]`` (dicts of tensors).
- ``seed``: a seed-*like proxy* of the seed's ``DataContainer``: a preallocated
  TensorDict of capacity rows, written with ``update_at_`` and read with ``td[idx]``.
- ``torchrl``: ``LazyTensorStorage`` read directly (``storage[idx]``) for the
  rollout, and a ``ReplayBuffer(SamplerWithoutReplacement)`` for the epochs.
- ``arrowbuf``: ``store.sample(n)`` and ``iter_batches(batch, shuffle=True)``;
  ``arrowbuf_keys``: the same with ``keys=`` (PPO's fields only, no ``next``);
  ``arrowbuf_torch``: ``keys=`` from a torch arena (``storage_device``: the
  rollout's tensors copied in on that device, samples gathered there), and
  ``arrowbuf_cuda``: ``keys=`` from the numpy arena to ``device="cuda"`` (pinned).
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

import numpy as np

from .rollouts import RolloutShape, episodes, transitions


def _touched(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    out = np.empty(shape, dtype)
    out.reshape(-1).view(np.uint8)[:] = 0   # pre-touch every page
    return out


class RolloutContender:
    """A rollout store: ``sample_all`` draws every transition once, ``epochs`` runs PPO's minibatches."""

    name = "?"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int) -> None:
        self.shape = shape
        self.n = shape.transitions
        self.batch = self.n // minibatches

    def sample_all(self) -> Any:
        raise NotImplementedError

    def minibatch(self, index: Any) -> Any:
        raise NotImplementedError

    def epochs(self, epochs: int) -> None:
        """``epochs`` fresh permutations, each read in minibatches."""
        import torch
        for _ in range(epochs):
            order = torch.randperm(self.n)
            for start in range(0, self.n - self.batch + 1, self.batch):
                self.minibatch(order[start:start + self.batch])


class IdealRollout(RolloutContender):
    name = "ideal"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int) -> None:
        super().__init__(shape, rollout, minibatches)
        import torch
        self.cols = {}
        for name, tensor in transitions(shape, rollout).items():
            f = shape.fields[name]
            col = _touched((self.n, *f.shape), f.numpy_dtype)
            col[:] = tensor.view(torch.uint16).numpy() if f.dtype == "bfloat16" else tensor.numpy()
            self.cols[name] = col
        self.out = {n: _touched(c.shape, c.dtype) for n, c in self.cols.items()}
        self.out_batch = {n: _touched((self.batch, *c.shape[1:]), c.dtype) for n, c in self.cols.items()}
        self.rng = np.random.default_rng(0)

    def _take(self, index: np.ndarray, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        for name, col in self.cols.items():
            np.take(col, index, axis=0, out=out[name], mode="clip")   # "raise" would buffer the output
        return out

    def sample_all(self) -> Any:
        return self._take(self.rng.permutation(self.n), self.out)

    def minibatch(self, index: Any) -> Any:
        return self._take(index.numpy(), self.out_batch)


class RealSeedRollout(RolloutContender):
    name = "rlightning"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int, seed: Any) -> None:
        super().__init__(shape, rollout, minibatches)
        config = seed.BufferConfig(type="ReplayBuffer", capacity=self.n, sampler={"type": "uniform"})
        self.buffer = seed.ReplayBuffer(config)
        self.buffer.init([seed.EnvMeta("env-0", None, None, num_envs=1)], ["env-0"])
        self.buffer.add_episode(transitions(shape, rollout))
        self.storage = self.buffer.storages[0]

    def sample_all(self) -> Any:
        return self.buffer.sample(self.n)[0]

    def minibatch(self, index: Any) -> Any:
        return self.storage[index]


class SeedRollout(RolloutContender):
    name = "seed"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int) -> None:
        super().__init__(shape, rollout, minibatches)
        import torch
        from tensordict import TensorDict
        data = TensorDict(transitions(shape, rollout), batch_size=[self.n])
        # The DataContainer's columns: torch.empty((capacity, *shape)) per leaf at the first push.
        self.td = TensorDict({k: torch.empty((self.n, *v.shape[1:]), dtype=v.dtype) for k, v in data.items()},
                             batch_size=[self.n])
        self.td.update_at_(data, slice(0, self.n))

    def sample_all(self) -> Any:
        import torch
        return self.td[torch.randperm(self.n)]

    def minibatch(self, index: Any) -> Any:
        return self.td[index]


class TorchRLRollout(RolloutContender):
    name = "torchrl"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int) -> None:
        super().__init__(shape, rollout, minibatches)
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage, ReplayBuffer, SamplerWithoutReplacement
        self.storage = LazyTensorStorage(self.n)
        self.rb = ReplayBuffer(storage=self.storage, sampler=SamplerWithoutReplacement(), batch_size=self.batch)
        self.rb.extend(TensorDict(transitions(shape, rollout), batch_size=[self.n]))

    def sample_all(self) -> Any:
        import torch
        return self.storage[torch.randperm(self.n)]

    def epochs(self, epochs: int) -> None:
        for _ in range(epochs * (self.n // self.batch)):
            self.rb.sample()


def accepts(method: Any, parameter: str) -> bool:
    """Whether ``method`` takes ``parameter`` (arrowbuf's API grows: keys=, epochs=)."""
    return parameter in inspect.signature(method).parameters


class ArrowbufRollout(RolloutContender):
    """An ``ExperienceStore`` holding the rollout's episodes (``keys``: gather only these fields)."""

    name = "arrowbuf"

    def __init__(self, shape: RolloutShape, rollout: Mapping[str, Any], minibatches: int,
                 keys: list[str] | None = None, storage_device: str | None = None, device: str | None = None) -> None:
        super().__init__(shape, rollout, minibatches)
        import arrowbuf as ab
        import torch
        placed = {"storage_device": storage_device} if storage_device is not None else {}
        self.store = ab.ExperienceStore(shape.envs * (shape.steps + 1), seed=0, **placed)
        for episode in episodes(shape, rollout):
            if storage_device is not None:   # what a GPU rollout hands over: tensors already on the device
                episode = {name: tensor.to(storage_device) for name, tensor in episode.items()}
            self.store.add_episode(episode)
        self.keys = {"keys": keys} if keys is not None else {}
        self.device = {"device": device} if device is not None else {}
        # CUDA calls return before the work is done: time them to the end of it.
        self.sync = torch.cuda.synchronize if "cuda" in (storage_device or "") + (device or "") else None
        self.epochs_at_once = accepts(self.store.iter_batches, "epochs")

    def sample_all(self) -> Any:
        batch = self.store.sample(self.n, **self.keys, **self.device)
        if self.sync is not None:
            self.sync()
        return batch

    def epochs(self, epochs: int) -> None:
        if self.epochs_at_once:
            for _ in self.store.iter_batches(self.batch, shuffle=True, epochs=epochs, **self.keys):
                pass
            return
        for _ in range(epochs):
            for _ in self.store.iter_batches(self.batch, shuffle=True, **self.keys):
                pass
