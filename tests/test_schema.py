"""Field specs, the Arrow mapping, nested names, inference and the checks every write goes through."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.fields import as_array, check_column, dtype_fits
from arrowbuf.episode_batch import read_episodes
from arrowbuf.schema import Schema, flatten, unflatten

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bfloat16"]


@pytest.mark.parametrize("given_dtype, name", [
    (np.float32, "float32"), (np.dtype("int16"), "int16"), ("uint8", "uint8"), (bool, "bool"),
    (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.int64, "int64"), ("bfloat16", "bfloat16"),
])
def test_field_names_numpy_torch_and_string_dtypes(given_dtype, name):
    assert ab.Field(given_dtype).dtype == name


@pytest.mark.parametrize("bad", ["complex64", np.complex128, torch.complex64, "str", object])
def test_an_unsupported_dtype_is_a_schema_error_naming_it(bad):
    with pytest.raises(ab.SchemaError, match="unsupported dtype"):
        ab.Field(bad)


def test_a_negative_or_non_integer_shape_is_a_schema_error():
    with pytest.raises(ab.SchemaError, match="positive sizes"):
        ab.Field("float32", (2, -1))
    with pytest.raises(ab.SchemaError, match="tuple of ints"):
        ab.Field("float32", ("a",))


def test_scalars_are_arrow_primitives_and_shapes_are_fixed_shape_tensors():
    schema = Schema({"obs": ab.Field("float32", (2, 3), True), "action": ab.Field("int64"),
                     "flag": ab.Field("bool")})
    arrow = schema.to_arrow()
    assert arrow.field("obs").type == pa.fixed_shape_tensor(pa.float32(), [2, 3])
    assert arrow.field("action").type == pa.int64()
    assert arrow.field("flag").type == pa.bool_()
    assert arrow.field("obs").metadata[b"arrowbuf.role"] == b"observation"
    assert arrow.field("action").metadata[b"arrowbuf.role"] == b"step"
    assert arrow.names[-4:] == ["episode_id", "step", "is_first", "is_last"]
    assert schema.to_arrow(system=False).names == ["obs", "action", "flag"]


def test_bfloat16_is_stored_as_uint16_with_field_metadata():
    field = Schema({"x": ab.Field("bfloat16", (4,)), "y": ab.Field("bfloat16")}).to_arrow()
    assert field.field("x").type == pa.fixed_shape_tensor(pa.uint16(), [4])
    assert field.field("y").type == pa.uint16()
    assert field.field("y").metadata[b"arrowbuf.dtype"] == b"bfloat16"
    assert ab.Field("bfloat16").numpy_dtype == np.uint16
    assert ab.Field("bfloat16").torch_dtype == torch.bfloat16


def test_row_bytes_count_every_field_and_the_system_columns():
    schema = Schema({"obs": ab.Field("float32", (4,), True), "action": ab.Field("int64")})
    assert schema.row_bytes == 16 + 8 + (8 + 4 + 1 + 1)


def test_nested_fields_flatten_to_dotted_names_in_order():
    schema = Schema({"obs": {"pixels": ab.Field("uint8", (2, 2), True), "state": ab.Field("float32", (3,), True)},
                     "action": "int64"})
    assert schema.names == ("obs.pixels", "obs.state", "action")
    assert schema.observation_names == ("obs.pixels", "obs.state")


FLAT_SCHEMA = Schema({f"f_{d}_{len(shape)}d": ab.Field(d, shape, obs) for d in DTYPES
                      for shape, obs in [((), False), ((2, 3), True)]})
@st.composite
def near_exact_batches(draw):
    """[E, T, ...] batches close to EXACT_SCHEMA (`add_episodes`' stacked form): a field maybe dropped,
    of another dtype, per-step shape, length or episode count, or a list."""
    count, steps = draw(st.integers(0, 3)), draw(st.integers(0, 4))
    final, odd = draw(st.booleans()), draw(st.sampled_from([False, False, True]))
    data = {}
    for name, f in EXACT_SCHEMA.fields.items():
        if odd and draw(st.integers(0, 9)) == 0:
            continue
        rows = steps + (final if f.observation else 0) + (draw(st.sampled_from([0] * 6 + [-1, 1])) if odd else 0)
        episodes = count + (draw(st.sampled_from([0] * 6 + [-1, 1])) if odd else 0)
        shape = f.shape if not odd or draw(st.integers(0, 7)) else f.shape + (1,)
        dtype = draw(st.sampled_from([f.dtype] * 6 + ["int32", "float64", "bool"])) if odd else f.dtype
        data[name] = np.zeros((max(episodes, 0), max(rows, 0), *shape), dtype)
    if odd and draw(st.integers(0, 9)) == 0:
        data["action"] = data.get("action", np.zeros((count, steps), np.int64)).tolist()
    return data


@given(near_exact_batches())
@settings(max_examples=200, deadline=None)
def test_the_exact_fast_path_of_a_stacked_batch_reads_what_the_general_read_reads(data):
    """`read_episodes` through `Schema.read_exact(..., stacked=True)` gives the episodes the general
    read gives (views of the given arrays), and declines whatever that read refuses or casts."""
    def read(fast: bool):
        try:
            with pytest.MonkeyPatch.context() as patch:
                if not fast:
                    patch.setattr(Schema, "read_exact", lambda self, data, stacked=False: None)
                return read_episodes(data, EXACT_SCHEMA)[0]
        except (ab.SchemaError, ValueError) as err:
            return type(err)

    fast, general = read(True), read(False)
    took = EXACT_SCHEMA.read_exact(data, stacked=True) is not None
    if isinstance(general, type):
        assert not took and fast is general
        return
    assert len(fast) == len(general)
    for a, b in zip(fast, general):
        assert (a.num_steps, a.has_final, a.env_id, a.metadata) == (b.num_steps, b.has_final, b.env_id, b.metadata)
        assert list(a.columns) == list(b.columns)
        for name, column in a.columns.items():
            assert column.dtype == b.columns[name].dtype and column.shape == b.columns[name].shape
            np.testing.assert_array_equal(column, b.columns[name])
            assert not took or np.shares_memory(column, data[name])   # views, no copy


NESTED_SCHEMA = Schema({"obs": {"pixels": ab.Field("uint8", (2, 2), True), "state": ab.Field("bfloat16", (3,), True)},
                        "action": ab.Field("int64"), "policy": {"log_prob": ab.Field("float32")}})


APART_SCHEMA = Schema({"tokens": ab.Field("int32", (None,), max_bytes=4000), "pairs": ab.Field("int16", (None, 2)),
                       "task": ab.Field("string"), "adv": ab.Field("float32", derived=True),
                       "cam": ab.Field("uint8", (8, 8, 3), True, codec="png", max_bytes=1 << 20),
                       "obs": ab.Field("float32", (3,), observation=True)})


@pytest.mark.parametrize("schema", [FLAT_SCHEMA, NESTED_SCHEMA, APART_SCHEMA], ids=["flat", "nested", "apart"])
def test_arrow_schema_round_trips(schema):
    assert Schema.from_arrow(schema.to_arrow()) == schema
    assert Schema.from_arrow(schema.to_arrow(system=False)) == schema


@pytest.mark.parametrize("schema", [FLAT_SCHEMA, NESTED_SCHEMA, APART_SCHEMA], ids=["flat", "nested", "apart"])
def test_json_schema_round_trips(schema):
    assert Schema.from_json(schema.to_json()) == schema


names = st.text(alphabet="abcxyz_", min_size=1, max_size=5).filter(lambda n: n not in ab.schema.RESERVED_NAMES)
fields = st.builds(ab.Field, st.sampled_from(DTYPES), st.lists(st.integers(1, 3), max_size=3).map(tuple),
                   st.booleans())


@settings(max_examples=60, deadline=None)
@given(spec=st.dictionaries(names, st.one_of(fields, st.dictionaries(names, fields, min_size=1, max_size=3)),
                            min_size=1, max_size=5))
def test_any_schema_round_trips_through_arrow(spec):
    try:
        schema = Schema({**spec, "action": ab.Field("int64")})
    except ab.SchemaError:
        return  # e.g. a user field named "action" nested elsewhere: rejected up front
    assert Schema.from_arrow(schema.to_arrow()) == schema


def test_reserved_names_are_refused_with_the_name():
    for name in ("episode_id", "step", "index", "next", "weight", "mask", "is_first", "is_last"):
        with pytest.raises(ab.SchemaError, match=f"'{name}'"):
            Schema({name: "float32", "action": "int64"})
    with pytest.raises(ab.SchemaError, match="'next.obs'"):
        Schema({"next": {"obs": "float32"}, "action": "int64"})


def test_a_schema_needs_a_field_and_a_step_field():
    with pytest.raises(ab.SchemaError, match="at least one field"):
        Schema({})
    with pytest.raises(ab.SchemaError, match="every field is an observation"):
        Schema({"obs": ab.Field("float32", (2,), True)})


@pytest.mark.parametrize("key", ["", "a.b", 3])
def test_field_names_must_be_plain_non_empty_strings(key):
    with pytest.raises(ab.SchemaError, match="non-empty strings without '.'"):
        flatten({key: 1})


def test_infer_takes_fields_with_one_more_row_as_observations():
    columns = {"obs": (np.zeros((6, 2), np.float32), "float32"), "action": (np.zeros(5, np.int64), "int64"),
               "terminated": (np.zeros(5, bool), "bool")}
    schema = Schema.infer(columns)
    assert schema.fields["obs"] == ab.Field("float32", (2,), True)
    assert schema.fields["action"] == ab.Field("int64", (), False)


def test_infer_refuses_ragged_columns_and_scalars():
    with pytest.raises(ab.SchemaError, match="ragged"):
        Schema.infer({"obs": (np.zeros(8), "float64"), "action": (np.zeros(5), "float64")})
    with pytest.raises(ab.SchemaError, match="'action' is a scalar"):
        Schema.infer({"obs": (np.zeros(3), "float64"), "action": (np.zeros(()), "float64")})


def test_check_returns_the_steps_and_whether_the_final_observation_is_there():
    schema = Schema({"obs": ab.Field("float32", (2,), True), "action": ab.Field("int64")})
    with_final = {"obs": as_array(np.zeros((4, 2), np.float32), "obs"), "action": as_array(np.zeros(3, np.int64), "a")}
    without = {"obs": as_array(np.zeros((3, 2), np.float32), "obs"), "action": as_array(np.zeros(3, np.int64), "a")}
    assert schema.check(with_final) == (3, True)
    assert schema.check(without) == (3, False)


EXACT_SCHEMA = Schema({"obs": ab.Field("float32", (2,), True), "rgb": ab.Field("uint8", (1, 2), True),
                       "action": ab.Field("int64"), "reward": ab.Field("float32")})


@st.composite
def near_exact_episodes(draw):
    """Dicts close to EXACT_SCHEMA: each field maybe dropped, given another dtype, shape or length."""
    steps = draw(st.integers(0, 4))
    data = {}
    for name, f in EXACT_SCHEMA.fields.items():
        if draw(st.integers(0, 9)) == 0:
            continue
        rows = steps + (draw(st.sampled_from([0, 1])) if f.observation else 0) + draw(st.sampled_from([0] * 6 + [-1, 1]))
        shape = f.shape if draw(st.integers(0, 7)) else f.shape + (1,)
        dtype = draw(st.sampled_from([f.dtype] * 6 + ["int32", "float64", "bool"]))
        data[name] = np.zeros((max(rows, 0), *shape), dtype)
    if draw(st.integers(0, 9)) == 0:
        data["extra"] = np.zeros(steps, np.float32)
    if draw(st.integers(0, 9)) == 0 and "reward" in data:
        data["reward"] = torch.from_numpy(data["reward"])
    return data


@given(near_exact_episodes())
@settings(max_examples=300, deadline=None)
def test_the_exact_fast_path_accepts_only_what_the_general_check_accepts_and_agrees_on_it(data):
    assert_fast_path_agrees(EXACT_SCHEMA, data)


def assert_fast_path_agrees(schema: Schema, data: dict) -> None:
    """`Schema.read_exact` takes ``data`` only where the general read and check accept it, with
    the same answer and no copy; what it declines goes the general way: refused, or accepted after a cast."""
    exact = schema.read_exact(data)
    flat = flatten(data)
    try:
        general = schema.check({name: as_array(value, name) for name, value in flat.items()})
    except ab.SchemaError:
        general = None
    if exact is not None:
        columns, num_steps, has_final = exact
        assert general == (num_steps, has_final)
        assert list(columns) == list(schema.fields)
        assert all(columns[name] is flat[name] for name in columns)   # no copy
    else:
        assert general is None or any(type(v) is not np.ndarray or v.dtype != schema.fields[k].numpy_dtype
                                      for k, v in flat.items())


NESTED_SCHEMA = Schema({"observation": {"obs": ab.Field("float32", (3,), True), "critic": ab.Field("float32", (2,), True)},
                        "action": ab.Field("int64"), "reward": ab.Field("float32"), "terminated": ab.Field("bool")})


@st.composite
def near_exact_nested_episodes(draw):
    """Nested dicts close to NESTED_SCHEMA (compat's records, dict observations): a field maybe
    dropped or of another dtype, shape or length, a key added inside a group or at the top, a
    group given as an array."""
    steps, final, odd = draw(st.integers(1, 4)), draw(st.booleans()), draw(st.sampled_from([False, False, True]))
    flat = {}
    for name, f in NESTED_SCHEMA.fields.items():
        if odd and draw(st.integers(0, 9)) == 0:
            continue
        rows = steps + (final if f.observation else 0) + (draw(st.sampled_from([0] * 6 + [-1, 1])) if odd else 0)
        shape = f.shape if not odd or draw(st.integers(0, 7)) else f.shape + (1,)
        dtype = draw(st.sampled_from([f.dtype] * 6 + ["int32", "float64"])) if odd else f.dtype
        flat[name] = np.zeros((max(rows, 0), *shape), dtype)
    extra = draw(st.sampled_from([None] * 6 + ["observation.extra", "extra"])) if odd else None
    if extra is not None:
        flat[extra] = np.zeros(steps, np.float32)
    data = unflatten(flat)
    if odd and draw(st.integers(0, 19)) == 0:
        data["observation"] = np.zeros((steps + 1, 5), np.float32)
    return data


@given(near_exact_nested_episodes())
@settings(max_examples=300, deadline=None)
def test_the_exact_fast_path_takes_nested_dicts_only_as_the_general_check_does(data):
    assert_fast_path_agrees(NESTED_SCHEMA, data)


@given(steps=st.integers(1, 5), final=st.booleans())
@settings(max_examples=20, deadline=None)
def test_nested_dicts_that_match_take_the_fast_path(steps, final):
    flat = {name: np.zeros((steps + (final and f.observation), *f.shape), f.numpy_dtype)
            for name, f in NESTED_SCHEMA.fields.items()}
    columns, num_steps, has_final = NESTED_SCHEMA.read_exact(unflatten(flat))
    assert (num_steps, has_final) == (steps, final) and all(columns[name] is flat[name] for name in flat)


def test_the_exact_fast_path_declines_dotted_keys_and_bfloat16_schemas():
    nested = Schema({"obs": {"a": ab.Field("float32", (), True)}, "action": ab.Field("int64")})
    assert nested.read_exact({"obs.a": np.zeros(3, np.float32), "action": np.zeros(2, np.int64)}) is None
    assert nested.read_exact({"obs": {"a": np.zeros(3, np.float32)}, "action": np.zeros(2, np.int64)}) is not None
    bf16 = Schema({"x": ab.Field("bfloat16")})
    assert bf16.read_exact({"x": np.zeros(3, np.uint16)}) is None
    assert EXACT_SCHEMA.read_exact([("obs", np.zeros((3, 2), np.float32))]) is None


def test_check_names_the_field_the_received_value_and_the_expected_one():
    field = ab.Field("float32", (4,), True)
    with pytest.raises(ab.SchemaError, match=r"'obs'.*\(5,\).*expected \(4,\)"):
        check_column(field, "obs", np.zeros((3, 5), np.float32), "float32")
    with pytest.raises(ab.SchemaError, match="'obs': dtype float64; expected float32"):
        check_column(field, "obs", np.zeros((3, 4)), "float64")
    with pytest.raises(ab.SchemaError, match="'obs'.*leading dimension"):
        check_column(field, "obs", np.zeros(()), "float32")


@pytest.mark.parametrize("received, expected, fits", [
    ("int32", "int64", True), ("int64", "int32", False), ("uint8", "int16", True), ("float64", "float32", False),
    ("float16", "float32", True), ("bool", "uint8", True), ("int32", "float32", False),
    ("bfloat16", "float32", False), ("float32", "bfloat16", False), ("bfloat16", "bfloat16", True),
])
def test_dtype_fits_only_lossless_casts(received, expected, fits):
    assert dtype_fits(received, expected) is fits


def test_as_array_views_torch_bfloat16_as_uint16_bits_without_changing_them():
    values = torch.tensor([1.5, -2.25, 3e-3, 65280.0], dtype=torch.bfloat16)
    array, name = as_array(values, "x")
    assert name == "bfloat16" and array.dtype == np.uint16
    assert torch.equal(torch.from_numpy(array.view(np.int16)).view(torch.bfloat16), values)


def test_as_array_refuses_unsupported_dtypes_with_the_field_name():
    with pytest.raises(ab.SchemaError, match="field 'x'"):
        as_array(np.array([1 + 2j, 3j]), "x")
    assert as_array(np.array(["a", "b"]), "t")[1] == "string"   # a text field's values (tests/test_text.py)
    with pytest.raises(ab.SchemaError, match="field 'z'"):
        as_array(torch.zeros(2, dtype=torch.complex64), "z")


@pytest.mark.parametrize("value", [b"lots", b"-3", b"1e9"])
def test_a_ragged_columns_bad_max_bytes_metadata_is_a_schema_error_naming_the_column(value):
    arrow = APART_SCHEMA.to_arrow()
    i = arrow.get_field_index("tokens")
    bad = arrow.set(i, arrow.field(i).with_metadata({**arrow.field(i).metadata, b"arrowbuf.max_bytes": value}))
    with pytest.raises(ab.SchemaError, match="column 'tokens'"):
        Schema.from_arrow(bad)
