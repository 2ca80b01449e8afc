"""GAE over ragged episodes matches a per-step loop; the store computes it over its episodes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.advantages import gae


def loop_gae(reward, value, last_value, lengths, gamma, lam):
    """The textbook recursion, one step at a time."""
    advantage, start = np.zeros(len(reward)), 0
    for length, last in zip(lengths, last_value):
        carry = 0.0
        for t in reversed(range(length)):
            following = value[start + t + 1] if t < length - 1 else last
            carry = reward[start + t] + gamma * following - value[start + t] + gamma * lam * carry
            advantage[start + t] = carry
        start += length
    return advantage


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=8), seed=st.integers(0, 2**31),
       gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_gae_matches_the_per_step_loop_on_ragged_episodes(lengths, seed, gamma, lam):
    rng = np.random.default_rng(seed)
    n = sum(lengths)
    reward, value, last = rng.normal(size=n), rng.normal(size=n), rng.normal(size=len(lengths))
    advantage, target = gae(reward, value, last, np.array(lengths), gamma, lam)
    np.testing.assert_allclose(advantage, loop_gae(reward, value, last, lengths, gamma, lam), atol=1e-9)
    np.testing.assert_allclose(target, advantage + value)


@settings(max_examples=100, deadline=None)
@given(segments=st.integers(1, 8), length=st.integers(1, 12), seed=st.integers(0, 2**31),
       gamma=st.floats(0, 1), lam=st.floats(0, 1))
def test_gae_matches_the_per_step_loop_on_equal_episodes(segments, length, seed, gamma, lam):
    # Equal lengths (a rollout of envs x steps) take a path of their own.
    rng = np.random.default_rng(seed)
    lengths = [length] * segments
    reward, value, last = rng.normal(size=segments * length), rng.normal(size=segments * length), rng.normal(size=segments)
    advantage, _ = gae(reward, value, last, np.array(lengths), gamma, lam)
    np.testing.assert_allclose(advantage, loop_gae(reward, value, last, lengths, gamma, lam), atol=1e-9)


def add(store, steps, *, terminated, final=True, value_of=lambda t: t * 0.1, reward=1.0):
    obs_rows = steps + 1 if final else steps
    return store.add_episode({
        "obs": np.arange(obs_rows, dtype=np.float32)[:, None].repeat(2, 1),
        "action": np.zeros(steps, np.int64),
        "reward": np.full(steps, reward, np.float32),
        "value": np.array([value_of(t) for t in range(steps)], np.float32),
        "terminated": np.arange(steps) == steps - 1 if terminated else np.zeros(steps, bool),
        "truncated": np.zeros(steps, bool) if terminated else np.arange(steps) == steps - 1,
    })


def test_compute_gae_bootstraps_cut_episodes_from_their_final_observation_and_not_terminated_ones():
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=True)
    add(store, 4, terminated=False)
    seen = []

    def bootstrap(final_obs):
        seen.append(final_obs["obs"].clone())
        return final_obs["obs"][:, 0] * 10.0   # final obs of the cut episode is [4, 4] -> 40

    store.compute_gae(gamma=0.9, lam=0.8, bootstrap_value=bootstrap)
    assert len(seen) == 1 and seen[0].tolist() == [[4.0, 4.0]]
    rows = store.to_arrow()
    values = [0.0, 0.1, 0.2, 0.0, 0.1, 0.2, 0.3]
    expected = loop_gae(np.ones(7), np.array(values), [0.0, 40.0], [3, 4], 0.9, 0.8)
    transitions = ~rows.column("is_last").to_numpy(zero_copy_only=False)
    advantage = rows.column("advantage").to_numpy()[transitions]
    np.testing.assert_allclose(advantage, expected, rtol=1e-6)
    np.testing.assert_allclose(rows.column("value_target").to_numpy()[transitions],
                               expected + np.array(values), rtol=1e-6)
    batch = store.sample(16)
    assert {"advantage", "value_target"} <= set(batch.keys())


SCHEMA = ab.Schema({"obs": ab.Field("float32", (2,), observation=True), "action": ab.Field("int64"),
                    "reward": ab.Field("float32"),
                    "value": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})


@pytest.mark.parametrize("lengths", [[4, 4, 4, 4], [4, 6, 4, 3]])
def test_the_bootstrap_callable_gets_each_cut_episodes_final_observation_as_views_when_evenly_spaced(lengths):
    store = ab.ExperienceStore(100, seed=0)
    for steps in lengths:
        add(store, steps, terminated=False)
    seen = []

    def bootstrap(final_obs):
        seen.append((final_obs["obs"].clone(), np.shares_memory(final_obs["obs"].numpy(), store.engine.shard.arena["obs"])))
        return final_obs["obs"][:, 0]

    store.compute_gae(gamma=0.9, lam=0.8, bootstrap_value=bootstrap)
    (final, shared), = seen
    assert final.tolist() == [[float(steps)] * 2 for steps in lengths]   # each episode's obs row `steps`
    # Equal lengths lie evenly spaced in the arena (a rollout): views, no gather; otherwise copies.
    assert shared == (len(set(lengths)) == 1)
    advantage = store.sample(64, keys=["advantage"])
    expected = loop_gae(np.ones(sum(lengths)), np.concatenate([np.arange(n) * 0.1 for n in lengths]),
                        [float(n) for n in lengths], lengths, 0.9, 0.8)
    starts = np.cumsum(lengths) - lengths
    got = advantage["advantage"].numpy()
    want = expected[starts[advantage["episode_id"].numpy()] + advantage["step"].numpy()]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_an_episode_without_its_final_observation_bootstraps_from_its_last_stored_value():
    store = ab.ExperienceStore(100, seed=0, schema=SCHEMA)
    add(store, 4, terminated=False, final=False)   # 3 transitions; step 3's value closes the last one
    store.compute_gae(gamma=0.5, lam=1.0)           # no callable needed: nothing was cut after a final obs
    episode = store.episode(0)
    expected = loop_gae(np.ones(3), np.array([0.0, 0.1, 0.2]), [0.3], [3], 0.5, 1.0)
    np.testing.assert_allclose(episode.column("advantage").to_numpy()[:3], expected, rtol=1e-6)


def test_cut_episodes_without_a_bootstrap_callable_raise_and_change_nothing():
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=False)
    with pytest.raises(ValueError, match="1 episode.*bootstrap_value"):
        store.compute_gae(gamma=0.99, lam=0.95)
    assert "advantage" not in store.schema.fields


def test_values_given_by_episode_id_bootstrap_those_episodes_and_a_missing_one_is_refused():
    # A Ray store's second step: the values of the final observations come by episode id.
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=False)
    add(store, 4, terminated=False)
    ids, final_obs = store.engine.final_observations("value")
    assert ids.tolist() == [0, 1] and final_obs["obs"][:, 1].tolist() == [3.0, 4.0]
    with pytest.raises(ValueError, match=r"episodes \[1\] were cut .* stored while compute_gae ran"):
        store.engine.compute_gae(0.9, 0.8, "value", None, (np.array([0]), np.array([5.0])))
    assert "advantage" not in store.schema.fields
    store.engine.compute_gae(0.9, 0.8, "value", None, (ids[::-1].copy(), np.array([40.0, 30.0])))
    reference = ab.ExperienceStore(100, seed=0)
    add(reference, 3, terminated=False)
    add(reference, 4, terminated=False)
    reference.compute_gae(0.9, 0.8, bootstrap_value=lambda obs: obs["obs"][:, 1] * 10.0)
    np.testing.assert_allclose(store.to_arrow().column("advantage").to_numpy(),
                               reference.to_arrow().column("advantage").to_numpy(), rtol=1e-6)


def test_episodes_written_after_compute_gae_get_zeros_until_the_next_call():
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=True)
    store.compute_gae(gamma=0.99, lam=0.95)
    add(store, 2, terminated=True, reward=5.0)     # written without the derived columns
    w = store.writer(num_envs=1)
    w.add(obs=np.zeros((1, 2), np.float32), action=np.zeros(1, np.int64), reward=np.ones(1, np.float32), value=np.zeros(1, np.float32),
          terminated=np.ones(1, bool), truncated=np.zeros(1, bool), next_obs=np.ones((1, 2), np.float32))
    assert store.num_episodes == 3
    assert store.episode(1).column("advantage").to_numpy().tolist() == [0.0, 0.0, 0.0]
    store.compute_gae(gamma=1.0, lam=1.0)
    assert store.episode(1).column("advantage").to_numpy()[:2].tolist() == pytest.approx([10.0, 4.9])
    assert store.episode(2).column("advantage").to_numpy().tolist()[:1] == [1.0]


def test_derived_columns_survive_a_parquet_round_trip_and_a_checkpoint(tmp_path):
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=True)
    store.compute_gae(gamma=0.9, lam=0.9)
    before = store.episode(0).column("advantage").to_numpy()
    store.to_parquet(tmp_path / "out")
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    np.testing.assert_array_equal(loaded.episode(0).column("advantage").to_numpy(), before)
    assert loaded.schema.fields["advantage"].derived
    store.save(tmp_path / "ckpt")
    restored = ab.ExperienceStore.load(tmp_path / "ckpt")
    np.testing.assert_array_equal(restored.episode(0).column("advantage").to_numpy(), before)
    add(restored, 2, terminated=True)               # writes keep working without the derived columns
    # Reloaded, the derived columns are small step fields of the schema, packed with the others
    # (`arrowbuf.packing`): the next compute_gae writes them there, and samples read them back.
    assert "advantage" in restored.engine.shard._pack_offsets
    restored.compute_gae(gamma=0.9, lam=0.9)
    np.testing.assert_array_equal(restored.episode(0).column("advantage").to_numpy(), before)
    batch = restored.sample(50, keys=["advantage"])
    by_episode = {e: restored.episode(e).column("advantage").to_numpy() for e in (0, 1)}
    for e, t, a in zip(batch["episode_id"].tolist(), batch["step"].tolist(), batch["advantage"].tolist()):
        assert a == pytest.approx(by_episode[e][t])


def test_compute_gae_checks_its_arguments_first():
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=True)
    for kwargs, match in [({"gamma": 1.5}, "gamma"), ({"lam": -0.1}, "lam"), ({"value_key": "nope"}, "nope"),
                          ({"bootstrap_value": 3}, "bootstrap_value")]:
        with pytest.raises(ValueError, match=match):
            store.compute_gae(**{"gamma": 0.9, "lam": 0.9, **kwargs})
    assert "advantage" not in store.schema.fields


def test_a_bootstrap_callable_returning_the_wrong_shape_is_named():
    store = ab.ExperienceStore(100, seed=0)
    add(store, 3, terminated=False)
    with pytest.raises(ValueError, match=r"bootstrap_value returned .*\(5,\).*expected 1"):
        store.compute_gae(gamma=0.9, lam=0.9, bootstrap_value=lambda obs: torch.zeros(5))
    assert "advantage" not in store.schema.fields


ENDINGS = ("terminated", "truncated", "cut", "no_final")   # cut: neither flag, a final observation (flush)


@settings(max_examples=60, deadline=None)
@given(episodes=st.lists(st.tuples(st.integers(2, 9), st.sampled_from(ENDINGS)), min_size=1, max_size=12),
       capacity=st.integers(12, 60), span_factor=st.sampled_from([0, 2, 10**9]),
       storage_device=st.sampled_from([None, "cpu"]), seed=st.integers(0, 2**31))
def test_compute_gae_matches_the_loop_on_every_live_episode_after_evictions(episodes, capacity, span_factor,
                                                                          storage_device, seed):
    # span_factor: 0 reads and writes by row lists, 10**9 always by slices of the arena
    # (final observations and free rows between the episodes), 2 as shipped.
    from unittest import mock

    from arrowbuf import advantages
    rng = np.random.default_rng(seed)
    store = ab.ExperienceStore(capacity, seed=0, schema=SCHEMA, storage_device=storage_device)
    written = {}
    for steps, ending in episodes:
        final = ending != "no_final"
        reward, value = rng.normal(size=steps).astype(np.float32), rng.normal(size=steps).astype(np.float32)
        obs = rng.normal(size=(steps + final, 2)).astype(np.float32)
        flags = np.arange(steps) == steps - 1
        episode_id = store.add_episode({"obs": obs, "action": np.zeros(steps, np.int64), "reward": reward,
                                        "value": value, "terminated": flags & (ending == "terminated"),
                                        "truncated": flags & (ending == "truncated")})
        transitions = steps if final else steps - 1
        # After the last transition: 0 (terminated), the final observation's value (cut after
        # it), or the value of the last stored step (no final observation).
        last = {"terminated": 0.0, "no_final": float(value[-1])}.get(ending, float(obs[-1, 0] * 2 + obs[-1, 1]))
        written[episode_id] = loop_gae(reward[:transitions].astype(np.float64), value[:transitions].astype(np.float64),
                                       [last], [transitions], 0.9, 0.8)
    with mock.patch.object(advantages, "SPAN_FACTOR", span_factor):
        total = store.compute_gae(0.9, 0.8, bootstrap_value=lambda o: o["obs"][:, 0].double() * 2 + o["obs"][:, 1])
    table = store.episodes()
    live = table.column("episode_id").to_pylist()
    # The oldest episode may have lost its first transitions (capacity counts transitions): GAE
    # runs backwards, so its held steps keep the advantages the whole episode gives them.
    held_from = dict(zip(live, table.column("first_step").to_pylist() if "first_step" in table.column_names
                         else [0] * len(live)))
    event("episodes evicted" if len(live) < len(episodes) else "nothing evicted")   # --hypothesis-show-statistics
    assert total == sum(len(written[e]) - held_from[e] for e in live)
    for episode_id in live:
        expected, rows = written[episode_id][held_from[episode_id]:], store.episode(episode_id)
        advantage, target = (rows.column(name).to_numpy() for name in ("advantage", "value_target"))
        np.testing.assert_allclose(advantage[:len(expected)], expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(target[:len(expected)], expected + rows.column("value").to_numpy()[:len(expected)],
                                   rtol=1e-5, atol=1e-5)
        # The row after the transitions (final observation, or last stored step) is not one.
        assert advantage[len(expected):].tolist() == target[len(expected):].tolist() == [0.0] * (len(rows) - len(expected))


@pytest.mark.parametrize("stale", [np.array([0x7FA00000], np.uint32).view(np.float32)[0], np.inf, np.nan],
                         ids=["signalling-nan", "inf", "nan"])
def test_stale_rows_of_a_cleared_store_never_warn_nor_change_a_rollouts_advantages(stale):
    """A cleared store keeps its old rows where no episode lies now; compute_gae reads past them in
    the arena and must neither warn (a signalling NaN's cast did: an error under -W error) nor use them."""
    def rollout(store):
        writer = store.writer(num_envs=2, autoreset_mode="next_step")
        for t in range(6):
            writer.add(obs=np.full((2, 2), t, np.float32), action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                       value=np.full(2, 0.5 * t, np.float32), terminated=np.array([t == 2, False]),
                       truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1, np.float32))
        writer.flush()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            store.compute_gae(0.9, 0.8, bootstrap_value=lambda final: torch.full((len(final),), 2.0))
        batch = next(iter(store.iter_batches(len(store), shuffle=False)))
        return {key: batch[key].numpy() for key in ("advantage", "value_target", "obs")}

    used = ab.ExperienceStore(64, seed=0)
    T = 10
    with warnings.catch_warnings():   # summing a signalling NaN's return warns: what was written then
        warnings.simplefilter("ignore")
        used.add_episodes({"obs": np.zeros((2, T + 1, 2), np.float32), "action": np.zeros((2, T), np.int64),
                           "reward": np.full((2, T), stale, np.float32), "value": np.full((2, T), stale, np.float32),
                           "terminated": np.zeros((2, T), bool), "truncated": np.ones((2, T), bool)})
    used.clear()
    fresh = rollout(ab.ExperienceStore(64, seed=0))
    after = rollout(used)
    for key in fresh:
        np.testing.assert_array_equal(after[key], fresh[key])
