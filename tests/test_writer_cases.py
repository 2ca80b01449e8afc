"""Writers keep their word (issue 33, local cases): a closed writer writes nothing, a dropped
writer keeps its steps, a new writer per rollout stores no reset step, a loaded writer checks
resets as the saved one did, NaN observations, versions of refused steps, and observations
that differ from the last next_obs."""

from __future__ import annotations

import gc
from collections import Counter

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode

import arrowbuf as ab


def step(writer: ab.StepWriter, base: int, t: int, **extra) -> None:
    """One step of every env whose obs, action and reward encode ``base + t`` (next_obs ``base + t + 1``)."""
    n = writer.num_envs
    value = base + t
    writer.add(obs=np.full((n, 1), value, np.float32), action=np.full(n, value, np.int64),
               reward=np.full(n, value, np.float32), terminated=np.zeros(n, bool), truncated=np.zeros(n, bool),
               next_obs=np.full((n, 1), value + 1, np.float32), **extra)


def check_consistent(store: ab.ExperienceStore) -> int:
    """Every stored transition is one step of one writer: obs, action, reward and next_obs agree."""
    count = 0
    for batch in store.iter_batches(4096, shuffle=False):
        obs = batch["obs"][:, 0].numpy()
        assert (batch["action"].numpy() == obs).all()
        assert (batch["reward"].numpy() == obs).all()
        assert (batch["next", "obs"][:, 0].numpy() == obs + 1).all()
        count += len(obs)
    return count


# -- N1: a closed writer ----------------------------------------------------------------------

def test_a_closed_writer_refuses_every_step_and_never_touches_a_new_writers_rows():
    store = ab.ExperienceStore(capacity=1000, seed=0)
    w1 = store.writer(2, autoreset_mode="disabled")
    for t in range(5):
        step(w1, 1000, t)
    w1.close()
    w2 = store.writer(2, autoreset_mode="disabled")   # takes the slots w1 released
    for t in range(5):
        with pytest.raises(ab.WriterClosedError, match=r"writer-0.*closed.*store\.writer"):
            step(w1, 1000, 5 + t)
        step(w2, 2000, t)
    with pytest.raises(ab.WriterClosedError):
        w1.flush()
    w1.close()   # closing again is harmless
    w2.close()
    assert check_consistent(store) == len(store) == 20
    assert "writer-0" not in store.writers


def test_a_with_block_writer_used_after_its_block_is_refused():
    store = ab.ExperienceStore(capacity=1000, seed=0)
    with store.writer(2, autoreset_mode="disabled") as w:
        step(w, 100, 0)
    other = store.writer(2, autoreset_mode="disabled")
    step(other, 500, 0)
    with pytest.raises(ab.WriterClosedError, match="closed"):
        step(w, 100, 1)
    other.flush()
    assert check_consistent(store) == len(store) == 4


# -- N2: a dropped writer -------------------------------------------------------------------

def test_a_writer_dropped_without_flush_keeps_every_step_it_wrote():
    store = ab.ExperienceStore(capacity=10_000, seed=0)   # room for every step: nothing is evicted
    for rollout in range(3):
        w = store.writer(2, autoreset_mode="disabled")   # a new writer per rollout, no flush: the old one is dropped
        for t in range(100):
            step(w, 1000 * rollout, t)
        assert len(store) == 200 * (rollout + 1)
    del w
    gc.collect()
    assert len(store) == 600 and check_consistent(store) == 600
    table = store.episodes(include_open=True)   # each env's rollout sealed, as flush() would have: none open
    assert not any(table.column("open").to_pylist()) and sum(table.column("length").to_pylist()) == 600


STAGED_STORES = {"fixed": {"mode": "fixed"},
                 "rate limiter": {"rate_limiter": ab.SampleToInsertRatio(1.0, min_size=1, error_buffer=100_000)}}


@pytest.mark.parametrize("kind", list(STAGED_STORES))
def test_a_staged_writer_dropped_each_rollout_fills_a_store_of_exactly_num_envs_x_t(kind):
    # The size PPO users choose: capacity = num_envs x T, a new writer per rollout, dropped, clear() between.
    store = ab.ExperienceStore(capacity=2 * 100, seed=0, **STAGED_STORES[kind])
    for rollout in range(3):
        w = store.writer(2, autoreset_mode="disabled")
        for t in range(100):
            step(w, 1000 * rollout, t)
        del w
        gc.collect()
        assert len(store) == 200 and store.num_episodes == 2 and check_consistent(store) == 200
        assert sorted(store.episodes().column("length").to_pylist()) == [100, 100]
        store.clear()


