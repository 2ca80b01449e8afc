"""Ray writers ship the completed steps of open episodes as pieces on their delivery timer
(`arrowbuf.piece_cutting`, `arrowbuf.ray.tails`): sampleable without an episode end or flush."""

from __future__ import annotations

import time

import numpy as np
import pytest
import ray

import arrowbuf as ab
from arrowbuf.ray.options import NAMESPACE

from support.actors import kill_and_wait

pytestmark = pytest.mark.usefixtures("ray_session")

PATIENCE = 60.0   # seconds a poll waits for the delivery timer: a bound on a hang, not a timing claim


def played_obs(env: int, t: int) -> np.ndarray:
    """Observation t of env ``env``'s episode: it encodes both, so a sampled row names its step."""
    return np.array([env, t, 0.5 * t], np.float32)


def step(writer: ab.StepWriter, t: int, done: np.ndarray | None = None, **extra) -> int:
    """Step t of every env (autoreset 'disabled'): obs t, action 10 t + env, reward t, next obs t + 1
    (``extra``: more fields of the step, e.g. ``policy_version``)."""
    n = writer.num_envs
    envs = np.arange(n)
    done = np.zeros(n, bool) if done is None else done
    return writer.add(obs=np.stack([played_obs(e, t) for e in envs]), action=10 * t + envs,
                      reward=np.full(n, t, np.float32), terminated=done, truncated=np.zeros(n, bool),
                      next_obs=np.stack([played_obs(e, t + 1) for e in envs]), **extra)


@pytest.fixture
def one_shard(ray_stores) -> ab.ExperienceStore:
    """An empty store of 1,000 rows on one shard (seed 0), shared by the tests that take it."""
    return ray_stores.get(capacity=1_000, num_shards=1, seed=0)


@pytest.fixture
def two_shards(ray_stores) -> ab.ExperienceStore:
    """An empty store of 1,000 rows on two shards (seed 0), shared by the tests that take it."""
    return ray_stores.get(capacity=1_000, num_shards=2, seed=0, sampler=ab.UniformSampler())


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + PATIENCE
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {PATIENCE} s"
        time.sleep(0.02)


def check_rows(batch, envs: int) -> None:
    """Every sampled row is a played step: obs t of its env, its action, reward and next obs t + 1."""
    obs, nxt = batch["obs"].numpy(), batch["next", "obs"].numpy()
    env, t = obs[:, 0].astype(np.int64), obs[:, 1].astype(np.int64)
    assert ((env >= 0) & (env < envs)).all()
    assert (batch["step"].numpy() == t).all()
    assert (batch["action"].numpy() == 10 * t + env).all()
    assert (batch["reward"].numpy() == t).all()
    assert np.array_equal(nxt, np.stack([played_obs(e, k + 1) for e, k in zip(env, t)]))


def test_open_steps_become_sampleable_without_flush_or_episode_end(two_shards):
    store = two_shards
    writer = store.writer(num_envs=3, autoreset_mode="disabled")
    for t in range(20):
        step(writer, t)
    wait_for(lambda: len(store) == 60, "the 60 completed open steps reaching the shards")
    assert store.num_episodes == 0                       # nothing sealed
    assert store.episodes().num_rows == 0
    table = store.episodes(include_open=True)
    assert table.num_rows >= 3 and all(table.column("open").to_pylist())
    assert sum(table.column("length").to_pylist()) == 60
    batch = store.sample(256)
    check_rows(batch, 3)
    assert not batch["terminated"].any()
    assert sorted(set(batch["step"].tolist())) == list(range(20))   # 256 draws of 60 rows: every step
    writer.close()


def check_episode_ids(store: ab.ExperienceStore, batch) -> None:
    """Every sampled row's episode id names the stored piece of its env that holds its step."""
    table = store.episodes(include_open=True).to_pydict()
    pieces = {i: (env, f, n) for i, env, f, n in zip(table["episode_id"], table["env_id"], table["first_step"],
                                                     table["length"])}
    obs = batch["obs"].numpy()
    for episode_id, env, t in zip(batch["episode_id"].tolist(), obs[:, 0].astype(int).tolist(),
                                  obs[:, 1].astype(int).tolist()):
        piece_env, first, length = pieces[episode_id]
        assert piece_env == f"env-{env}" and first <= t < first + length, (episode_id, env, t, pieces[episode_id])


