"""A writer step's fast path (`arrowbuf.step_reading.StepReader`): numpy arrays and CPU tensors of
the fields' exact dtypes and shapes skip the general read and checks. It must take only what the
general path takes, give the same columns, and copy nothing."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.schema import Schema
from arrowbuf.step_reading import StepReader

ENVS = 3
DICT_OBS = Schema({"obs": {"pixels": ab.Field("bfloat16", (1, 2), True), "state": {"q": ab.Field("float32", (3,), True)}},
                   "action": ab.Field("int64", (2,)), "reward": ab.Field("float32"), "terminated": ab.Field("bool"),
                   "truncated": ab.Field("bool"), "log_prob": ab.Field("float32")})
ONE_OBS = Schema({"obs": ab.Field("float32", (4,), True), "action": ab.Field("float32", (2,)),
                  "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})
EXACT = ["numpy", "torch", "strided", "grad"]   # what the fast path takes
KINDS = EXACT + ["cast", "shape", "numpy shape", "list", "meta", "missing"]


class GeneralReader(StepReader):
    """The general path alone: the reference the fast path must agree with."""

    def _exact_step(self, *args):
        return None


def value(f: ab.Field, kind: str, rng: np.random.Generator):
    """One step of field ``f`` (leading dim ENVS), given as ``kind``."""
    shape = (ENVS, *f.shape)
    base = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * 100).to(f.torch_dtype)
    if kind == "numpy":
        return base.numpy() if f.dtype != "bfloat16" else base   # numpy has no bfloat16: a tensor then
    if kind == "torch":
        return base
    if kind == "strided":   # the same values in every other element of a larger tensor
        wide = torch.zeros((ENVS, *f.shape, 2), dtype=f.torch_dtype)
        wide[..., 0] = base
        return wide[..., 0]
    if kind == "grad":
        return base.requires_grad_() if base.is_floating_point() else base
    if kind == "cast":
        return base.to(torch.float64) if f.dtype != "float64" else base.to(torch.float32)
    if kind == "meta":   # a device whose data cannot be read (as a GPU's is only copied)
        return base.to("meta")
    if kind in ("shape", "numpy shape"):
        wrong = base.reshape(ENVS, -1)[:, :1] if base[0].numel() > 1 else base[:, None, None]
        return wrong.numpy() if kind == "numpy shape" and f.dtype != "bfloat16" else wrong
    return base.tolist()


@st.composite
def steps(draw, schema: Schema):
    """(obs, next_obs, step) close to ``schema``: each value of some kind (exact, strided, castable,
    wrong...), a field missing or added, a group given as an array."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    odd = draw(st.sampled_from([False, True]))
    flat = {}
    for name, f in schema.fields.items():
        kind = draw(st.sampled_from(KINDS if odd and draw(st.integers(0, 3)) == 0 else EXACT))
        if kind != "missing":
            flat[name] = value(f, kind, rng)
    if odd and draw(st.integers(0, 5)) == 0:
        flat["extra"] = np.zeros(ENVS, np.float32)

    def obs():
        fields = {n[4:]: v for n, v in flat.items() if n.startswith("obs.")}
        if "obs" in flat or not fields:
            return flat.get("obs")
        nested = ab.schema.unflatten(fields)
        if odd and draw(st.integers(0, 5)) == 0:
            nested["odd"] = np.zeros(ENVS, np.float32)
        return nested

    step = {n: v for n, v in flat.items() if n != "obs" and not n.startswith("obs.")}
    return obs(), obs(), step


def assert_agrees(schema: Schema, obs, next_obs, step) -> bool:
    """The fast path's columns, when it takes the step, are the general path's, views of the given memory."""
    exact = StepReader(ENVS, None, "next_step")._exact_step(schema, obs, next_obs, step)
    try:
        general = GeneralReader(ENVS, None, "next_step").read(schema, obs, next_obs, step)
    except (ab.SchemaError, TypeError):
        general = None
    if exact is None:
        return False
    assert general is not None, "the fast path took a step the general path refuses"
    assert exact[0] is general[0]
    for fast, slow, given in zip(exact[1:], general[1:], (obs, next_obs, step)):
        assert list(fast) == list(slow)
        for name, (array, dtype) in fast.items():
            assert dtype == slow[name][1]
            assert array.dtype == slow[name][0].dtype and array.shape == slow[name][0].shape
            np.testing.assert_array_equal(array, slow[name][0])
            source = given if name == "obs" else given[name] if given is step else ab.schema.flatten(given)[name[4:]]
            address = source.data_ptr() if isinstance(source, torch.Tensor) else source.__array_interface__["data"][0]
            assert array.__array_interface__["data"][0] == address, f"{name}: copied"
    return True