@pytest.mark.parametrize("kind", list(STAGED_STORES))
def test_a_staged_writer_dropped_without_flush_keeps_every_step_it_wrote(kind):
    # mode="fixed" and a rate limiter stage a writer's episodes (nothing is written in place):
    # a dropped writer's open episodes were lost with it.
    store = ab.ExperienceStore(capacity=10_000, seed=0, **STAGED_STORES[kind])
    for rollout in range(3):
        w = store.writer(2, autoreset_mode="disabled")   # a new writer per rollout, no flush: the old one is dropped
        assert w._inplace is None   # staged
        for t in range(100):
            step(w, 1000 * rollout, t)
        assert len(store) == 200 * rollout   # open episodes are staged until they end
    del w
    gc.collect()
    assert len(store) == 600 and check_consistent(store) == 600 and store.num_episodes == 6


def test_a_staged_writer_dropped_inside_a_store_call_writes_its_steps_when_that_call_ends():
    store = ab.ExperienceStore(capacity=10_000, seed=0, mode="fixed")
    w = store.writer(2, autoreset_mode="disabled")
    for t in range(10):
        step(w, 0, t)
    with store.engine.lock:   # as if GC ran the writer's __del__ inside one of this thread's store calls
        del w
        gc.collect()
        assert len(store.engine.shard.table) == 0   # deferred: nothing changed under the call
    assert store.num_episodes == 2 and check_consistent(store) == len(store) == 20


def test_a_dropped_staged_writer_whose_episodes_the_store_refuses_says_so_and_leaves_the_store_as_it_was(caplog):
    store = ab.ExperienceStore(capacity=50, seed=0, mode="fixed")   # a full fixed store refuses (CapacityError)
    store.add_episode({"obs": np.zeros((41, 1), np.float32), "action": np.zeros(40, np.int64),
                       "reward": np.zeros(40, np.float32), "terminated": np.arange(40) == 39,
                       "truncated": np.zeros(40, bool)})
    w = store.writer(2, autoreset_mode="disabled")
    for t in range(8):
        step(w, 0, t)
    with caplog.at_level("WARNING", logger="arrowbuf.episodes"):
        del w
        gc.collect()
    assert "dropped without flush() or close(); the store refused 1 of its episodes (8 steps)" in caplog.text
    assert len(store) == 48 and store.num_episodes == 2   # the one that fitted is kept; nothing half-written
    assert check_consistent_prefix(store)


def check_consistent_prefix(store: ab.ExperienceStore) -> bool:
    """The writer's steps that were stored are whole, consistent episodes (obs 0.. with next_obs obs + 1)."""
    table = store.to_arrow()
    episodes = table.column("episode_id").to_numpy()
    obs = table.column("obs").combine_chunks().to_numpy_ndarray()[:, 0]
    written = obs[episodes == episodes[-1]]
    return written.tolist() == list(range(len(written)))


def test_a_dropped_writer_collected_inside_a_store_call_seals_its_steps_when_that_call_ends():
    store = ab.ExperienceStore(capacity=10_000, seed=0)
    w = store.writer(2, autoreset_mode="disabled")
    for t in range(10):
        step(w, 0, t)
    finalizer = w._inplace._finalizer
    with store.engine.lock:   # as if GC ran the finalizer inside one of this thread's store calls
        del w
        assert finalizer.alive is False
        assert len(store.engine.shard.table) == 0   # deferred: nothing changed under the call
    assert store.num_episodes == 2 and len(store) == 20   # sealed as the call let the lock go, no write needed
    other = store.writer(2, autoreset_mode="disabled")
    step(other, 500, 0)
    other.flush()
    assert store.num_episodes == 4 and check_consistent(store) == len(store) == 22


# -- N4: the reset step of a new writer --------------------------------------------------------

MODES = {"next_step": AutoresetMode.NEXT_STEP, "same_step": AutoresetMode.SAME_STEP,
         "disabled": AutoresetMode.DISABLED}