def step_one_piece_at_a_time(writer: ab.StepWriter, steps: int, start: int = 0) -> None:
    """Steps start .. steps - 1, each shipped by the delivery timer before the next: one piece per
    step and env, so every piece after the first continues its episode (first_step > 0)."""
    for t in range(start, steps):
        step(writer, t)
        wait_for(lambda: writer.open_steps.sum() == 0, f"step {t} leaving the writer's staging")


@pytest.mark.parametrize("sampler", [ab.UniformSampler(), ab.PrioritizedSampler()], ids=["uniform", "prioritized"])
def test_a_reader_samples_the_played_step_of_a_piece_that_continues_an_open_episode(sampler, ray_stores):
    # A reader drawing itself (uniform) once added a piece's first_step to a step that
    # already held it: step 2 t instead of t; a shard's draw (prioritized) read it once.
    store = ray_stores.get(capacity=1_000, num_shards=2, seed=0, sampler=sampler)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    step_one_piece_at_a_time(writer, 8)
    wait_for(lambda: len(store) == 16, "the 16 shipped steps")
    listed = store.episodes(include_open=True)   # 8 pieces an env, one played episode each
    assert listed.column("open").to_pylist() == [True, True] and listed.column("length").to_pylist() == [8, 8]
    for args in ({}, {"n_step": 3, "gamma": 1.0}):
        batch = store.sample(128, **args)
        obs = batch["obs"].numpy()
        assert (batch["step"].numpy() == obs[:, 1]).all()
        assert (batch["action"].numpy() == 10 * obs[:, 1] + obs[:, 0]).all()
        check_episode_ids(store, batch)
    check_rows(store.sample(128), 2)   # and the next observation of each: played step t + 1
    assert store.num_episodes == 0
    writer.close()


def test_pieces_of_an_open_episode_keep_each_steps_policy_version():
    # policy_version is a derived column (`arrowbuf.versions.writer_fields`): a piece must carry
    # it as a sealed episode does, or sampling by version never sees the open steps.
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    try:
        writer = store.writer(num_envs=2, autoreset_mode="disabled")
        for t in range(6):
            step(writer, t, policy_version=t)
            wait_for(lambda: writer.open_steps.sum() == 0, f"step {t} leaving the writer's staging")
        wait_for(lambda: len(store) == 12, "the 12 shipped steps")
        batch = store.sample(64)
        assert (batch["policy_version"].numpy() == batch["obs"][:, 1].numpy()).all()
        fresh = store.sample(64, min_version=4)
        assert set(fresh["step"].tolist()) == {4, 5} and (fresh["policy_version"].numpy() == fresh["step"].numpy()).all()
        assert store.num_episodes == 0
        writer.close()
    finally:
        store.close()


def test_a_writer_restored_from_a_state_continues_its_open_episodes_at_the_step_they_reached(one_shard):
    store = one_shard
    first = store.writer(num_envs=2, autoreset_mode="disabled")
    step_one_piece_at_a_time(first, 3)
    step(first, 3)   # staged, maybe not shipped yet: the state holds it or its piece went
    state = first.state_dict()
    later = store.writer(num_envs=2, autoreset_mode="disabled")
    later.load_state_dict(state)
    for t in range(4, 7):
        step(later, t)
    later.flush()
    # 14 steps; 16 when the first writer's timer also shipped step 3 after the state was taken.
    wait_for(lambda: len(store) in (14, 16), "the 14 steps")
    batch = store.sample(256)
    check_rows(batch, 2)   # step t is step t, on either side of the restore
    assert sorted(set(batch["step"].tolist())) == list(range(7))
    later.close()


