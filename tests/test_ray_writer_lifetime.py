"""A Ray writer's life: closed, it refuses; dropped, it keeps its steps; checkpointed open, its
store loads with every step and the writer goes on with the same episodes."""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import arrowbuf as ab

from support.actors import kill_and_wait

pytestmark = pytest.mark.usefixtures("ray_session")

SLOW = ab.RayOptions(delivery_latency=3_600.0)   # nothing ships on the timer: steps stay staged


def step(writer: ab.StepWriter, base: int, t, done: np.ndarray | None = None) -> None:
    """Step t of every env e (autoreset 'disabled'; ``t`` one int or one per env): obs (base + e, t),
    action 1000 (base + e) + t, reward t, next obs (base + e, t + 1): a stored row names its writer,
    env and step in its episode."""
    n = writer.num_envs
    tags = base + np.arange(n)
    t = np.broadcast_to(t, (n,))
    obs = np.stack([tags, t], axis=1).astype(np.float32)
    writer.add(obs=obs, action=1000 * tags + t, reward=np.full(n, t, np.float32),
               terminated=np.zeros(n, bool) if done is None else done, truncated=np.zeros(n, bool),
               next_obs=obs + np.array([0, 1], np.float32))


def played(store: ab.ExperienceStore) -> list[tuple[int, int]]:
    """(tag, t) of every stored transition, sorted, each checked against what was played."""
    rows = store.to_arrow()
    obs = np.asarray(rows.column("obs").to_pylist(), np.float32).reshape(rows.num_rows, 2)
    steps = [k for k, last in enumerate(rows.column("is_last").to_pylist()) if not last]
    tags, t = obs[steps, 0].astype(np.int64), obs[steps, 1].astype(np.int64)
    assert (rows.column("action").to_numpy()[steps] == 1000 * tags + t).all()
    assert (rows.column("step").to_numpy()[steps] == t).all()   # step t of its played episode
    return sorted(zip(tags.tolist(), t.tolist()))


def test_a_closed_ray_writer_refuses_add_and_stores_nothing(ray_stores):
    store = ray_stores.get(capacity=1_000, num_shards=1, seed=0, ray_options=None)
    writer = store.writer(2, autoreset_mode="disabled")
    step(writer, 0, 0, done=np.ones(2, bool))
    writer.close()
    with pytest.raises(ab.WriterClosedError, match="is closed.*store.writer"):
        step(writer, 0, 1, done=np.ones(2, bool))
    with pytest.raises(ab.WriterClosedError, match="is closed"):
        step(writer, 0, 2)
    del writer
    gc.collect()
    store.flush()
    assert played(store) == [(0, 0), (1, 0)] and store.num_episodes == 2


@pytest.mark.parametrize("options", [SLOW, None], ids=["slower-than-rollouts", "default-latency"])
def test_a_ray_writer_dropped_without_flush_keeps_every_step_it_wrote(options, ray_stores):
    # Each rollout's writer was dropped by the next one: its staged steps were lost (600 of 600
    # when rollouts outpace delivery_latency).
    store = ray_stores.get(capacity=1_000, num_shards=1, seed=0, ray_options=options)
    expected = []
    for rollout in range(3):
        writer = store.writer(4, autoreset_mode="disabled")   # the previous one is dropped here
        t = np.zeros(4, np.int64)   # each env's step in its episode: episodes of 10, 13, 16 and 19 steps
        for _ in range(50):
            done = t == 9 + 3 * np.arange(4)
            step(writer, 10 * rollout, t, done)
            expected += [(10 * rollout + e, int(t[e])) for e in range(4)]
            t = np.where(done, 0, t + 1)
    del writer
    gc.collect()
    store.flush()
    assert len(store) == 600 and played(store) == sorted(expected)
    assert not any(store.episodes(include_open=True).column("open").to_pylist())   # cut, as flush cuts