def rollouts(mode: str, told: bool, pattern: str, num_rollouts: int = 40, steps: int = 25,
             num_envs: int = 8) -> tuple[ab.ExperienceStore, Counter]:
    """CartPole rollouts into a store: ``pattern`` "one" (one writer, flush() per rollout),
    "with" (a new writer per rollout, closed by its with block) or "dropped" (a new writer
    per rollout, never flushed). Returns the store and the transitions played."""
    envs = gym.make_vec("CartPole-v1", num_envs=num_envs, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": MODES[mode]})
    store = ab.ExperienceStore(capacity=100_000, seed=0)   # room for every step: nothing evicted
    make = (lambda: store.writer(env=envs)) if told else (lambda: store.writer(num_envs))
    obs, _ = envs.reset(seed=0)
    envs.action_space.seed(0)
    resetting = np.zeros(num_envs, bool)
    played: Counter = Counter()
    writer = make() if pattern == "one" else None
    for _ in range(num_rollouts):
        if pattern != "one":
            writer = make()   # "dropped": the previous one is dropped here
        for _ in range(steps):
            action = envs.action_space.sample()
            next_obs, reward, terminated, truncated, info = envs.step(action)
            writer.add(obs=obs, action=action, reward=reward.astype(np.float32), terminated=terminated,
                       truncated=truncated, next_obs=next_obs,
                       final_obs=info.get("final_obs") if mode == "same_step" else None)
            real = ~resetting if mode == "next_step" else np.ones(num_envs, bool)
            for i in np.flatnonzero(real):
                played[obs[i].tobytes(), int(action[i])] += 1
            done = terminated | truncated
            if mode == "disabled" and done.any():
                next_obs, _ = envs.reset(options={"reset_mask": done})
            resetting = done
            obs = next_obs
        if pattern == "one":
            writer.flush()
        elif pattern == "with":
            writer.close()
    del writer
    gc.collect()
    envs.close()
    return store, played


def stored(store: ab.ExperienceStore) -> tuple[Counter, int]:
    """The stored transitions (obs bytes, action), and the bogus ones: reward 0 (CartPole pays 1
    a step), not terminal, from a terminal state (|angle| > 0.2095 or |x| > 2.4)."""
    rows: Counter = Counter()
    bogus = 0
    for batch in store.iter_batches(4096, shuffle=False):
        obs = batch["obs"].numpy()
        for o, a in zip(obs, batch["action"].tolist()):
            rows[o.tobytes(), int(a)] += 1
        fake = (batch["reward"].numpy() == 0) & ~batch["terminated"].numpy() & ~batch["truncated"].numpy() \
            & ((np.abs(obs[:, 2]) > 0.2095) | (np.abs(obs[:, 0]) > 2.4))
        bogus += int(fake.sum())
    return rows, bogus


@pytest.mark.parametrize("pattern", ["with", "dropped"])
@pytest.mark.parametrize("told", [True, False], ids=["mode-told", "no-mode"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_new_writer_per_rollout_stores_what_one_flushed_writer_stores_in_every_autoreset_mode(mode, told,
                                                                                               pattern):
    if mode == "same_step" and not told:
        pytest.skip("a same-step env given no mode is refused (tests/test_autoreset.py)")
    want, want_bogus, played, reference_size = flushed_reference(mode, told)
    store, again = rollouts(mode, told, pattern)
    assert again == played
    got, bogus = stored(store)
    assert want == played and want_bogus == 0
    assert bogus == 0
    assert got == want and len(store) == reference_size


#: (mode, told) -> what one flushed writer's rollouts stored: the reference of both patterns
#: ("with", "dropped"), played once (seeded: the same rollouts each time).
_REFERENCES: dict[tuple[str, bool], tuple[Counter, int, Counter, int]] = {}


def flushed_reference(mode: str, told: bool) -> tuple[Counter, int, Counter, int]:
    """``stored`` of the "one" pattern's store, the transitions played, and the store's size."""
    if (mode, told) not in _REFERENCES:
        reference, played = rollouts(mode, told, "one")
        _REFERENCES[mode, told] = (*stored(reference), played, len(reference))
    return _REFERENCES[mode, told]


def one_step(writer: ab.StepWriter, obs: float, reward: float, done: bool, next_obs: float) -> None:
    writer.add(obs=np.full((1, 2), obs, np.float32), action=np.zeros(1, np.int64),
               reward=np.full(1, reward, np.float32), terminated=np.full(1, done), truncated=np.zeros(1, bool),
               next_obs=np.full((1, 2), next_obs, np.float32))


def test_a_new_next_step_writer_drops_only_a_reset_step_from_the_last_final_observation():
    store = ab.ExperienceStore(capacity=100, seed=0)
    with store.writer(1, autoreset_mode="next_step") as w:
        one_step(w, 0, 1, True, 1)    # the rollout ends with the episode: final observation 1
    store.writer(1, autoreset_mode="next_step").close()   # a writer that never stepped leaves that end alone
    with store.writer(1, autoreset_mode="next_step") as w:
        one_step(w, 1, 0, False, 50)   # gymnasium's reset step: no transition
        one_step(w, 50, 1, True, 51)
    with store.writer(1, autoreset_mode="next_step") as w:
        one_step(w, 70, 0, False, 71)   # the user reset the env between rollouts: a transition
    assert sorted(store.sample(64)["obs"][:, 0].unique().tolist()) == [0, 50, 70] and len(store) == 3


# -- N5: the reset check after load ---------------------------------------------------------------

@pytest.mark.parametrize("reward", [1.0, 0.0])
def test_a_loaded_writer_given_no_mode_checks_resets_as_the_saved_one_would(tmp_path, reward):
    def play(store: ab.ExperienceStore, writer_of) -> int:
        w = writer_of(store)
        one_step(w, 7.0, reward, False, 8.0)   # the user reset the env: obs 7 is not the last next_obs
        w.flush()
        return len(store)

    store = ab.ExperienceStore(capacity=100, seed=0)
    w = store.writer(1, name="runner")   # no mode: next_step assumed and checked
    one_step(w, 0.0, 1.0, True, 1.0)   # the episode ends with next_obs 1
    store.save(tmp_path / "ck")
    loaded = ab.ExperienceStore.load(tmp_path / "ck")
    assert play(loaded, lambda s: s.writer(1, name="runner")) == play(store, lambda s: w) == 2


# -- N7: NaN in a final observation ------------------------------------------------------------------

@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_a_reset_step_from_a_final_observation_holding_nan_is_recognised(in_place):
    store = ab.ExperienceStore(capacity=100, seed=0, **({} if in_place else {"mode": "fixed"}))
    w = store.writer(1)   # no mode: checked
    final = np.array([[np.nan, 2.0]], np.float32)
    w.add(obs=np.zeros((1, 2), np.float32), action=np.zeros(1, np.int64), reward=np.ones(1, np.float32),
          terminated=np.ones(1, bool), truncated=np.zeros(1, bool), next_obs=final)
    w.add(obs=final.copy(), action=np.zeros(1, np.int64), reward=np.zeros(1, np.float32),   # gymnasium's reset step
          terminated=np.zeros(1, bool), truncated=np.zeros(1, bool), next_obs=np.full((1, 2), 5.0, np.float32))
    w.flush()
    assert len(store) == 1 and w.reset_check.dropped == 1 and w.reset_check.kept == 0


# -- N8: policy versions of refused steps, and out of range --------------------------------------

def test_a_refused_step_records_no_version_and_adds_no_version_column():
    store = ab.ExperienceStore(capacity=100, seed=0)
    w = store.writer(2, autoreset_mode="disabled")
    step(w, 0, 0)
    with pytest.raises(ab.SchemaError):
        w.add(obs=np.zeros((2, 3), np.float32), action=np.zeros(2, np.int64), reward=np.zeros(2, np.float32),
              terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.zeros((2, 3), np.float32),
              policy_version=9)
    assert "policy_version" not in store.schema.fields
    step(w, 0, 1, policy_version=3)   # the corrected retry, with an older version than the refused one
    w.flush()
    assert sorted(store.sample(64)["policy_version"].unique().tolist()) == [0, 3]


@pytest.mark.parametrize("value", [2**63, [0, 2**63], 2**70])
def test_a_policy_version_past_int64_is_refused_as_out_of_range(value):
    store = ab.ExperienceStore(capacity=100, seed=0)
    episode = {"obs": np.zeros((3, 1), np.float32), "action": np.zeros(2, np.int64),
               "reward": np.zeros(2, np.float32), "terminated": np.zeros(2, bool), "truncated": np.zeros(2, bool)}
    with pytest.raises(ValueError, match="policy_version.*out of range"):
        store.add_episode(episode, policy_version=value if not isinstance(value, list) else [1, 2**63])
    assert len(store) == 0 and store.schema is None
    w = store.writer(2, autoreset_mode="disabled")
    with pytest.raises(ValueError, match="policy_version.*out of range"):
        step(w, 0, 0, policy_version=value)
    assert len(store) == 0 and w.open_steps.sum() == 0
    step(w, 0, 0, policy_version=5)
    assert len(store) == 2


# -- item 4: an obs that differs from the last next_obs --------------------------------------------

@pytest.mark.parametrize("mode", ["disabled", "next_step", "same_step"])
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "staged"])
def test_an_obs_that_differs_from_the_last_next_obs_is_refused_and_never_replaced(mode, in_place):
    store = ab.ExperienceStore(capacity=100, seed=0, **({} if in_place else {"mode": "fixed"}))
    w = store.writer(2, autoreset_mode=mode)
    for t, value in enumerate([10.0, 20.0, 30.0]):   # next_obs value + 1: every later obs differs from it
        obs = np.full((2, 1), value, np.float32)
        args = dict(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                    terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=obs + 1)
        if t == 0:
            w.add(**args)
            continue
        with pytest.raises(ab.ObservationMismatchError, match=r"'env-0' \(env 0\).*step 1.*next_obs"):
            w.add(**args)
    w.flush()
    batch = store.sample(16)
    assert len(store) == 2 and (batch["obs"] == 10).all() and (batch["next", "obs"] == 11).all()


def test_observations_passed_on_as_views_copies_or_one_reused_buffer_are_no_mismatch():
    rollout = np.arange(12, dtype=np.float32).reshape(6, 2, 1)   # [T + 1, envs, 1], as a rollout tensor holds it
    store = ab.ExperienceStore(capacity=100, seed=0)
    w = store.writer(2, autoreset_mode="disabled")
    for t in range(5):   # a new view each step; every other step a copy of equal values
        obs = rollout[t] if t % 2 else rollout[t].copy()
        w.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32), terminated=np.zeros(2, bool),
              truncated=np.zeros(2, bool), next_obs=rollout[t + 1])
    buffer = np.zeros((2, 1), np.float32)   # an env that returns one buffer, rewritten in place each step
    w2 = store.writer(2, autoreset_mode="disabled")
    for t in range(5):
        obs = buffer
        buffer[...] = 100 + t
        w2.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32), terminated=np.zeros(2, bool),
               truncated=np.zeros(2, bool), next_obs=buffer)
    w.flush()
    w2.flush()
    assert len(store) == 20


