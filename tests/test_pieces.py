"""Pieces are storage, not data (issue 33): an episode that a step writer cut into pieces
(small regions of a ring, a Ray writer's shipped open steps) is one episode to its user: one
``episode_id``, one row of ``episodes()`` and of an export, counted once, GAE across its
pieces, and a kept ``index`` that never names another step."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab

ENVS = 4
GAMMA, LAM = 0.9, 0.8
CUT_VALUE = 0.25   # the value bootstrap_value gives every final observation


class Played:
    """Steps of ``ENVS`` envs with episodes of given lengths (longer than a region), each step's
    obs naming its (env, episode, step) so a stored row says which played step it is."""

    def __init__(self, lengths: list[list[int]], seed: int) -> None:
        self.lengths = lengths
        self.rng = np.random.default_rng(seed)
        self.episode = np.zeros(ENVS, np.int64)
        self.t = np.zeros(ENVS, np.int64)
        self.steps: dict[tuple[int, int], list[tuple[float, float, bool]]] = defaultdict(list)

    def key(self, env: np.ndarray) -> np.ndarray:
        return env * 1000 + self.episode[env]

    def add(self, writer: ab.StepWriter) -> None:
        envs = np.arange(ENVS)
        length = np.array([self.lengths[e][self.episode[e] % len(self.lengths[e])] for e in envs])
        done = self.t + 1 >= length
        obs = np.stack([self.key(envs), self.t], 1).astype(np.float64)
        reward = self.rng.normal(size=ENVS).astype(np.float32)
        value = self.rng.normal(size=ENVS).astype(np.float32)
        writer.add(obs=obs, action=self.t.copy(), reward=reward, value=value, terminated=done,
                   truncated=np.zeros(ENVS, bool), next_obs=obs + [0, 1])
        for e in envs:
            self.steps[int(self.key(np.array(e)))].append((float(reward[e]), float(value[e]), bool(done[e])))
        self.episode[done] += 1
        self.t = np.where(done, 0, self.t + 1)

    def advantages(self, key: int) -> np.ndarray:
        """A plain GAE loop over the played episode (cut ones bootstrap from ``CUT_VALUE``)."""
        steps = self.steps[key]
        out, carry = np.zeros(len(steps)), 0.0
        for t in range(len(steps) - 1, -1, -1):
            reward, value, done = steps[t]
            last = t + 1 == len(steps)
            next_value = 0.0 if done else (CUT_VALUE if last else steps[t + 1][1])
            carry = reward + GAMMA * next_value - value + (0.0 if last or done else GAMMA * LAM * carry)
            out[t] = carry
        return out


def held(store: ab.ExperienceStore) -> dict[str, np.ndarray]:
    """Every stored transition (an epoch), as numpy columns."""
    columns = defaultdict(list)
    for batch in store.iter_batches(512):
        obs = batch["obs"].numpy()
        columns["key"].append(obs[:, 0].astype(np.int64))
        columns["t"].append(obs[:, 1].astype(np.int64))
        for name in ("episode_id", "step", "reward", "index"):
            columns[name].append(batch[name].numpy())
        if "advantage" in batch.keys():
            columns["advantage"].append(batch["advantage"].numpy())
    return {name: np.concatenate(parts) for name, parts in columns.items()}


def check_to_arrow(store: ab.ExperienceStore) -> None:
    """`to_arrow` shows each played episode as one run of its held rows: consecutive steps,
    each once, one ``is_last`` row at its end (no piece boundary shows)."""
    rows = store.to_arrow()
    ids, step = rows.column("episode_id").to_numpy(), rows.column("step").to_numpy()
    last = rows.column("is_last").to_numpy()
    t = rows.column("obs").combine_chunks().to_numpy_ndarray()[:, -1]
    episodes = store.episodes().to_pylist()
    assert sum(e["length"] + e["has_final"] for e in episodes) == rows.num_rows
    for episode in episodes:
        mine = np.flatnonzero(ids == episode["episode_id"])
        assert len(mine) == episode["length"] + episode["has_final"]
        assert np.array_equal(step[mine], episode["first_step"] + np.arange(len(mine))), "each step once, in order"
        assert np.array_equal(t[mine], step[mine]), "each row is its own step's"
        assert np.flatnonzero(last[mine]).tolist() == [len(mine) - 1], "one is_last, at the episode's end"


def split_store(capacity: int, lengths: list[list[int]], steps: int, seed: int,
                **options) -> tuple[ab.ExperienceStore, Played]:
    store = ab.ExperienceStore(capacity=capacity, seed=seed, **options)
    played = Played(lengths, seed)
    writer = store.writer(ENVS, autoreset_mode="disabled")
    for _ in range(steps):
        played.add(writer)
    writer.flush()
    return store, played


LENGTHS = st.lists(st.lists(st.integers(150, 700), min_size=1, max_size=3), min_size=ENVS, max_size=ENVS)


@settings(max_examples=6, deadline=None)
@given(capacity=st.integers(700, 1500), lengths=LENGTHS, steps=st.integers(400, 1200), seed=st.integers(0, 99))
def test_a_played_episode_split_into_pieces_has_one_id_one_row_and_counts_once(capacity, lengths, steps, seed):
    store, played = split_store(capacity, lengths, steps, seed)
    rows = held(store)
    assert store.engine.table.pieces, "episodes longer than a region are stored in pieces"
    ids = defaultdict(set)
    for key, episode_id in zip(rows["key"].tolist(), rows["episode_id"].tolist()):
        ids[key].add(episode_id)
    assert max(len(v) for v in ids.values()) == 1, "one episode_id per played episode"
    assert len({i for v in ids.values() for i in v}) == len(ids), "and another for each other episode"
    assert store.num_episodes == len(ids) == store.episodes().num_rows   # flushed: every held episode ended
    episodes = store.episodes().to_pylist()
    for row in episodes:
        key = next(k for k, v in ids.items() if row["episode_id"] in v)
        mine = rows["key"] == key
        assert row["length"] == mine.sum() and row["first_step"] == rows["t"][mine].min()
        assert row["return"] == pytest.approx(float(rows["reward"][mine].astype(np.float64).sum()), rel=1e-5, abs=1e-4)
        assert row["terminated"] == played.steps[key][-1][2]
    one = store.episode(episodes[-1]["episode_id"])   # its held pieces, read as one
    assert np.array_equal(one.column("step").to_numpy(), episodes[-1]["first_step"] + np.arange(one.num_rows))
    check_to_arrow(store)


def test_the_parquet_export_holds_one_row_per_played_episode(tmp_path):
    duckdb = pytest.importorskip("duckdb")
    store, played = split_store(900, [[400], [500], [300, 650], [600]], 900, seed=1)
    store.to_parquet(tmp_path / "out")
    episodes = pq.read_table(tmp_path / "out" / "episodes.parquet")
    steps = pq.read_table(tmp_path / "out" / "steps")
    assert episodes.num_rows == store.num_episodes == len(set(held(store)["key"].tolist()))
    per_id = duckdb.sql("select episode_id, count(*) as n, sum(reward) as ret, min(step) as first "
                        "from steps where not final_observation group by episode_id order by episode_id").fetchall()
    expect = sorted(zip(episodes.column("episode_id").to_pylist(), episodes.column("length").to_pylist(),
                        episodes.column("return").to_pylist(), episodes.column("first_step").to_pylist()))
    assert [(i, n, f) for i, n, _, f in per_id] == [(i, n, f) for i, n, _, f in expect]
    np.testing.assert_allclose([r for *_, r, _ in per_id], [r for *_, r, _ in expect], rtol=1e-5, atol=1e-4)
    obs = steps.column("obs").combine_chunks().to_numpy_ndarray().reshape(-1, 2)
    for episode_id in episodes.column("episode_id").to_pylist()[:5]:   # rows of an episode: its steps, once
        mine = (steps.column("episode_id").to_numpy() == episode_id)
        assert len(set(obs[mine, 0].tolist())) == 1 and np.array_equal(np.diff(obs[mine, 1]), np.ones(mine.sum() - 1))
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    assert loaded.num_episodes == episodes.num_rows and len(loaded) == len(store)


def check_gae(store: ab.ExperienceStore, played: Played) -> float:
    rows = held(store)
    worst = 0.0
    for key in set(rows["key"].tolist()):
        mine = rows["key"] == key
        expect = played.advantages(key)[rows["t"][mine]]
        worst = max(worst, float(np.abs(rows["advantage"][mine] - expect).max()))
    return worst


@settings(max_examples=4, deadline=None)
@given(capacity=st.integers(700, 1500), lengths=LENGTHS, seed=st.integers(0, 99))
def test_compute_gae_over_pieces_equals_a_loop_over_the_played_episode(capacity, lengths, seed):
    store, played = split_store(capacity, lengths, 900, seed)
    assert store.engine.table.pieces
    written = store.compute_gae(GAMMA, LAM, bootstrap_value=lambda obs: np.full(obs.batch_size[0], CUT_VALUE))
    assert written == len(store)
    assert check_gae(store, played) < 1e-5


def test_a_kept_index_of_an_open_step_names_that_step_after_writers_go_on():
    store = ab.ExperienceStore(capacity=1000, seed=0)
    played = Played([[10 ** 6]] * ENVS, seed=0)
    writer = store.writer(ENVS, autoreset_mode="disabled")
    for _ in range(20):
        played.add(writer)
    batch = store.sample(64)   # open steps only: nothing is sealed yet
    kept = batch["index"].clone()
    for _ in range(40):
        played.add(writer)
    writer.flush()
    again = store.gather(kept)
    assert len(again) == 64
    assert np.array_equal(again["obs"].numpy(), batch["obs"].numpy()), "each kept index gathers its own step"
    assert np.array_equal(again["index"].numpy(), store.gather(again["index"])["index"].numpy())


def test_update_priorities_of_a_kept_open_index_reaches_its_step_and_no_other():
    store = ab.ExperienceStore(capacity=1000, seed=0, sampler=ab.PrioritizedSampler(alpha=1.0))
    played = Played([[10 ** 6]] * ENVS, seed=0)
    writer = store.writer(ENVS, autoreset_mode="disabled")
    for _ in range(30):
        played.add(writer)   # a region fills: sealed pieces to draw from, open steps after them
    epoch = next(iter(store.iter_batches(len(store))))   # every step, open ones included
    newest = int(np.argmax(epoch["obs"].numpy()[:, 1]))   # a step of an open tail
    target, obs = int(epoch["index"][newest]), epoch["obs"].numpy()[newest]
    for _ in range(40):
        played.add(writer)
    writer.flush()
    assert store.update_priorities(np.array([target]), np.array([1e6])) == 1
    drawn = store.sample(2000)["obs"].numpy()
    assert (drawn == obs).all(axis=1).mean() > 0.9, "the boosted step is the kept one"


@settings(max_examples=25, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(1, 40), st.booleans(), st.integers(1, 16)), min_size=1, max_size=6),
       capacity=st.integers(40, 400))
def test_every_kept_index_gathers_its_own_step_or_nothing(ops, capacity):
    store = ab.ExperienceStore(capacity=capacity, seed=0)
    played = Played([[7], [13], [10 ** 6], [25]], seed=0)
    writer = store.writer(ENVS, autoreset_mode="disabled")
    kept_index, kept_obs = [], []
    for steps, flush, draw in ops:
        for _ in range(steps):
            played.add(writer)
        if flush:
            writer.flush()
        if len(store):
            batch = store.sample(draw)
            kept_index.append(batch["index"].numpy())
            kept_obs.append(batch["obs"].numpy())
        for index, obs in zip(kept_index, kept_obs):
            for i, o in zip(index.tolist(), obs):
                try:
                    again = store.gather(np.array([i]))
                except KeyError:   # no longer held (evicted): refused, never another step
                    continue
                assert np.array_equal(again["obs"].numpy()[0], o), f"index {i} names another step"


@pytest.mark.usefixtures("ray_session")
def test_compute_gae_on_ray_runs_across_the_pieces_a_writer_shipped():
    # A shard of 400 rows: a writer ships an env's staged steps as a piece at a quarter of it
    # (`arrowbuf.piece_cutting.cut_rows`), so episodes of 150-700 steps arrive in pieces.
    store = ab.ExperienceStore(capacity=800, backend="ray", num_shards=2, seed=0)
    try:
        played = Played([[260], [180, 330], [240], [300]], seed=3)
        writer = store.writer(ENVS, autoreset_mode="disabled")
        for _ in range(330):
            played.add(writer)
        writer.flush()
        rows = held(store)
        ids = defaultdict(set)
        for key, episode_id in zip(rows["key"].tolist(), rows["episode_id"].tolist()):
            ids[key].add(episode_id)
        assert max(len(v) for v in ids.values()) == 1, "one episode_id per played episode"
        assert store.num_episodes == len(ids) == store.episodes().num_rows
        check_to_arrow(store)
        store.compute_gae(GAMMA, LAM, bootstrap_value=lambda obs: np.full(obs.batch_size[0], CUT_VALUE))
        assert check_gae(store, played) < 1e-5
        writer.close()
    finally:
        store.close()