@pytest.mark.parametrize("schema", [DICT_OBS, ONE_OBS], ids=["dict-obs", "one-obs"])
@given(data=st.data())
@settings(max_examples=300, deadline=None)
def test_the_fast_path_takes_only_what_the_general_path_takes_and_gives_the_same_columns(schema, data):
    took = assert_agrees(schema, *data.draw(steps(schema)))
    data.draw(st.just(took), label="took the fast path")


@pytest.mark.parametrize("kind", ["numpy", "torch", "strided", "grad"])
@pytest.mark.parametrize("schema", [DICT_OBS, ONE_OBS], ids=["dict-obs", "one-obs"])
def test_exact_numpy_arrays_and_cpu_tensors_take_the_fast_path(schema, kind):
    rng = np.random.default_rng(0)
    flat = {name: value(f, kind, rng) for name, f in schema.fields.items()}
    obs = flat["obs"] if "obs" in flat else ab.schema.unflatten({n[4:]: v for n, v in flat.items() if "obs." in n})
    step = {n: v for n, v in flat.items() if n != "obs" and not n.startswith("obs.")}
    assert assert_agrees(schema, obs, obs, step)


def test_a_reader_that_read_steps_before_torch_was_imported_takes_tensors_on_the_fast_path_after(monkeypatch):
    # A process that writes numpy steps never imports torch (`arrowbuf._lazy_torch`): the fast path's
    # specs made then have no torch dtypes, and are made again once torch is there.
    rng = np.random.default_rng(0)
    flat = {name: value(f, "torch", rng) for name, f in ONE_OBS.fields.items()}
    arrays = {name: v.numpy() for name, v in flat.items()}
    reader = StepReader(ENVS, None, "next_step")
    with monkeypatch.context() as without:
        without.delitem(sys.modules, "torch")
        step = {n: v for n, v in arrays.items() if n != "obs"}
        assert reader._exact_step(ONE_OBS, arrays["obs"], arrays["obs"], step) is not None
    step = {n: v for n, v in flat.items() if n != "obs"}
    exact = reader._exact_step(ONE_OBS, flat["obs"], flat["obs"], step)
    assert exact is not None and exact[3]["action"][0].__array_interface__["data"][0] == flat["action"].data_ptr()


def test_a_writer_fed_tensors_stores_what_one_fed_numpy_stores():
    rng = np.random.default_rng(1)
    T = 6
    rollout = {name: torch.from_numpy(rng.standard_normal((T + 1, ENVS, *f.shape)).astype(np.float32) * 10).to(
        f.torch_dtype) for name, f in DICT_OBS.fields.items()}
    rollout["terminated"][2, 1] = True
    stores = []
    for kind in ("torch", "numpy"):
        store = ab.ExperienceStore(100, seed=0)
        writer = store.writer(num_envs=ENVS, autoreset_mode="same_step")

        def given(name, t):
            x = rollout[name][t]
            return x.numpy() if kind == "numpy" and x.dtype != torch.bfloat16 else x

        for t in range(T):
            obs = {"pixels": given("obs.pixels", t), "state": {"q": given("obs.state.q", t)}}
            nxt = {"pixels": given("obs.pixels", t + 1), "state": {"q": given("obs.state.q", t + 1)}}
            writer.add(obs=obs, next_obs=nxt, final_obs=nxt, action=given("action", t), reward=given("reward", t),
                       terminated=given("terminated", t), truncated=given("truncated", t),
                       log_prob=given("log_prob", t))
        writer.flush()
        stores.append(store)
    batches = [next(iter(s.iter_batches(len(s), shuffle=False))) for s in stores]
    assert len(stores[0]) == len(stores[1]) == T * ENVS
    for key in batches[0].keys(include_nested=True, leaves_only=True):
        assert torch.equal(batches[0][key], batches[1][key]), key


def test_steps_of_a_schema_with_text_and_ragged_fields_go_the_general_way():
    schema = Schema({"obs": ab.Field("float32", (2,), True), "instruction": ab.Field("string"),
                     "tokens": ab.Field("int64", (None,)), "action": ab.Field("int64"), "reward": ab.Field("float32"),
                     "terminated": ab.Field("bool"), "truncated": ab.Field("bool")})
    obs = torch.zeros(ENVS, 2)
    step = {"instruction": ["pick", "place", "push"], "tokens": [[1], [2, 3], []], "action": torch.zeros(ENVS, dtype=torch.int64),
            "reward": torch.zeros(ENVS), "terminated": torch.zeros(ENVS, dtype=torch.bool),
            "truncated": torch.zeros(ENVS, dtype=torch.bool)}
    assert not assert_agrees(schema, obs, obs, step)
    _, _, _, cols = StepReader(ENVS, None, "next_step").read(schema, obs, obs, step)
    assert list(cols["instruction"][0]) == ["pick", "place", "push"]
