"""A store's capacity counts transitions (`arrowbuf.placement`): a store of ``num_envs x T``
holds a whole rollout, eviction takes the oldest transitions and as few as it must, and
``mode="fixed"`` refuses at ``capacity`` transitions. Counts only: no time is measured.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf._persist import take_rows

from support.episodes import make_episode

SHAPES = [(4, 150), (16, 64), (64, 32), (512, 24)]


def rollout(writer, num_envs: int, steps: int, end_rate: float, rng: np.random.Generator, tag: float,
            resetting: np.ndarray | None = None) -> int | tuple[int, np.ndarray]:
    """``steps`` steps of ``num_envs`` envs whose episodes end at random; obs encode
    (tag, env, step). Returns the transitions played. With ``resetting`` (gymnasium's next-step
    autoreset: the envs whose next step is a reset step, reward 0, not a transition), returns
    (transitions, the envs resetting after the last step)."""
    obs = np.stack([np.full(num_envs, tag), np.arange(num_envs), np.zeros(num_envs)], 1).astype(np.float32)
    next_step = resetting is not None
    resetting = np.zeros(num_envs, bool) if resetting is None else resetting
    transitions = 0
    for t in range(steps):
        nxt = obs.copy()
        nxt[:, 2] = t + 1
        done = (rng.random(num_envs) < end_rate) & ~resetting
        writer.add(obs=obs, action=np.full(num_envs, t, np.int64), reward=np.where(resetting, 0.0, 1.0).astype(np.float32),
                   terminated=done, truncated=np.zeros(num_envs, bool), next_obs=nxt)
        transitions += int((~resetting).sum()) if next_step else num_envs
        resetting = done if next_step else resetting
        obs = nxt
    return (transitions, resetting) if next_step else transitions


@pytest.mark.parametrize("num_envs, steps", SHAPES)
@pytest.mark.parametrize("end_rate", [0.0, 0.05])
def test_a_store_of_num_envs_x_t_holds_every_transition_of_each_rollout_with_a_new_writer_each(
        num_envs, steps, end_rate):
    store = ab.ExperienceStore(capacity=num_envs * steps, seed=0)
    rng = np.random.default_rng(1)
    for k in range(3):   # no clear(): each rollout replaces the one before, transition by transition
        writer = store.writer(num_envs, autoreset_mode="disabled")
        assert rollout(writer, num_envs, steps, end_rate, rng, tag=k) == num_envs * steps
        writer.flush()
        writer.close()
        assert len(store) == num_envs * steps
        batch = store.gather(np.arange(*store.engine.live_range()))
        assert (batch["obs"][:, 0] == k).all(), "only the last rollout is held, all of it"
    assert store.engine.shard.ring <= 1.7 * num_envs * steps   # rows beyond the capacity: final obs, regions


@pytest.mark.parametrize("num_envs, steps", [(4, 150), (64, 32)])
def test_one_writer_flushed_at_each_rollouts_end_keeps_exactly_the_last_rollout(num_envs, steps):
    """No clear(), one writer: flush() seals every open tail, and the next rollout's evictions take
    every older piece before any of its own (docs/internals.md: without the flush, pieces of one
    generation span the same steps and leave 1-2% of the older rollout in)."""
    store = ab.ExperienceStore(capacity=num_envs * steps, seed=0)
    writer = store.writer(num_envs, autoreset_mode="disabled")
    rng = np.random.default_rng(3)
    for k in range(3):
        rollout(writer, num_envs, steps, 0.02, rng, tag=k)
        writer.flush()
        assert len(store) == num_envs * steps
        batch = store.gather(np.arange(*store.engine.live_range()))
        assert (batch["obs"][:, 0] == k).all() and (batch["action"].bincount(minlength=steps) == num_envs).all()


@pytest.mark.parametrize("num_envs, steps", SHAPES)
@pytest.mark.parametrize("end_rate", [0.02, 0.05])
def test_one_writer_across_cleared_rollouts_keeps_every_transition_and_no_reset_step(num_envs, steps, end_rate):
    store = ab.ExperienceStore(capacity=num_envs * steps, seed=0)
    writer = store.writer(num_envs, autoreset_mode="next_step")
    rng = np.random.default_rng(2)
    resetting = np.zeros(num_envs, bool)
    for k in range(3):
        store.clear()
        played, resetting = rollout(writer, num_envs, steps, end_rate, rng, tag=k, resetting=resetting)
        writer.flush()
        assert len(store) == played
        assert float(store.gather(np.arange(*store.engine.live_range()))["reward"].min()) == 1.0, "no reset step"
    # A cleared ring keeps the rows it grew to: a fifth more than the capacity is plenty.
    assert store.engine.shard.ring <= 1.2 * num_envs * steps + 64


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 40), lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30))
def test_eviction_takes_exactly_the_oldest_transitions(capacity, lengths):
    """add_episode only: after each write the store holds the newest min(written, capacity)
    transitions, and its live indices are exactly those."""
    store = ab.ExperienceStore(capacity=capacity, seed=0)
    written = []   # (episode, step) of every transition, oldest first
    for e, length in enumerate(lengths):
        length = min(length, capacity)
        obs = np.stack([np.full(length + 1, e), np.arange(length + 1)], 1).astype(np.float32)
        store.add_episode({"obs": obs, "action": np.arange(length) + 100 * e, "reward": np.ones(length, np.float32),
                           "terminated": np.arange(length) == length - 1})
        written += [(e, t) for t in range(length)]
        held = written[-capacity:]
        assert len(store) == len(held)
        first, stop = store.engine.live_range()
        assert (first, stop) == (len(written) - len(held), len(written))
        if held:
            batch = store.gather(np.arange(first, stop))
            got = list(zip(batch["obs"][:, 0].long().tolist(), batch["step"].tolist()))
            assert got == held


@pytest.mark.parametrize("num_envs, capacity, end_rate", [(1, 2_000, 0.01), (8, 6_000, 0.02), (4, 8, 0.1),
                                                          (4, 16, 0.1), (6, 64, 0.05), (8, 64, 0.1)])
def test_a_stream_through_a_full_ring_holds_exactly_its_capacity(num_envs, capacity, end_rate):
    """Writers streaming for many laps (small rings too: regions of 2 rows): len is the
    capacity once that many steps were played, after every step."""
    store = ab.ExperienceStore(capacity, seed=0)
    writer = store.writer(num_envs=num_envs, autoreset_mode="disabled")
    rng = np.random.default_rng(3)
    obs = np.zeros((num_envs, 3), np.float32)
    for t in range(6 * capacity // num_envs + 8):
        writer.add(obs=obs, action=np.zeros(num_envs, np.int64), reward=np.ones(num_envs, np.float32),
                   terminated=rng.random(num_envs) < end_rate, truncated=np.zeros(num_envs, bool), next_obs=obs)
        assert len(store) == min((t + 1) * num_envs, capacity)
    assert store.engine.shard.ring <= 2 * capacity + 64


def test_demos_beside_a_live_writer_do_not_push_recent_episodes_out():
    """Case N3: add_episode of cap/3-step demos beside a writer's regions; in steady state
    the store holds its capacity (it held 28-57% of it when pieces were evicted in seal order)."""
    capacity = 1_000
    store = ab.ExperienceStore(capacity, seed=0)
    writer = store.writer(1, autoreset_mode="disabled")
    rng = np.random.default_rng(4)
    lens = []
    for t in range(3_000):
        writer.add(obs=[[float(t)]], action=[0], reward=[1.0], terminated=[rng.random() < 0.01], truncated=[False],
                   next_obs=[[float(t + 1)]])
        if t % 60 == 59:
            steps = capacity // 3
            store.add_episode({"obs": np.arange(steps + 1, dtype=np.float32)[:, None], "action": np.zeros(steps, np.int64),
                               "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
                               "truncated": np.zeros(steps, bool)}, env_id="demo")
        lens.append(len(store))
    steady = np.array(lens[1_500:])
    assert steady.min() >= 0.85 * capacity
    assert steady.min() == capacity


def test_fixed_mode_refuses_at_capacity_transitions_and_leaves_the_store_unchanged():
    store = ab.ExperienceStore(capacity=10, seed=0, mode="fixed")

    def episode(steps):
        return {"obs": np.zeros((steps + 1, 2), np.float32), "action": np.zeros(steps, np.int64),
                "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1}

    store.add_episode(episode(6))
    store.add_episode(episode(4))   # 10 transitions in 12 rows: they fit
    assert len(store) == 10
    with pytest.raises(ab.CapacityError, match=r"capacity=10.*mode='fixed'.*clear\(\)"):
        store.add_episode(episode(1))
    assert (len(store), store.num_episodes) == (10, 2)
    store.clear()
    store.add_episode(episode(10))
    assert len(store) == 10


@pytest.mark.parametrize("num_envs, steps", [(4, 150), (16, 64)])
@pytest.mark.parametrize("num_shards", [1, 2])
def test_a_ray_store_of_num_envs_x_t_holds_every_transition_of_each_rollout(ray_session, num_shards, num_envs, steps):
    # 2 shards: a writer's envs split evenly over them (routed to the least loaded shard at their
    # first piece, 16 envs were split unevenly: one shard got more than its num_envs x T / 2).
    store = ab.ExperienceStore(capacity=num_envs * steps, backend="ray", num_shards=num_shards, seed=0)
    rng = np.random.default_rng(5)
    try:
        for k in range(3):   # a new writer per rollout, no clear(): each rollout replaces the one before
            writer = store.writer(num_envs, autoreset_mode="disabled")
            assert rollout(writer, num_envs, steps, 0.03, rng, tag=k) == num_envs * steps
            writer.flush()
            writer.close()
            store.flush()
            assert len(store) == num_envs * steps
            assert (store.sample(256)["obs"][:, 0] == k).all(), "only the last rollout is held, all of it"
        store.clear()
        writer = store.writer(num_envs, autoreset_mode="disabled")
        assert rollout(writer, num_envs, steps, 0.03, rng, tag=9) == num_envs * steps
        writer.flush()
        store.flush()
        assert len(store) == num_envs * steps
    finally:
        store.close()


def test_a_row_snapshot_is_not_live_once_a_trim_frees_rows_of_its_oldest_episode():
    """Exports and checkpoints write views taken under the lock, then check them (`EpisodeRows.still_live`).
    A trim keeps the oldest episode's id but frees its first rows, which the next writes reuse: the
    check must see it (it compared ids only, and passed over overwritten rows)."""
    store = ab.ExperienceStore(capacity=20, seed=0)
    store.add_episode(make_episode(1, 15))
    shard = store.engine.shard
    rows = take_rows(shard, 0, 1, shard.schema.to_arrow(), copy=False)
    taken = rows.batches[0].column("obs").to_pylist()
    for tag in range(2, 6):   # 4-step episodes: the first is trimmed, then its freed rows are reused
        store.add_episode(make_episode(tag, 4))
        assert int(shard.table.col("episode_id")[0]) == 0   # the oldest episode is still held, trimmed
        changed = rows.batches[0].column("obs").to_pylist() != taken
        held = int(shard.table.col("length")[0])
        assert rows.still_live(shard) == (held == 15)
        assert not changed or not rows.still_live(shard)
    assert changed, "the freed rows were written again: a view taken before holds other data now"


# -- Ray: a shard's share of the capacity follows the envs routed to it (`arrowbuf.ray.shares`) --------

ENVS, STEPS = 3, 41   # 3 envs on 2 shards, a capacity of 123: neither a multiple of the shard count


def held_grid(store) -> tuple[set, set]:
    """(tags, (env, step) pairs) of every transition the store holds, read in one epoch."""
    tags, cells = set(), []
    for batch in store.iter_batches(batch_size=1_024, shuffle=False):
        obs = batch["obs"].numpy().astype(np.int64)
        tags |= set(obs[:, 0].tolist())
        cells += list(zip(obs[:, 1].tolist(), obs[:, 2].tolist()))
    assert len(cells) == len(set(cells)), "a transition held twice"
    return tags, set(cells)


def check_whole_rollout(store, tag: int) -> None:
    store.flush()
    assert len(store) == ENVS * STEPS
    tags, cells = held_grid(store)
    assert tags == {tag} and cells == {(e, t) for e in range(ENVS) for t in range(STEPS)}
    shards = store.stats()["shards"]
    assert sum(s["capacity"] for s in shards) == store.capacity == ENVS * STEPS
    assert all(s["transitions"] <= s["capacity"] for s in shards)


@pytest.fixture(scope="module")
def uneven_ray_store(ray_session):
    store = ab.ExperienceStore(capacity=ENVS * STEPS, backend="ray", num_shards=2, seed=0)
    yield store
    store.close()


def test_apportioned_shares_sum_to_the_capacity_each_within_one_of_its_quota():
    from arrowbuf.ray.shares import apportion

    @settings(max_examples=200, deadline=None)
    @given(capacity=st.integers(0, 10_000), demand=st.lists(st.integers(0, 9), min_size=1, max_size=8))
    def check(capacity, demand):
        if not sum(demand):
            return
        shares = apportion(capacity, demand)
        quota = np.array(demand) * capacity / sum(demand)
        assert shares.sum() == capacity and (np.abs(shares - quota) < 1).all()
        assert (shares[np.array(demand) == 0] == 0).all()

    check()


def test_a_ray_store_of_num_envs_x_t_holds_each_rollout_of_a_new_writer_when_envs_do_not_split_evenly(
        uneven_ray_store):
    store = uneven_ray_store
    store.clear()
    rng = np.random.default_rng(6)
    for k in range(3):   # no clear(): each rollout replaces the one before
        with store.writer(ENVS, autoreset_mode="disabled") as writer:
            assert rollout(writer, ENVS, STEPS, 0.03, rng, tag=k) == ENVS * STEPS
        check_whole_rollout(store, k)
    assert sorted(s["capacity"] for s in store.stats()["shards"]) == [41, 82]   # 2 envs' share and 1 env's


def test_a_ray_store_of_num_envs_x_t_holds_each_rollout_of_writers_rebound_or_dropped_unflushed(uneven_ray_store):
    store = uneven_ray_store
    store.clear()
    rng = np.random.default_rng(7)
    writer = None
    for k in range(3):   # rebound: the previous writer is still open while the next one is made
        writer = store.writer(ENVS, autoreset_mode="disabled")
        rollout(writer, ENVS, STEPS, 0.03, rng, tag=10 + k)
        writer.flush()
        check_whole_rollout(store, 10 + k)
    for k in range(3):   # dropped without flush(): its open episodes are cut and delivered
        store.clear()
        writer = store.writer(ENVS, autoreset_mode="disabled")
        rollout(writer, ENVS, STEPS, 0.0, rng, tag=20 + k)
        del writer
        check_whole_rollout(store, 20 + k)


def test_one_ray_writer_across_cleared_rollouts_keeps_every_transition_when_envs_do_not_split_evenly(
        uneven_ray_store):
    store = uneven_ray_store
    writer = store.writer(ENVS, autoreset_mode="next_step")
    rng = np.random.default_rng(8)
    resetting = np.zeros(ENVS, bool)
    for k in range(3):
        store.clear()
        played, resetting = rollout(writer, ENVS, STEPS, 0.05, rng, tag=k, resetting=resetting)
        writer.flush()
        store.flush()
        assert len(store) == played
        tags, cells = held_grid(store)
        assert tags == {k} and len(cells) == played
        assert float(store.gather(np.concatenate([np.arange(*r) for r in store.live_ranges()]))["reward"].min()) == 1.0
    writer.close()


def test_ray_writers_open_at_once_share_the_capacity_by_their_envs(uneven_ray_store):
    store = uneven_ray_store
    store.clear()
    rng = np.random.default_rng(9)
    pair = store.writer(2, autoreset_mode="disabled", env_ids=["pair-0", "pair-1"])
    single = store.writer(1, autoreset_mode="disabled", env_ids=["single-0"])
    for t in range(STEPS):   # tag, env (over both writers), step
        for writer, envs in ((pair, [0, 1]), (single, [2])):
            obs = np.array([[5, e, t] for e in envs], np.float32)
            writer.add(obs=obs, action=np.zeros(len(envs), np.int64), reward=np.ones(len(envs), np.float32),
                       terminated=rng.random(len(envs)) < 0.03, truncated=np.zeros(len(envs), bool),
                       next_obs=obs + np.float32([0, 0, 1]))
    pair.close()
    single.close()
    check_whole_rollout(store, 5)


def test_uniform_samples_of_a_ray_store_of_uneven_shards_are_uniform_over_its_transitions(uneven_ray_store):
    from scipy.stats import chisquare

    store = uneven_ray_store
    store.clear()
    with store.writer(ENVS, autoreset_mode="disabled") as writer:
        rollout(writer, ENVS, STEPS, 0.03, np.random.default_rng(10), tag=1)
    check_whole_rollout(store, 1)
    counts = np.zeros((ENVS, STEPS))
    for _ in range(40):
        obs = store.sample(256)["obs"].numpy().astype(np.int64)
        np.add.at(counts, (obs[:, 1], obs[:, 2]), 1)
    assert chisquare(counts.ravel()).pvalue > 1e-3   # each of the 123 transitions equally likely
    per_shard = store.stats()["shards"]
    assert sorted(s["transitions"] for s in per_shard) == [41, 82]


def test_a_ray_checkpoint_keeps_uneven_shares_and_the_loaded_store_holds_a_whole_rollout(uneven_ray_store, tmp_path):
    store = uneven_ray_store
    store.clear()
    writer = store.writer(ENVS, autoreset_mode="disabled", name="saved-open")
    rollout(writer, ENVS, STEPS, 0.0, np.random.default_rng(11), tag=2)
    store.save(tmp_path / "ckpt")   # its open episodes are saved as open pieces, its state restored unclaimed
    writer.close()
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    try:
        assert [s["capacity"] for s in loaded.stats()["shards"]] == [s["capacity"] for s in store.stats()["shards"]]
        check_whole_rollout(loaded, 2)
        rng = np.random.default_rng(12)
        for k in range(2):
            with loaded.writer(ENVS, autoreset_mode="disabled") as writer:
                rollout(writer, ENVS, STEPS, 0.03, rng, tag=30 + k)
            check_whole_rollout(loaded, 30 + k)
    finally:
        loaded.close()


def test_a_fixed_ray_store_of_num_envs_x_t_takes_a_whole_rollout_and_refuses_the_next_step(ray_session):
    store = ab.ExperienceStore(capacity=ENVS * STEPS, backend="ray", num_shards=2, seed=0, mode="fixed")
    try:
        writer = store.writer(ENVS, autoreset_mode="disabled")
        rollout(writer, ENVS, STEPS, 0.03, np.random.default_rng(13), tag=3)
        writer.flush()
        check_whole_rollout(store, 3)
        obs = np.zeros((ENVS, 3), np.float32)
        writer.add(obs=obs, action=np.zeros(ENVS, np.int64), reward=np.ones(ENVS, np.float32),
                   terminated=np.ones(ENVS, bool), truncated=np.zeros(ENVS, bool), next_obs=obs)
        with pytest.raises(ab.CapacityError, match="mode='fixed'"):
            writer.flush()
        assert len(store) == ENVS * STEPS
    finally:
        store.close()


@pytest.mark.parametrize("whole_pieces", [False, True])
def test_a_shard_given_a_smaller_share_evicts_its_oldest_now_and_a_larger_one_holds_more(whole_pieces):
    from arrowbuf.engine import ShardEngine
    from arrowbuf.episode_read import read_episode

    engine = ShardEngine(12, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0, room=30,
                         whole_pieces=whole_pieces)
    for e in range(5):   # 4-step episodes: the newest 3 are held
        episode, schema = read_episode(make_episode(e, 4), engine.schema)
        engine.add(episode, schema)
    assert len(engine) == 12
    assert engine.set_capacity(5) == 5 and len(engine) == (4 if whole_pieces else 5)
    assert int(engine.table.col("episode_id")[-1]) == 4   # the newest stay
    assert engine.set_capacity(30) == 30
    for e in range(5, 12):
        episode, schema = read_episode(make_episode(e, 4), engine.schema)
        engine.add(episode, schema)
    held = 28 if whole_pieces else 30   # whole pieces: the oldest episode (4) went whole
    assert len(engine) == held and engine.stats()["capacity"] == 30
    with pytest.raises(ValueError, match=r"capacity must be in \[0, 30\]"):
        engine.set_capacity(31)
    assert len(engine) == held


def test_a_fixed_shard_given_a_smaller_share_keeps_what_it_holds_and_refuses_more():
    from arrowbuf.engine import ShardEngine
    from arrowbuf.episode_read import read_episode

    engine = ShardEngine(10, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0, room=20,
                         mode="fixed")
    episode, schema = read_episode(make_episode(0, 8), None)
    engine.add(episode, schema)
    assert engine.set_capacity(4) == 8 and len(engine) == 8   # never evicts: no lower than it holds
    with pytest.raises(ab.CapacityError):
        engine.add(*read_episode(make_episode(1, 1), engine.schema))
    assert engine.set_capacity(20) == 20
    engine.add(*read_episode(make_episode(1, 12), engine.schema))
    assert len(engine) == 20


def test_add_episodes_too_long_for_one_shards_share_stores_none_of_them(uneven_ray_store):
    # Shares of 82 and 41 (an open writer of 3 envs): an episode of 50 fits a shard of an even
    # split (61) and the larger share but not the smaller. Refused whole, before any shard stores.
    store = uneven_ray_store
    store.clear()
    writer = store.writer(ENVS, autoreset_mode="disabled")
    small = int(np.argmin([s["capacity"] for s in store.stats()["shards"]]))
    assert sorted(s["capacity"] for s in store.stats()["shards"]) == [41, 82]
    store.pin_env("fits", 1 - small)
    store.pin_env("too-long", small)
    steps = 50
    episodes = {"obs": np.zeros((2, steps + 1, 3), np.float32), "action": np.zeros((2, steps), np.int64),
                "reward": np.ones((2, steps), np.float32), "terminated": np.arange(steps) == np.full((2, 1), steps - 1),
                "truncated": np.zeros((2, steps), bool)}
    with pytest.raises(ab.CapacityError, match=f"shard {small}'s share .* 41 transitions.*nothing was stored"):
        store.add_episodes(episodes, lengths=[30, steps], env_ids=["fits", "too-long"])
    store.flush()
    assert len(store) == 0 and [s["episodes"] for s in store.stats()["shards"]] == [0, 0]
    assert len(store.add_episodes(episodes, lengths=[30, steps], env_ids=["fits", "fits"])) == 2   # 80 of 82
    store.flush()
    assert len(store) == 30 + steps
    writer.close()


def test_a_fields_max_bytes_follows_the_capacity_shares_and_a_whole_rollout_stays_held(ray_session):
    # 10 tokens a step, max_bytes of exactly a rollout's tokens: split evenly, the shard of the
    # 82-transition share would have room for 61 steps' tokens and evict the rest of its rollout.
    tokens = 10
    store = ab.ExperienceStore(capacity=ENVS * STEPS, backend="ray", num_shards=2, seed=0, schema={
        "obs": ab.Field("float32", (3,), observation=True), "action": "int64", "reward": "float32",
        "terminated": "bool", "truncated": "bool", "tokens": ab.Field("int32", (None,), max_bytes=ENVS * STEPS * tokens * 4)})
    try:
        for k in range(2):
            with store.writer(ENVS, autoreset_mode="disabled") as writer:
                obs = np.zeros((ENVS, 3), np.float32)
                for t in range(STEPS):
                    writer.add(obs=obs, action=np.zeros(ENVS, np.int64), reward=np.ones(ENVS, np.float32),
                               terminated=np.zeros(ENVS, bool), truncated=np.zeros(ENVS, bool), next_obs=obs,
                               tokens=[np.full(tokens, 1000 * k + 10 * e + t % 10, np.int32) for e in range(ENVS)])
            store.flush()
            assert sorted(s["capacity"] for s in store.stats()["shards"]) == [41, 82]
            assert len(store) == ENVS * STEPS
            batch = store.gather(np.concatenate([np.arange(*r) for r in store.live_ranges()]))
            values = batch["tokens"].values().view(-1, tokens)
            assert values.shape[0] == ENVS * STEPS and set((values[:, 0] // 1000).tolist()) == {k}
    finally:
        store.close()


def test_add_episodes_with_too_many_bytes_for_one_shards_part_of_max_bytes_stores_none_of_them(ray_session):
    # max_bytes of 2,000 bytes over 2 even shards: 1,000 each. An episode of 1,200 bytes of tokens fits
    # the store's budget but no shard's part: refused whole, before the other shard stores its episode.
    store = ab.ExperienceStore(capacity=100, backend="ray", num_shards=2, seed=0, schema={
        "obs": ab.Field("float32", (3,), observation=True), "action": "int64", "terminated": "bool",
        "tokens": ab.Field("int32", (None,), max_bytes=2000)})
    try:
        store.writer(2, autoreset_mode="disabled").close()   # the shares are known: the process that started it
        store.pin_env("small", 0)
        store.pin_env("large", 1)
        steps = 3
        episodes = {"obs": np.zeros((2, steps + 1, 3), np.float32), "action": np.zeros((2, steps), np.int64),
                    "terminated": np.arange(steps) == np.full((2, 1), steps - 1),
                    "tokens": [[np.zeros(10, np.int32)] * steps, [np.zeros(100, np.int32)] * steps]}
        with pytest.raises(ab.CapacityError, match="field 'tokens': an episode of 1,200 bytes.*shard 1.*nothing was "
                                                   "stored"):
            store.add_episodes(episodes, env_ids=["small", "large"])
        store.flush()
        assert len(store) == 0 and [s["episodes"] for s in store.stats()["shards"]] == [0, 0]
    finally:
        store.close()
