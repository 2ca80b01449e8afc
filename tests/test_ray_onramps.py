"""Ray as Ray users expect: no cluster started unasked, a pickled store arrives attached,
nothing after ray.shutdown() starts Ray again, limiter messages name the shard, durable
stores say what they resume, and the namespace is settable."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf import RayOptions
from arrowbuf.engine import PLAIN

ray = pytest.importorskip("ray")
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])   # workers cannot import this file
REPO = Path(__file__).resolve().parent.parent


def episode(steps: int = 9, value: float = 0.0) -> dict:
    return {"obs": np.full((steps + 1, 2), value, np.float32), "action": np.arange(steps),
            "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
            "truncated": np.zeros(steps, bool)}


def test_no_cluster_is_started_unasked_and_nothing_after_ray_shutdown_starts_one_again():
    # Its own process: it starts and shuts down its own Ray (the session's cluster stays up).
    script = textwrap.dedent("""
        import logging, numpy as np, ray, arrowbuf as ab
        from arrowbuf import RayOptions
        episode = {"obs": np.zeros((4, 2), np.float32), "action": np.arange(3), "terminated": np.arange(3) == 2}
        try:
            ab.ExperienceStore(100, backend="ray")
        except ab.ShardError as err:
            assert "ray.init(" in str(err) and "RayOptions(init=True)" in str(err), err
        else:
            raise AssertionError("a Ray store started a cluster unasked")
        assert not ray.is_initialized()
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("arrowbuf.ray.start").addHandler(handler)
        store = ab.ExperienceStore(100, backend="ray", ray_options=RayOptions(init=True, num_cpus=0))
        assert any("started a local Ray cluster" in r.getMessage() and "CPUs" in r.getMessage()
                   and r.levelno == logging.WARNING for r in records), [r.getMessage() for r in records]
        store.add_episode(episode)
        writer = store.writer(1, "disabled")
        assert len(store.sample(4)) == 4
        ray.shutdown()
        calls = {"len": lambda: len(store), "sample": lambda: store.sample(4),
                 "add_episode": lambda: store.add_episode(episode), "flush": store.flush,
                 "stats": store.stats, "attach": lambda: ab.ExperienceStore.attach(store.name)}
        for name, call in calls.items():
            try:
                call()
            except ab.ShardError as err:
                assert "ray.init" in str(err) or "shut down" in str(err), (name, err)
            else:
                raise AssertionError(f"{name} after ray.shutdown() did not raise ShardError")
            assert not ray.is_initialized(), f"{name} started Ray again"
        store.close()   # the actors ended with Ray: nothing to release, no error
        assert not ray.is_initialized()
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                            env={**_env(), "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


@ray.remote
def _remote_len_and_sample(store: ab.ExperienceStore) -> tuple:
    batch = store.sample(8)
    return type(store).__name__, store.name, len(store), batch["obs"].shape[0]


@ray.remote(num_cpus=0)
class _Learner:
    def __init__(self, store: ab.ExperienceStore) -> None:
        self.store = store

    def add_and_count(self) -> int:
        self.store.add_episode(episode(value=7.0))
        self.store.flush()
        return len(self.store)


def test_a_store_passed_to_a_ray_task_or_actor_arrives_as_an_attached_handle(ray_session):
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        store.add_episodes({k: np.stack([v, v]) for k, v in episode().items()})
        store.flush()
        assert ray.get(_remote_len_and_sample.remote(store)) == ("ExperienceStore", store.name, 18, 8)
        learner = _Learner.remote(store)
        assert ray.get(learner.add_and_count.remote()) == 27
        store.flush()
        assert len(store) == 27 and store.num_episodes == 3
        ray.kill(learner)
    finally:
        store.close()


def test_a_local_store_refuses_pickling_and_names_what_to_do():
    import pickle

    with pytest.raises(TypeError, match="backend='ray'.*save"):
        pickle.dumps(ab.ExperienceStore(10))


def test_a_rate_limited_sample_of_a_sharded_store_names_the_shard(ray_session, caplog):
    store = ab.ExperienceStore(4_000, backend="ray", num_shards=2, seed=0, rate_limiter=ab.MinSize(30))
    try:
        store.add_episode(episode(steps=40), shard=0)
        store.add_episode(episode(steps=10), shard=1)
        store.flush()
        assert len(store) == 50
        with pytest.raises(ab.RateLimited, match=r"shard 1 of 2 \(each shard applies its own copy .*\) holds 10 "
                                                 r"transitions, MinSize needs 30"):
            store.sample(16)
    finally:
        store.close()
    local = ab.ExperienceStore(100, rate_limiter=ab.MinSize(30))
    with pytest.raises(ab.RateLimited, match="the store holds 0 transitions"):
        local.sample(1)


def test_a_failed_request_to_one_shard_takes_the_other_shards_answers_too(ray_session, monkeypatch):
    store = ab.ExperienceStore(4_000, backend="ray", num_shards=3, seed=0, rate_limiter=ab.MinSize(30))
    try:
        for shard in range(3):
            store.add_episode(episode(steps=5), shard=shard)   # every shard refuses: three errors
        store.flush()
        shards = store._backend.shards
        refs = {s: shards.call(s, "select", 4, PLAIN, None, None, None, -1) for s in range(3)}
        read = []
        real_get = ray.get
        monkeypatch.setattr(ray, "get", lambda ref, **kw: (read.append(ref), real_get(ref, **kw))[1])
        with pytest.raises(ab.RateLimited, match="shard 0 of 3"):
            shards.get(refs)
        # Each ref was read, so none holds an error Ray reports as "Unhandled error" once dropped.
        assert read == list(refs.values())
    finally:
        store.close()


def test_the_namespace_is_settable_and_attach_looks_in_it(ray_session):
    name = f"ns-{uuid.uuid4().hex[:6]}"
    store = ab.ExperienceStore(100, backend="ray", name=name, ray_options=RayOptions(namespace="team-a"))
    try:
        with pytest.raises(ValueError, match=f"no arrowbuf store named '{name}' is running in namespace 'arrowbuf'"):
            ab.ExperienceStore.attach(name)
        attached = ab.ExperienceStore.attach(name, ray_options=RayOptions(namespace="team-a"))
        assert attached.num_shards == 1 and ray.get_actor(f"{name}:0", namespace="team-a") is not None
    finally:
        store.close()
    with pytest.raises(ValueError, match="RayOptions.namespace"):
        RayOptions(namespace="")


def test_reopening_a_durable_store_with_data_says_so_and_resume_chooses(ray_session, tmp_path, caplog):
    # One directory opened new, then reopened three times (each store starts its shard actors: seconds
    # of the suite): resume=None and True go on with the data, so the last, resume=False, still finds it.
    name = f"durable-{uuid.uuid4().hex[:6]}"
    caplog.set_level(logging.INFO, logger="arrowbuf.ray.start")
    first = ab.ExperienceStore(1_000, backend="ray", name=name, durable=tmp_path)
    assert not [r for r in caplog.records if "earlier run" in r.getMessage()]   # a new directory: nothing to say
    first.add_episode(episode())
    first.add_episode(episode())
    first.flush()
    first.close()
    for resume in (None, True, False):
        caplog.clear()
        again = ab.ExperienceStore(1_000, backend="ray", name=name, durable=tmp_path,
                                   ray_options=RayOptions(resume=resume))
        try:
            found = [r for r in caplog.records if "2 episodes (18 transitions) of an earlier run" in r.getMessage()]
            assert len(found) == 1, resume
            assert found[0].levelno == (logging.WARNING if resume is None else logging.INFO), resume
            assert len(again) == (0 if resume is False else 18), resume
        finally:
            again.close()


def test_a_ray_store_extends_collector_batches_and_samples_them_in_torchrl_layout(ray_session):
    import torch
    from tensordict import TensorDict

    steps = 6
    obs = torch.arange(2 * steps, dtype=torch.float32).reshape(2, steps, 1)
    done = torch.zeros(2, steps, 1, dtype=torch.bool)
    done[0, 2] = True
    td = TensorDict({"observation": obs, "action": torch.ones(2, steps, dtype=torch.long),
                     "next": {"observation": obs + 1, "reward": torch.ones(2, steps, 1), "done": done,
                              "terminated": done, "truncated": torch.zeros_like(done)}}, batch_size=[2, steps])
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        assert len(store.extend(td)) == 3
        store.flush()
        assert len(store) == 12
        batch = store.sample(8, layout="torchrl")
        assert batch["next", "done"].shape == (8, 1) and batch["observation"].shape == (8, 1)
        torch.testing.assert_close(batch["next", "observation"], batch["observation"] + 1)
    finally:
        store.close()


def test_a_ray_writer_given_no_mode_keeps_the_steps_of_envs_the_user_resets(ray_session):
    import gymnasium as gym

    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2,
                                    autoreset_mode=gym.vector.AutoresetMode.DISABLED)
    store = ab.ExperienceStore(10_000, backend="ray", num_shards=1, seed=0)
    try:
        writer = store.writer(2)   # no mode: next_step assumed, and checked
        obs, _ = envs.reset(seed=0)
        for _ in range(100):
            next_obs, reward, terminated, truncated, _ = envs.step(envs.action_space.sample())
            writer.add(obs=obs, action=np.zeros(2, np.int64), reward=reward.astype(np.float32),
                       terminated=terminated, truncated=truncated, next_obs=next_obs)
            done = terminated | truncated
            obs = envs.reset(options={"reset_mask": done})[0] if done.any() else next_obs
        writer.close()
        store.flush()
        assert writer.reset_check.kept > 0 and len(store) == 200   # every played step, on the shards
    finally:
        store.close()