def test_a_dropped_ray_writer_whose_shard_died_logs_the_loss_and_the_store_raises_it(caplog):
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0, ray_options=SLOW)
    try:
        writer = store.writer(2, autoreset_mode="disabled")
        step(writer, 0, 0)
        kill_and_wait(store._backend.shards.handles[0])
        with caplog.at_level(logging.ERROR, logger="arrowbuf.ray.sink"):
            del writer
            gc.collect()
            with pytest.raises(ab.ShardError, match="of this writer"):   # the dropped writer's loss
                store.flush()
        assert any("dropped without flush() or close()" in r.getMessage() for r in caplog.records)
    finally:
        store.close()


def test_a_ray_checkpoint_keeps_open_writers_steps_and_the_loaded_writer_goes_on_with_its_episodes(tmp_path):
    # The checkpoint lacked the writer's staged steps (and its sink's queued episodes), and the
    # loaded store had no writer to go on with.
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=2, seed=0, ray_options=SLOW)
    try:
        writer = store.writer(3, autoreset_mode="disabled", name="runner")
        for t in range(20):   # env 0's first episode ends at step 9 (queued, not sent: SLOW)
            step(writer, 0, [t % 10, t, t], done=np.array([t == 9, False, False]))
        store.save(tmp_path / "ckpt")
        assert len(store) == 60
    finally:
        store.close()
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    try:
        assert len(loaded) == 60
        assert played(loaded) == sorted([(0, t) for t in range(10)] + [(0, t) for t in range(10)]
                                        + [(e, t) for e in (1, 2) for t in range(20)])
        assert loaded.num_episodes == 1   # env 0's first episode; the open ones count as steps only
        writer = loaded.writer(3, autoreset_mode="disabled", name="runner")
        for t in range(20, 25):   # each env goes on with the episode it played: env 0 at its step 10
            step(writer, 0, [t - 10, t, t])
        writer.close()
        assert len(loaded) == 75
        assert played(loaded) == sorted([(0, t) for t in range(10)] + [(0, t) for t in range(15)]
                                        + [(e, t) for e in (1, 2) for t in range(25)])
        table = loaded.episodes(include_open=True).to_pydict()
        assert not any(table["open"])
        for env, steps in (("env-1", 25), ("env-2", 25)):   # one chain of pieces, steps 0 .. 24
            pieces = sorted((f, n) for e, f, n in zip(table["env_id"], table["first_step"], table["length"])
                            if e == env)
            starts, lengths = [f for f, _ in pieces], [n for _, n in pieces]
            assert starts == [0, *np.cumsum(lengths)[:-1].tolist()] and sum(lengths) == steps, pieces
    finally:
        loaded.close()


EXITS_OPEN = textwrap.dedent("""
    import sys, numpy as np, ray, arrowbuf as ab
    sys.path.insert(0, sys.argv[2])
    from test_ray_writer_lifetime import SLOW, step
    ray.init(address=sys.argv[3], logging_level="ERROR")
    store = ab.ExperienceStore(1000, backend="ray", num_shards=1, durable=sys.argv[1], ray_options=SLOW)
    writer = store.writer(num_envs=3, autoreset_mode="disabled")
    for t in range(5):
        step(writer, 0, t)
    print("wrote", flush=True)
""")   # and ends, its writer neither flushed nor closed, its steps staged (SLOW: no timer ships them)


def test_a_process_that_exits_with_an_open_writer_ends_and_its_steps_reach_the_store(tmp_path):
    """A script's last line with a writer still open: the process exits (its writer's finalizer
    waited for ever on a delivery thread that never starts at interpreter exit: the process hung),
    and every staged step was shipped at exit: a durable store opened on its directory holds them."""
    import ray

    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", EXITS_OPEN, str(tmp_path), str(tests),
                           ray.get_runtime_context().gcs_address], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tests.parent)})
    assert done.returncode == 0 and "wrote" in done.stdout, done.stderr[-3000:]
    assert "still open when the interpreter exited" in done.stderr
    store = ab.ExperienceStore(1000, backend="ray", num_shards=1, durable=tmp_path,
                               ray_options=ab.RayOptions(resume=True))
    try:
        assert played(store) == sorted((e, t) for e in range(3) for t in range(5))
    finally:
        store.close()
