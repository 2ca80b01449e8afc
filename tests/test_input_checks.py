"""Bad input at the public entry points: a clear error before anything changes.

Each case was a real gap: accepted silently, failed half-way, or failed after the
store's generator (or its reuse counts) had already moved.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import arrowbuf as ab

from support.compare import assert_same_snapshot, snapshot
from support.episodes import make_episode


OBS = np.zeros((2, 3), np.float32)


def step(terminated, truncated, obs=OBS):
    return dict(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                terminated=np.asarray(terminated), truncated=np.asarray(truncated), next_obs=obs + 1)


def filled(seed: int = 0, **kwargs) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=200, seed=seed, **kwargs)
    for tag in range(4):
        store.add_episode(make_episode(tag, 5))
    return store


# -- episode-end flags ---------------------------------------------------------------


def test_writer_flags_of_shape_n_by_1_end_only_their_own_env():
    store = ab.ExperienceStore(capacity=100)
    # Told the mode: env 0's second step is taken as its reset step (a writer given no mode
    # refuses it, since it carries a reward: tests/test_autoreset.py).
    writer = store.writer(2, "next_step")
    assert writer.add(**step([[True], [False]], [[False], [False]])) == 1
    assert writer.add(**step([[False], [True]], [[False], [False]], OBS + 1)) == 1
    table = store.episodes()
    assert table["env_id"].to_pylist() == ["env-0", "env-1"]
    assert table["length"].to_pylist() == [1, 2]
    assert store.sample(4)["terminated"].shape == (4, 1)


def test_flags_with_more_than_one_value_a_step_are_refused_up_front():
    store = filled()
    before = snapshot(store)
    with pytest.raises(ab.SchemaError, match="'terminated'.*expected \\(\\) or \\(1,\\)"):
        ab.ExperienceStore(10).add_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3),
                                            "terminated": np.zeros((3, 2), bool)})
    with pytest.raises(ab.SchemaError, match="'truncated'"):
        ab.Schema({"action": ab.Field("int64"), "truncated": ab.Field("bool", (2,))})
    assert_same_snapshot(before, snapshot(store))


def test_writing_back_an_episode_that_the_write_evicts_keeps_its_return():
    store = ab.ExperienceStore(capacity=5)   # transitions: the write back (5) evicts the source (5)
    store.add_episode({"obs": np.zeros((4, 2)), "reward": np.ones(3), "terminated": np.zeros(3, bool)})
    source = store.add_episode({"obs": np.zeros((6, 2)), "reward": np.arange(1, 6.0),
                               "terminated": np.array([0, 0, 0, 0, 1], bool)})
    store.add_episode(store.episode(source))   # a view of the rows it overwrites
    table = store.episodes()
    assert table["return"].to_pylist() == [15.0]
    assert table["terminated"].to_pylist() == [True]


# -- the same_step writer's final_obs ---------------------------------------------------


@pytest.mark.parametrize("final_obs, match", [
    (np.zeros((1, 3), np.float32), "leading dim 1, expected 2"),
    (np.zeros((3, 3), np.float32), "leading dim 3, expected 2"),
    (np.zeros((2, 4), np.float32), "final_obs: field 'obs': per-step shape \\(4,\\)"),
    ({"x": np.zeros((2, 3), np.float32)}, "final_obs has fields \\['obs.x'\\]"),
])
def test_same_step_final_obs_of_the_wrong_shape_or_fields_is_refused(final_obs, match):
    store = ab.ExperienceStore(capacity=100)
    writer = store.writer(2, autoreset_mode="same_step")
    with pytest.raises(ab.SchemaError, match=match):
        writer.add(final_obs=final_obs, **step([True, False], [False, False]))
    assert store.schema is None and len(store) == 0   # nothing recorded, not even the schema


def test_same_step_object_final_obs_entries_are_checked_like_any_value():
    store = ab.ExperienceStore(capacity=100)
    writer = store.writer(2, autoreset_mode="same_step")
    final = np.empty(2, object)
    final[0] = np.float64(5.0)
    with pytest.raises(ab.SchemaError, match="final_obs\\[0\\].*per-step shape \\(\\)"):
        writer.add(final_obs=final, **step([True, False], [False, False]))
    final[0] = np.arange(3, dtype=np.float64)   # would lose precision as float32
    with pytest.raises(ab.SchemaError, match="final_obs\\[0\\].*dtype float64; expected float32"):
        writer.add(final_obs=final, **step([True, False], [False, False]))
    with pytest.raises(ab.SchemaError, match="one entry per env"):
        writer.add(final_obs=np.empty(3, object), **step([True, False], [False, False]))
    final[0] = np.arange(3, dtype=np.float32) + 7
    assert writer.add(final_obs=final, **step([True, False], [False, False])) == 1
    assert store.episode(0)["obs"].to_pylist()[-1] == [7.0, 8.0, 9.0]


# -- sampling arguments ----------------------------------------------------------------


@pytest.mark.parametrize("device", ["gpu", 3.5] + ([] if torch.cuda.is_available() else ["cuda", "cuda:0"]))
def test_a_bad_device_is_refused_before_the_draw(device):
    store, twin = filled(sampler=ab.WithoutReplacementSampler(), track_reuse=True), \
        filled(sampler=ab.WithoutReplacementSampler(), track_reuse=True)
    with pytest.raises(ValueError, match="device"):
        store.sample(4, device=device)
    with pytest.raises(ValueError, match="device"):
        store.iter_batches(4, device=device)
    # Nothing was drawn or counted: the store goes on exactly like its twin.
    assert store.sample(8)["index"].tolist() == twin.sample(8)["index"].tolist()
    assert store.stats()["reuse"] == twin.stats()["reuse"]


@pytest.mark.parametrize("kwargs, match", [
    ({"n_step": True}, "n_step"), ({"n_step": 1.0}, "n_step"), ({"frame_stack": True}, "frame_stack"),
    ({"timeout": float("nan")}, "timeout"), ({"timeout": -1}, "timeout"), ({"timeout": "x"}, "timeout"),
])
def test_sample_arguments_of_the_wrong_type_are_refused(kwargs, match):
    store, twin = filled(), filled()
    with pytest.raises(ValueError, match=match):
        store.sample(4, **kwargs)
    assert store.sample(8)["index"].tolist() == twin.sample(8)["index"].tolist()


def test_n_step_needs_a_scalar_reward():
    store = ab.ExperienceStore(capacity=50, schema={"obs": ab.Field("float64", (2,), True), "reward": ("float64", (2,))})
    store.add_episode({"obs": np.zeros((5, 2)), "reward": np.ones((4, 2))})
    with pytest.raises(ValueError, match="scalar 'reward'.*\\(2,\\)"):
        store.sample(4, n_step=2)


def test_timeout_is_checked_everywhere_and_inf_waits_without_limit():
    limiter = ab.SampleToInsertRatio(samples_per_insert=1.0, min_size=1, error_buffer=100.0)
    store = ab.ExperienceStore(capacity=200, rate_limiter=limiter)
    for bad in (float("nan"), -0.5, "1", True):
        with pytest.raises(ValueError, match="timeout"):
            store.add_episode(make_episode(0, 5), timeout=bad)
        with pytest.raises(ValueError, match="timeout"):
            store.writer(1, timeout=bad)
    assert len(store) == 0
    store.add_episode(make_episode(0, 5), timeout=math.inf)   # allowed at once: returns
    assert len(store) == 5


# -- priorities ---------------------------------------------------------------------------


def test_update_priorities_takes_bfloat16_and_refuses_complex_and_overflowing_values():
    store = filled(sampler=ab.PrioritizedSampler(alpha=1.0))
    index = store.sample(8)["index"]
    assert store.update_priorities(index, torch.full((8,), 2.0, dtype=torch.bfloat16)) == 8
    total = store.sampler.tree.total
    with pytest.raises(ValueError, match="real numbers"):
        store.update_priorities(index, np.full(8, 1 + 2j))
    with pytest.raises(ValueError, match="too large"):
        store.update_priorities(index, np.full(8, 1e308))
    assert store.sampler.tree.total == total
    assert np.isfinite(store.sample(16)["weight"].numpy()).all()


# -- ids, seeds, names ---------------------------------------------------------------------


def test_episode_ids_must_be_ints():
    store = filled()
    for bad in (True, None, "0", 1.0):
        with pytest.raises(ValueError, match="episode_id must be an int"):
            store.episode(bad)
    assert store.episode(np.int64(1)).num_rows == 6


def test_numpy_int_seed_and_rows_per_file_are_plain_ints(tmp_path):
    store = filled(seed=np.int64(7))
    assert type(store.seed) is int
    store.to_parquet(tmp_path / "export", rows_per_file=np.int64(6))
    assert ab.ExperienceStore.from_parquet(tmp_path / "export").num_episodes == 4


def test_a_single_string_is_not_a_list_of_env_ids():
    with pytest.raises(ValueError, match="env_ids"):
        ab.ExperienceStore(capacity=10).writer(3, env_ids="abc")


def test_zero_sized_field_dimensions_are_refused():
    with pytest.raises(ab.SchemaError, match="positive sizes"):
        ab.Field("float32", (0,))
    store = ab.ExperienceStore(capacity=10)
    with pytest.raises(ab.SchemaError, match="positive sizes"):
        store.add_episode({**make_episode(9, 5), "aux": np.zeros((5, 0), np.float32)})
    assert store.schema is None and len(store) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"delivery_latency": 0}, "RayOptions.delivery_latency must be a finite number > 0, got 0"),
    ({"seal_latency": float("inf")}, "RayOptions.seal_latency must be a finite number > 0, got inf"),
    ({"size_refresh": -1.0}, "RayOptions.size_refresh must be a number >= 0, got -1.0"),
    ({"max_in_flight": 0}, "RayOptions.max_in_flight must be an int >= 1, got 0"),
    ({"allow_partial": "yes"}, "RayOptions.allow_partial must be True or False, got .yes."),
    ({"nodes": "node-a"}, "RayOptions.nodes must be a list of node ids"),
])
def test_ray_options_name_the_bad_field_without_starting_ray(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ab.RayOptions(**kwargs)


def test_ray_arguments_and_methods_on_a_local_store_say_they_need_ray():
    with pytest.raises(ValueError, match="need backend='ray'"):
        ab.ExperienceStore(capacity=10, name="mine")
    with pytest.raises(ValueError, match="need backend='ray'"):
        ab.ExperienceStore(capacity=10, ray_options=ab.RayOptions())
    with pytest.raises(ValueError, match="ray_options must be an arrowbuf.RayOptions"):
        ab.ExperienceStore(capacity=10, backend="ray", ray_options={"num_cpus": 1})
    store = filled()
    with pytest.raises(ValueError, match="to_ray_dataset needs backend='ray'"):
        store.to_ray_dataset()
    assert (store.name, store.num_shards) == (None, 1)


# -- tensors on a device with no data ----------------------------------------------------


def test_a_tensor_on_an_unusable_device_raises_schema_error_naming_the_field_and_changes_nothing():
    # torch's "meta" device holds shapes only: copying one out raised NotImplementedError.
    store = filled(sampler=ab.PrioritizedSampler())
    before = snapshot(store)
    episode = {**make_episode(9, 5), "reward": torch.ones(5, device="meta")}
    with pytest.raises(ab.SchemaError, match=r"field 'reward': a tensor on device meta whose data cannot be copied"):
        store.add_episode(episode)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    with pytest.raises(ab.SchemaError, match=r"field 'obs': a tensor on device meta"):
        writer.add(**step([False, False], [False, False], obs=torch.zeros((2, 3), device="meta")))
    batch = store.sample(4)
    with pytest.raises(ab.SchemaError, match=r"priority: a tensor on device meta"):
        store.update_priorities(batch["index"], torch.ones(4, device="meta"))
    assert_same_snapshot(before, snapshot(store))