def test_len_and_episodes_count_open_pieces_as_transitions_not_episodes(two_shards):
    store = two_shards
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    for t in range(4):
        step(writer, t)
    wait_for(lambda: len(store) == 8, "the open steps")
    assert store.num_episodes == 0
    step(writer, 4, done=np.array([True, False]))        # env 0's episode ends; env 1's goes on
    wait_for(lambda: len(store) == 10, "env 0's last piece and env 1's open step")
    table = store.episodes(include_open=True).to_pydict()
    # Pieces are storage: one row per played episode, its pieces summed.
    assert table["env_id"] == ["env-0", "env-1"] and table["length"] == [5, 5] and table["first_step"] == [0, 0]
    assert table["open"] == [False, True] and table["terminated"] == [True, False]
    # An episode counts once its end is stored; an open one's pieces count only as transitions.
    assert store.num_episodes == 1 == store.episodes().num_rows
    assert "open" not in store.episodes().column_names
    assert writer.open_steps.sum() == 0                   # every step shipped: flush sends a close
    writer.flush()                                        # cuts env 1's episode: no open piece left
    assert store.num_episodes == 2
    assert not any(store.episodes(include_open=True).column("open").to_pylist())
    assert len(store) == 10
    writer.close()


def test_flush_after_a_shipped_piece_with_no_new_step_closes_the_episode(one_shard):
    store = one_shard
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    step(writer, 0)
    wait_for(lambda: len(store) == 1, "the open step")
    wait_for(lambda: writer.open_steps.sum() == 0, "the writer's piece leaving its staging")
    writer.flush()   # nothing staged since the piece: the shard is told the episode ended
    assert store.num_episodes == 1 and len(store) == 1
    assert store.episodes(include_open=True).column("open").to_pylist() == [False]
    writer.close()


def test_a_continuing_task_streams_ten_times_the_capacity_through_a_ray_ring():
    capacity = 64
    store = ab.ExperienceStore(capacity, backend="ray", num_shards=1, seed=0)
    try:
        writer = store.writer(num_envs=1, autoreset_mode="disabled")
        step(writer, 0)
        wait_for(lambda: len(store) >= 1, "the first completed step")   # sampleable from its first step
        check_rows(store.sample(4), 1)
        sampled = 0
        for t in range(1, 10 * capacity):
            step(writer, t)
            if t % 16 == 0:
                batch = store.sample(32)
                check_rows(batch, 1)
                sampled += len(batch["step"])   # never blocked, never short
                assert len(store) <= capacity

        def newest_end() -> int:
            table = store.episodes(include_open=True).to_pydict()
            return max(f + n for f, n in zip(table["first_step"], table["length"]))

        wait_for(lambda: newest_end() == 10 * capacity, "the stream's last step")
        table = store.episodes(include_open=True)
        first = table.column("first_step").to_pylist()
        assert first == sorted(first) and first[0] > 5 * capacity        # the oldest pieces were evicted
        assert all(table.column("open").to_pylist()) and store.num_episodes == 0
        assert sampled == 32 * (10 * capacity // 16 - 1)
        batch = store.sample(64, n_step=5, gamma=1.0)                    # n-step runs across pieces
        check_n_step(batch)
        writer.close()
    finally:
        store.close()


def check_n_step(batch) -> None:
    """An n-step return read from played steps: rewards t .. t + k - 1, bootstrapped from obs t + k."""
    t = batch["obs"][:, 1].numpy().astype(np.int64)
    k = batch["n_steps"].numpy().astype(np.int64)
    assert ((k >= 1) & (k <= 5)).all()
    assert np.allclose(batch["reward"].numpy(), k * t + k * (k - 1) / 2)
    assert (batch["next", "obs"][:, 1].numpy() == t + k).all()


def test_sampling_with_nothing_sampleable_raises_and_never_waits():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0,
                               ray_options=ab.RayOptions(delivery_latency=3_600.0))
    try:
        with pytest.raises(ab.EmptyStoreError):
            store.sample(4)                        # an empty store
        writer = store.writer(num_envs=2, autoreset_mode="disabled")
        step(writer, 0)                            # staged; the timer ships it only after an hour
        with pytest.raises(ab.EmptyStoreError, match="writer.flush"):
            store.sample(4)
        writer.flush()
        assert len(store) == 2
        check_rows(store.sample(8), 2)
        writer.close()
    finally:
        store.close()


def test_a_dead_shard_met_by_the_timer_shipping_open_steps_is_raised_by_the_writers_next_step():
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    try:
        step(writer, 0)
        wait_for(lambda: len(store) == 2, "the first open steps")
        kill_and_wait(ray.get_actor(f"{store.name}:0", namespace=NAMESPACE))
        # No episode ends and nothing flushes: only the timer's pieces reach the dead shard.
        with pytest.raises(ab.ShardError, match="episodes are lost"):
            t = 1
            deadline = time.monotonic() + PATIENCE
            while time.monotonic() < deadline:
                step(writer, t)
                t += 1
                time.sleep(0.02)
    finally:
        store.close()


