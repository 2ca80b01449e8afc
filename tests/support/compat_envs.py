"""Fake RLightning env workers, policies and engine call sequences for the compat tests.

`VecWorker` is a vector env worker whose sub-env ``i`` plays episodes of lengths
drawn from a seeded generator. Observations are ``[100 * worker + i, e, t]``
(sub-env, episode, step), the policy's action is ``code = 10000 * i + 100 * e + t`` and the reward of
that action is ``code / 2``: a stored transition tells which env step it came
from. The worker logs every real transition it plays (obs, action, reward, next
obs, terminated, truncated), the ground truth the buffer is checked against.

Autoreset styles: ``"next_step"`` (the step after an episode's end only resets
that sub-env: dummy reward 0, no flags, the action is ignored) and
``"same_step"`` (the ending step resets at once and returns the new first
observation; the terminal one goes to ``info["final_observation"]``, an
``[N, 3]`` array, or ``info["final_obs"]``, gymnasium's object array, or nowhere
with ``final_key=None``, as IsaacLab / RSL-RL send ``info={}``).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch

from arrowbuf.compat import BatchedData, EnvMeta, EnvRet, PolicyResponse


class VecWorker:
    """Env worker ``index`` (id ``f"{uuid}-{index}"``) of ``num_envs`` sub-envs (``vector=False``: one plain env)."""

    def __init__(self, index: int, num_envs: int = 4, autoreset: str = "next_step", seed: int = 0,
                 vector: bool = True, max_len: int = 5, final_key: str | None = "final_observation", min_len: int = 1,
                 uuid: str = "3f2a9c") -> None:
        self.env_id = f"{uuid}-{index}"
        self.base = 100 * index
        self.n = num_envs if vector else 1
        self.vector = vector
        self.autoreset = autoreset
        self.final_key = final_key
        self.rng = np.random.default_rng(seed)
        self.min_len, self.max_len = min_len, max_len
        self.episode = np.zeros(self.n, np.int64)
        self.t = np.zeros(self.n, np.int64)
        self.length = self._lengths()
        self.resetting = np.zeros(self.n, bool)
        self.truth: list[tuple] = []            # every real transition played

    def _lengths(self) -> np.ndarray:
        return self.rng.integers(self.min_len, self.max_len + 1, self.n)

    def _obs(self) -> np.ndarray:
        return np.stack([self.base + np.arange(self.n), self.episode, self.t], axis=-1).astype(np.float32)

    def _out(self, value):
        return value if self.vector else value[0]

    def meta(self) -> EnvMeta:
        return EnvMeta(self.env_id, num_envs=self.n if self.vector else None)

    def reset(self) -> EnvRet:
        return EnvRet(self.env_id, self._out(self._obs()))

    def step(self, action) -> EnvRet:
        action = np.atleast_1d(np.asarray(action)).astype(np.int64)
        before = self._obs()
        acting = ~self.resetting
        reward = np.where(acting, action / 2, 0.0).astype(np.float32)
        self.t = np.where(acting, self.t + 1, 0)
        self.episode = np.where(acting, self.episode, self.episode + 1)
        done = acting & (self.t == self.length)
        terminated = done & (self.length % 2 == 0)      # even lengths terminate, odd ones truncate
        truncated = done & ~terminated
        after = self._obs()
        for i in np.flatnonzero(acting):
            self.truth.append((tuple(before[i]), int(action[i]), float(reward[i]), tuple(after[i]),
                               bool(terminated[i]), bool(truncated[i])))
        self.length = np.where(done, self._lengths(), self.length)
        info = {}
        if self.autoreset == "same_step":
            final = after.copy()
            self.episode = np.where(done, self.episode + 1, self.episode)
            self.t = np.where(done, 0, self.t)
            if done.any() and self.final_key is not None:
                if self.final_key == "final_obs":   # gymnasium's object array, None where nothing ended
                    entries = np.empty(self.n, object)
                    for i in np.flatnonzero(done):
                        entries[i] = final[i]
                    info[self.final_key] = entries if self.vector else final[0]
                else:
                    info[self.final_key] = self._out(final)
        else:
            self.resetting = done
        return EnvRet(self.env_id, self._out(self._obs()), last_reward=self._out(reward),
                      last_terminated=self._out(terminated), last_truncated=self._out(truncated), info=info)


def policy(env_ret: EnvRet, **extra) -> PolicyResponse:
    """Action ``code`` of the observation; ``value`` = t / 2; rsl_rl-style extras if given."""
    obs = np.asarray(env_ret.observation)
    code = (obs[..., 0] * 10000 + obs[..., 1] * 100 + obs[..., 2]).astype(np.int64)
    return PolicyResponse(env_ret.env_id, action=code, value=(obs[..., 2] * 0.5).astype(np.float32), **extra)


def transitions(batch) -> Counter:
    """The stored transitions of a batch, as the workers log them."""
    obs, nxt = batch["observation"].numpy(), batch["next_observation"].numpy()
    rows = zip(map(tuple, obs), batch["action"].tolist(), batch["reward"].tolist(), map(tuple, nxt),
               batch["terminated"].tolist(), batch["truncated"].tolist())
    return Counter((o, int(a), float(r), n, bool(d), bool(c)) for o, a, r, n, d, c in rows)


def losses(batch, workers: list[VecWorker]) -> dict[str, int]:
    """How the stored transitions of ``batch`` differ from what the workers played, as counts:
    ``lost`` (played, not stored), ``extra`` (stored, never played), ``wrong_next`` (a next
    observation marked known that is not the played one), ``unknown_mid`` (a next observation
    marked not known on a step that did not end an episode) and ``unknown`` (marked not known:
    allowed only on an episode's last step)."""
    played = truth(workers)
    key = lambda t: (t[0], t[1], t[2], t[4], t[5])   # noqa: E731  a transition without its next observation
    valid = (batch["next_observation_valid"].tolist() if "next_observation_valid" in batch.keys()
             else [True] * batch.batch_size[0])
    stored = transitions(batch)
    rows = list(zip(map(tuple, batch["observation"].numpy()), batch["action"].tolist(), batch["reward"].tolist(),
                    map(tuple, batch["next_observation"].numpy()), batch["terminated"].tolist(),
                    batch["truncated"].tolist(), valid))
    stored_keys = Counter(key((o, int(a), float(r), n, bool(d), bool(c))) for o, a, r, n, d, c, _ in rows)
    played_keys = Counter(key(t) for t in played)
    known = Counter((o, int(a), float(r), n, bool(d), bool(c)) for o, a, r, n, d, c, v in rows if v)
    del stored
    return {"lost": sum((played_keys - stored_keys).values()), "extra": sum((stored_keys - played_keys).values()),
            "wrong_next": sum((known - played).values()),
            "unknown_mid": sum(1 for *_, d, c, v in rows if not v and not (d or c)),
            "unknown": sum(1 for *_, v in rows if not v)}


def truth(workers: list[VecWorker]) -> Counter:
    """Every real transition the workers played."""
    return Counter(t for w in workers for t in w.truth)


def sync_rollout(buffer, workers: list[VecWorker], steps: int) -> None:
    """SyncRLEngine.rollout: reset, then ``steps`` steps; the last record carries the truncation."""
    ids = [w.env_id for w in workers]
    env_rets = BatchedData(ids, [w.reset() for w in workers])
    for step in range(steps + 1):
        responses = BatchedData(ids, [policy(r) for r in env_rets.values()])
        buffer.add_batched_transition(env_rets, responses, [step == steps] * len(workers))
        if step < steps:
            env_rets = BatchedData(ids, [w.step(r.action) for w, r in zip(workers, responses.values())])


def rsl_rollout(buffer, workers: list[VecWorker], steps: int, first: BatchedData | None = None) -> BatchedData:
    """RSLRLEngine: env returns, then responses with rsl_rl's ``next_*`` keys (describing the
    current step), async; ``truncate_episodes`` at the end; returns the last env returns,
    which the next rollout re-adds as its first records."""
    ids = [w.env_id for w in workers]
    env_rets = first or BatchedData(ids, [w.reset() for w in workers])
    for step in range(steps + 1):
        buffer.add_batched_data_async(env_rets)
        if step == steps:
            break
        responses = [policy(r, next_values=np.zeros(w.n, np.float32), next_actor_observations=np.asarray(r.observation))
                     for w, r in zip(workers, env_rets.values())]
        env_rets = BatchedData(ids, [w.step(r.action) for w, r in zip(workers, responses)])
        buffer.add_batched_data_async(BatchedData(ids, responses))
    responses = [policy(r, next_values=np.zeros(w.n, np.float32), next_actor_observations=np.asarray(r.observation))
                 for w, r in zip(workers, env_rets.values())]
    buffer.add_batched_data_async(BatchedData(ids, responses))
    buffer.truncate_episodes(ids)
    return env_rets


def as_bf16_bits(tensor: torch.Tensor) -> np.ndarray:
    """What RLightning's ``to_numpy`` sends for a bf16 tensor: its uint16 bits."""
    return tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def fake_train_worker() -> type:
    """RLightning's train policy as far as the buffer sees it: ``update_dataset(data)`` keeps the
    batch it is given. As a Ray actor it is called as ``PolicyGroup.update_dataset`` calls it
    (``policy.update_dataset.remote(batch)``), so a batch ObjectRef arrives resolved, and
    ``dataset()`` returns a copy of what arrived, with the process it arrived in. (A class made
    here pickles by value: Ray workers cannot import the test modules.)"""

    class FakeTrainWorker:
        def __init__(self) -> None:
            self.data = None

        def update_dataset(self, data) -> None:
            self.data = data

        def dataset(self):
            import os

            return self.data.clone(), os.getpid()

    return FakeTrainWorker


def update_dataset(batches: list, train_workers: list | None) -> list:
    """The batches as the train workers receive them: through Ray actors (``train_workers``, one
    per batch) when given, else as they are (local storage)."""
    if train_workers is None:
        return batches
    import ray

    ray.get([w.update_dataset.remote(b) for w, b in zip(train_workers, batches)])
    return [data for data, _ in ray.get([w.dataset.remote() for w in train_workers])]
