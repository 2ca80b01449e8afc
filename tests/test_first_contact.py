"""First contact: what a new user's first writes get wrong is an error that names the fix."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.schema import looks_like_observation

T = 4


def flags() -> dict:
    return {"terminated": np.arange(T) == T - 1, "truncated": np.zeros(T, bool)}


def assert_untouched(store: ab.ExperienceStore) -> None:
    assert store.schema is None and len(store) == 0 and store.num_episodes == 0


# -- terminal flags -----------------------------------------------------------------------------


def test_an_inferred_episode_without_terminal_flags_is_refused_naming_both_fixes():
    store = ab.ExperienceStore(capacity=50, seed=0)
    with pytest.raises(ab.SchemaError, match="no 'terminated' field") as caught:
        store.add_episode({"obs": np.zeros((T + 1, 3), np.float32), "action": np.zeros(T, np.int64)})
    message = str(caught.value)
    assert "Add 'terminated' and 'truncated'" in message and "schema=" in message
    assert_untouched(store)


def test_the_declaration_in_the_error_is_code_that_stores_the_episode():
    episode = {"obs": {"pixels": np.zeros((T + 1, 2, 2), np.uint8)}, "action": np.zeros(T, np.int64),
               "reward": np.ones(T, np.float32)}
    with pytest.raises(ab.SchemaError) as caught:
        ab.ExperienceStore(capacity=50).add_episode(episode)
    declaration = re.search(r"ExperienceStore\(\.\.\., (schema=.*)\)$", str(caught.value)).group(1)
    store = eval(f"ab.ExperienceStore(capacity=50, seed=0, {declaration})", {"ab": ab})
    store.add_episode(episode)
    assert store.schema.observation_names == ("obs.pixels",) and len(store) == T


def test_an_explicit_schema_declares_data_without_terminal_flags():
    schema = {"obs": ab.Field("float32", (3,), observation=True), "action": "int64"}
    store = ab.ExperienceStore(capacity=50, seed=0, schema=schema)
    store.add_episode({"obs": np.zeros((T + 1, 3), np.float32), "action": np.zeros(T, np.int64)})
    batch = store.sample(8)
    assert "terminated" not in batch.keys() and len(store) == T


def test_terminated_alone_is_enough():
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode({"obs": np.zeros(T + 1), "action": np.zeros(T), "terminated": np.arange(T) == T - 1})
    assert store.episodes().column("terminated").to_pylist() == [True]


@pytest.mark.parametrize("legacy", ["done", "dones", "terminals"])
def test_a_legacy_done_field_is_refused_naming_terminated_and_truncated(legacy):
    store = ab.ExperienceStore(capacity=50, seed=0)
    with pytest.raises(ab.SchemaError, match=rf"field '{legacy}' is a legacy episode-end flag.*Rename '{legacy}' to "
                                             r"'terminated'.*add 'truncated'"):
        store.add_episode({"obs": np.zeros(T + 1), "action": np.zeros(T), legacy: np.arange(T) == T - 1})
    assert_untouched(store)


def test_a_legacy_done_field_is_refused_in_an_explicit_schema_too():
    with pytest.raises(ab.SchemaError, match="'done' is a legacy episode-end flag"):
        ab.Schema({"obs": ab.Field("float32", (), True), "action": "int64", "done": "bool"})


def test_a_done_field_beside_terminated_is_an_ordinary_field():
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode({"obs": np.zeros(T + 1), "action": np.zeros(T), "done": np.zeros(T, bool), **flags()})
    assert "done" in store.schema.fields


# -- observations -------------------------------------------------------------------------------


def test_an_action_with_one_row_too_many_is_refused_not_taken_as_an_observation():
    store = ab.ExperienceStore(capacity=50, seed=0)
    with pytest.raises(ab.SchemaError) as caught:
        store.add_episode({"obs": np.zeros((T + 1, 3), np.float32), "action": np.zeros(T + 1, np.int64),
                           "reward": np.zeros(T, np.float32), **flags()})
    message = str(caught.value)
    assert message.startswith(f"field 'action' has {T + 1} rows, one more than the step fields (T = {T})")
    assert f"give it {T} rows" in message and "'action': ab.Field('int64', observation=True)" in message
    assert_untouched(store)


@pytest.mark.parametrize("name", ["obs", "observation", "pixels", "agent_obs", "obs_goal", "rgb", "state",
                                  "pixel_values", "critic_obs", "image_wrist"])
def test_observation_names_are_inferred_from_their_extra_row(name):
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode({name: np.zeros((T + 1, 2), np.float32), "action": np.zeros(T, np.int64), **flags()})
    assert store.schema.observation_names == (name,) and len(store) == T


def test_nested_observations_are_inferred_by_their_group_name():
    store = ab.ExperienceStore(capacity=50, seed=0)
    store.add_episode({"obs": {"joints": np.zeros((T + 1, 3)), "goal": np.zeros((T + 1, 2))},
                       "action": np.zeros(T), **flags()})
    assert store.schema.observation_names == ("obs.joints", "obs.goal")


def test_an_explicit_observation_field_with_any_name_is_accepted():
    schema = {"x": ab.Field("float32", (2,), observation=True), "action": "int64", "terminated": "bool"}
    store = ab.ExperienceStore(capacity=50, seed=0, schema=schema)
    store.add_episode({"x": np.zeros((T + 1, 2), np.float32), "action": np.zeros(T, np.int64),
                       "terminated": np.zeros(T, bool)})
    assert len(store) == T


def test_a_step_writer_declares_its_observations_by_next_obs_whatever_their_names():
    store = ab.ExperienceStore(capacity=50, seed=0)
    writer = store.writer(num_envs=2)
    writer.add(obs={"x": np.zeros((2, 3))}, action=np.zeros(2), reward=np.zeros(2), terminated=np.ones(2, bool),
               truncated=np.zeros(2, bool), next_obs={"x": np.ones((2, 3))})
    assert store.schema.observation_names == ("obs.x",) and store.num_episodes == 2


@settings(max_examples=200, deadline=None)
@given(name=st.text(alphabet="abcdeiorsvtx_.", min_size=1, max_size=12))
def test_inference_takes_a_t_plus_1_field_as_an_observation_only_if_its_name_says_so(name):
    parts = name.split(".")
    if any(not p for p in parts) or parts[0] in ab.schema.RESERVED_NAMES or parts[0] in {"action", "terminated"}:
        return
    nested: dict = {}
    node = nested
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = np.zeros(T + 1)
    store = ab.ExperienceStore(capacity=50, seed=0)
    try:
        store.add_episode({**nested, "action": np.zeros(T), "terminated": np.zeros(T, bool)})
    except ab.SchemaError as err:
        assert not looks_like_observation(name) and f"field {name!r} has {T + 1} rows" in str(err)
        assert_untouched(store)
        return
    assert looks_like_observation(name) and store.schema.observation_names == (name,)