def test_an_error_of_the_timers_cut_is_raised_by_the_writers_next_call_not_dropped(one_shard):
    store = one_shard
    writer = store.writer(num_envs=1, autoreset_mode="disabled")

    def broken(min_steps: int = 1) -> list:
        raise RuntimeError("staging broke")

    writer.take_open_pieces = broken   # the timer's cut fails in its thread
    with pytest.raises(RuntimeError, match="staging broke"):
        t = 0
        deadline = time.monotonic() + PATIENCE
        while time.monotonic() < deadline:
            step(writer, t)
            t += 1
            time.sleep(0.02)
    assert len(store) == 0


@ray.remote
def stream_in_a_task(writer: ab.StepWriter, steps: int) -> int:
    """A writer in another process: its open steps travel on its own timer (no flush)."""
    obs = np.zeros((1, 3), np.float32)
    for t in range(steps):
        writer.add(obs=obs + t, action=np.array([t]), reward=np.ones(1, np.float32),
                   terminated=np.zeros(1, bool), truncated=np.zeros(1, bool), next_obs=obs + t + 1)
    deadline = time.monotonic() + PATIENCE
    while writer.open_steps.sum() and time.monotonic() < deadline:   # shipped by the timer
        time.sleep(0.02)
    return int(writer.open_steps.sum())


def test_a_writer_in_a_task_ships_its_open_steps(one_shard):
    store = one_shard
    assert ray.get(stream_in_a_task.remote(store.writer(num_envs=1, autoreset_mode="disabled"), 7)) == 0
    wait_for(lambda: len(store) == 7, "the task's open steps")
    # The task's copy of the writer is dropped when the task ends: its episode is cut there, as
    # flush() would (it once stayed open for ever: no copy can go on with another's pieces).
    wait_for(lambda: store.num_episodes == 1, "the dropped writer's cut")
    assert len(store) == 7


def check_one_chain_per_env(store: ab.ExperienceStore, envs: int, steps: int) -> None:
    """Every env's episode ended: it is listed once, as its pieces, steps 0 .. steps - 1 each
    held by one piece, and no piece is left open."""
    table = store.episodes(include_open=True).to_pydict()
    assert not any(table["open"]), table
    assert store.num_episodes == store.episodes().num_rows == len(table["env_id"])
    for env in range(envs):
        pieces = sorted((f, n, term) for e, f, n, term in zip(table["env_id"], table["first_step"], table["length"],
                                                               table["terminated"]) if e == f"env-{env}")
        starts, lengths = [f for f, _, _ in pieces], [n for _, n, _ in pieces]
        assert starts == [0, *np.cumsum(lengths)[:-1].tolist()] and sum(lengths) == steps, (env, pieces)
        assert [term for _, _, term in pieces] == [False] * (len(pieces) - 1) + [True]
    assert len(store) == envs * steps


def test_a_restored_writer_ends_the_open_episode_its_state_was_taken_in(two_shards):
    # The shard notes a piece open by (writer, env): a restored writer was a new writer, so
    # its state's earlier pieces stayed open (steps but no episode) until evicted.
    store = two_shards
    first = store.writer(num_envs=2, autoreset_mode="disabled")
    step_one_piece_at_a_time(first, 3)   # steps 0 .. 2 stored as open pieces; nothing staged
    wait_for(lambda: len(store) == 6, "the 6 shipped steps")
    state = first.state_dict()
    later = store.writer(num_envs=2, autoreset_mode="disabled")
    later.load_state_dict(state)
    step_one_piece_at_a_time(later, 6, start=3)
    step(later, 6, done=np.ones(2, bool))
    later.flush()
    check_one_chain_per_env(store, 2, 7)
    check_rows(store.sample(256), 2)
    later.close()