def test_an_in_place_step_the_byte_budget_refuses_records_no_version():
    """An in-place writer's step that a field's max_bytes refuses writes nothing; its versions were
    recorded all the same (445c707), so the corrected retry with the version it meant was refused as
    decreasing."""
    fields = {"obs": ab.Field("float32", (2,), observation=True), "action": ab.Field("int64"),
              "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool"),
              "tokens": ab.Field("int64", (None,), max_bytes=256), "policy_version": ab.Field("int64")}
    store = ab.ExperienceStore(capacity=100, schema=fields, seed=0)
    w = store.writer(2, autoreset_mode="same_step")
    assert w._inplace is not None   # the in-place path (a plain local circular store)

    def add(t: int, tokens: int, version: int) -> None:
        w.add(obs=np.full((2, 2), t, np.float32), action=np.zeros(2, np.int64), reward=np.zeros(2, np.float32),
              terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1, np.float32),
              tokens=[np.zeros(tokens, np.int64)] * 2, policy_version=version)

    add(0, 2, 1)
    with pytest.raises(ab.CapacityError, match="tokens"):
        add(1, 40, 7)   # 2 x 320 bytes of tokens: more than the whole budget
    add(1, 2, 2)        # the retry, at the version it meant
    w.flush()
    assert sorted(store.sample(64)["policy_version"].unique().tolist()) == [1, 2] and len(store) == 4