def test_a_restored_writer_ships_its_open_episode_to_the_shard_of_its_earlier_pieces(two_shards):
    # A restored writer's sink routed its envs anew (to the least loaded shard): the episode's
    # end went to a shard that never held its earlier pieces, which stayed open there.
    store = two_shards
    first = store.writer(num_envs=1, autoreset_mode="disabled")
    step_one_piece_at_a_time(first, 3)   # env-0's pieces on shard 0 (both empty: the first)
    wait_for(lambda: len(store) == 3, "the 3 shipped steps")
    state = first.state_dict()
    # Another env's episode of 20 steps on shard 0: a new route for env-0 is shard 1.
    store.add_episode({"obs": np.stack([played_obs(1, t) for t in range(21)]), "action": 10 * np.arange(20) + 1,
                       "reward": np.arange(20, dtype=np.float32), "terminated": np.arange(20) == 19,
                       "truncated": np.zeros(20, bool)}, env_id="filler", shard=0)
    later = store.writer(num_envs=1, autoreset_mode="disabled")
    later.load_state_dict(state)
    step_one_piece_at_a_time(later, 6, start=3)
    step(later, 6, done=np.ones(1, bool))
    later.flush()
    table = store.episodes(include_open=True).to_pydict()
    assert set(s for s, e in zip(table["shard"], table["env_id"]) if e == "env-0") == {0}, table
    filler = table["env_id"].index("filler")
    for name in table:
        del table[name][filler]
    assert not any(table["open"]) and store.num_episodes == len(table["env_id"]) + 1
    assert sorted(zip(table["first_step"], table["length"])) == [(0, 7)]   # its 7 pieces: one episode
    assert len(store) == 27
    later.close()


def test_a_local_writer_restored_from_a_state_ends_its_open_episode_once():
    # A local writer keeps its open steps in place (no pieces): the restored writer copies
    # them, and each holds its own. A writer dropped keeps what it wrote (cut, as flush() cuts),
    # so the first one's copy stays as two cut episodes of 3 steps.
    store = ab.ExperienceStore(1_000, seed=0)
    first = store.writer(num_envs=2, autoreset_mode="disabled")
    for t in range(3):
        step(first, t)
    state = first.state_dict()
    later = store.writer(num_envs=2, autoreset_mode="disabled")
    later.load_state_dict(state)
    del first
    for t in range(3, 6):
        step(later, t)
    step(later, 6, done=np.ones(2, bool))
    later.flush()
    table = store.episodes(include_open=True).to_pydict()
    assert sorted(zip(table["env_id"], table["length"], table["terminated"])) == [
        ("env-0", 3, False), ("env-0", 7, True), ("env-1", 3, False), ("env-1", 7, True)], table
    assert store.num_episodes == 4 and len(store) == 20
    check_rows(store.sample(256), 2)
    assert sorted(set(store.sample(256)["step"].tolist())) == list(range(7))


def test_a_parquet_export_of_shards_with_and_without_pieces_loads_every_episode_once(ray_session, tmp_path):
    # One shard holds a played episode in pieces (its episode table lists `first_step`), the other only
    # whole episodes (its table lists none): the export joins the two tables of different columns.
    store = ab.ExperienceStore(capacity=1_000, backend="ray", num_shards=2, seed=0,
                               ray_options=ab.RayOptions(delivery_latency=0.01))
    try:
        writer = store.writer(num_envs=1, autoreset_mode="disabled")
        for t in range(30):   # shipped on the timer: several pieces of one episode
            step(writer, t)
            time.sleep(0.005)
        step(writer, 30, done=np.array([True]))
        writer.close()
        shards = [s["transitions"] for s in store.stats()["shards"]]
        empty = shards.index(0)
        for k in range(2):   # whole episodes, to the shard the writer left empty
            obs = np.stack([played_obs(100 + k, t) for t in range(6)])
            store.add_episode({"obs": obs, "action": np.arange(5), "reward": np.ones(5, np.float32),
                               "terminated": np.arange(5) == 4, "truncated": np.zeros(5, bool)})
        assert store.stats()["shards"][empty]["transitions"] >= 5, "no demo reached the other shard"
        listed = store.episodes()
        if "first_step" in listed.column_names:   # 0 for the whole episodes, never a null
            assert listed.column("first_step").null_count == 0
        store.to_parquet(tmp_path / "export")
        loaded = ab.ExperienceStore.from_parquet(tmp_path / "export")
        episodes = loaded.episodes().to_pydict()
        assert sorted(episodes["length"]) == [5, 5, 31] and loaded.num_episodes == 3 and len(loaded) == 41
    finally:
        store.close()
