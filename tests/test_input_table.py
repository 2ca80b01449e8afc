"""Every public entry point, given a bad argument: a typed error that names the argument (or field)
and the value received, and a store left exactly as it was.

Table-driven: each case is (entry point, bad call, error type, a regex naming the argument and
the value). After each refusal the store's snapshot (`snapshot`: len, the episode table, every
row of ``to_arrow()``, ragged and text fields included, the insert, sample and reuse counts) is
unchanged, and the store goes on exactly like a twin that never saw the bad call (its next
sample draws the same rows). `tests/test_input_checks.py` holds the older single cases.
"""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import arrowbuf as ab

T = 4
SCHEMA = {"obs": ab.Field("float32", (2,), observation=True), "action": "int64", "reward": "float32",
          "terminated": "bool", "truncated": "bool", "answer": ab.Field("int64", (None,), max_bytes=4096),
          "text": ab.Field("string")}


def episode(tag: int, steps: int = T, **fields) -> dict:
    """Episode ``tag``: obs ``[tag, t]``, answers of t + 1 tokens, instructions ``"task <tag>"``."""
    value = {"obs": np.stack([np.full(steps + 1, tag), np.arange(steps + 1)], -1).astype(np.float32),
             "action": np.arange(steps, dtype=np.int64) + 10 * tag, "reward": np.ones(steps, np.float32),
             "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool),
             "answer": [np.arange(t + 1, dtype=np.int64) + tag for t in range(steps)],
             "text": [f"task {tag}"] * steps}
    value.update(fields)
    return value


def step(n: int = 2, t: int = 0, **fields) -> dict:
    """One writer step of ``n`` envs, none ending."""
    obs = np.full((n, 2), t, np.float32)
    value = {"obs": obs, "action": np.zeros(n, np.int64), "reward": np.ones(n, np.float32),
             "terminated": np.zeros(n, bool), "truncated": np.zeros(n, bool), "next_obs": obs + 1,
             "answer": [np.arange(2, dtype=np.int64)] * n, "text": ["go"] * n}
    value.update(fields)
    return value


def make(sampler=None, **kwargs) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=200, seed=3, schema=SCHEMA, track_reuse=True, sampler=sampler, **kwargs)
    for tag in range(3):
        store.add_episode(episode(tag))
    store.sample(2)   # counts that a refused call must leave alone
    return store


def snapshot(store: ab.ExperienceStore) -> dict:
    """Everything observable about the store's contents and counts, as plain values (copies)."""
    stats = store.stats()
    return {"len": len(store), "episodes": store.episodes().to_pylist(), "rows": store.to_arrow().to_pylist(),
            "counts": {k: stats[k] for k in ("transitions", "episodes", "inserts", "samples", "reuse", "priorities")}}


def assert_refused(store, twin, call, error, pattern) -> None:
    """``call(store)`` raises ``error`` matching ``pattern``, and ``store`` goes on as ``twin`` does."""
    before = snapshot(store)
    with pytest.raises(error, match=pattern):
        call(store)
    assert snapshot(store) == before
    assert store.sample(4)["index"].tolist() == twin.sample(4)["index"].tolist()   # no draw was spent
    assert snapshot(store)["counts"] == snapshot(twin)["counts"]


# -- the table -----------------------------------------------------------------------------------------
# (id, entry point's call, error type, regex that names the argument or field and the value received).
# Marked "26b9928:" the cases that were accepted there, or failed with another error or too late.

PLAIN = [
    ("sample-batch-size-zero", lambda s: s.sample(0), ValueError, r"batch_size must be an int >= 1, got 0"),
    ("sample-keys-unknown", lambda s: s.sample(4, keys=["nope"]), ValueError, r"nope"),
    ("sample-pad-not-ragged", lambda s: s.sample(4, pad={"reward": 0}), ValueError,
     r"pad: 'reward' is not a ragged field"),
    ("sample-pad-str", lambda s: s.sample(4, pad={"answer": "x"}), ValueError,
     r"pad: the value for 'answer' must be a number, got 'x'"),
    # 26b9928: 0.5 was cast to an int64 pad of 0, NaN to an arbitrary int (a RuntimeWarning), and
    # 2**70 raised OverflowError from numpy after the batch was drawn and counted.
    ("sample-pad-fraction", lambda s: s.sample(4, pad={"answer": 0.5}), ValueError,
     r"pad: the value for 'answer' must be a whole number .*int64.*got 0\.5"),
    ("sample-pad-nan", lambda s: s.sample(4, pad={"answer": math.nan}), ValueError,
     r"pad: the value for 'answer' must be a whole number .*got nan"),
    ("sample-pad-overflow", lambda s: s.sample(4, pad={"answer": 2 ** 70}), ValueError,
     r"pad: the value for 'answer' must be a whole number .*got 1180591620717411303424"),
    ("iter-pad-overflow", lambda s: next(s.iter_batches(4, pad={"answer": -2 ** 64})), ValueError,
     r"pad: the value for 'answer'.*got -18446744073709551616"),
    # 26b9928: torch's "split_with_sizes(): not supported for NestedTensor" after the draw was counted.
    ("sample-num-workers-ragged", lambda s: s.sample(4, num_workers=2), ValueError,
     r"num_workers: the ragged fields \['answer'\]"),
    ("sample-num-workers-not-dividing", lambda s: s.sample(4, num_workers=3), ValueError,
     r"batch_size 4 is not a multiple of num_workers=3"),
    ("iter-world-size-zero", lambda s: next(s.iter_batches(4, world_size=0, rank=0)), ValueError,
     r"world_size.*got 0"),
    ("iter-rank-past-world", lambda s: next(s.iter_batches(4, world_size=2, rank=2)), ValueError,
     r"rank must be an int in \[0, 2\).*got 2"),
    ("iter-balance-not-ragged", lambda s: next(s.iter_batches(4, world_size=2, rank=0, balance="reward")),
     ValueError, r"balance='reward' must name a ragged field"),
    ("iter-rank-without-world", lambda s: next(s.iter_batches(4, rank=0)), ValueError, r"rank"),
    ("gather-floats", lambda s: s.gather([0.5]), ValueError, r"index must be a 1-D array of ints, got .*float64"),
    ("episode-id-str", lambda s: s.episode("0"), ValueError, r"episode_id must be an int.*got '0'"),
    ("add-episode-action-fraction", lambda s: s.add_episode(episode(7, action=np.full(T, 0.5))),
     ab.SchemaError, r"field 'action': dtype float64; expected int64"),
    ("add-episode-ragged-count", lambda s: s.add_episode(episode(7, answer=[np.arange(2)] * (T - 1))),
     ab.SchemaError, r"answer"),
    ("add-episode-ragged-fraction", lambda s: s.add_episode(episode(7, answer=[np.array([0.5])] * T)),
     ab.SchemaError, r"answer.*float64"),
    ("add-episode-text-mixed", lambda s: s.add_episode(episode(7, text=["a", 1, "b", "c"])), ab.SchemaError,
     r"field 'text'.*mixes strings with other values"),
    # 26b9928: stored; every later to_arrow, export, checkpoint and Ray block of the store then failed
    # with UnicodeEncodeError (the text dictionary only grows: the store never recovered).
    ("add-episode-text-surrogate", lambda s: s.add_episode(episode(7, text=["a", "\ud800", "b", "c"])),
     ab.SchemaError, r"field 'text': '\\ud800' is not valid Unicode text"),
    ("add-episode-text-surrogate-numpy",
     lambda s: s.add_episode(episode(7, text=np.array(["a", "b\udc80", "c", "d"]))),
     ab.SchemaError, r"field 'text': 'b\\udc80' is not valid Unicode text"),
    ("add-episodes-text-surrogate",
     lambda s: s.add_episodes({k: ([v, v] if isinstance(v, list) else np.stack([v, v])) for k, v in
                               episode(7, text=["a", "b", "\udfff", "c"]).items()}),
     ab.SchemaError, r"field 'text'.*'\\udfff' is not valid Unicode text"),
    # 26b9928: NaN and Infinity were kept as such in the episode table's JSON, which no JSON reader parses.
    ("add-episode-metadata-nan", lambda s: s.add_episode(episode(7), metadata={"score": math.nan}), ValueError,
     r"metadata must be JSON-serializable.*'score': nan"),
    # 26b9928: the write evicted every episode held, then kept the new one over the budget anyway.
    ("add-episode-over-max-bytes", lambda s: s.add_episode(episode(7, answer=[np.arange(1000)] * T)),
     ab.CapacityError, r"field 'answer': an episode of 32,000 bytes of values, more than the 4,096 bytes"),
    ("add-episode-env-id-int", lambda s: s.add_episode(episode(7), env_id=3), ValueError,
     r"env_id must be a str, got 3"),
    ("add-episode-shard", lambda s: s.add_episode(episode(7), shard=1), ValueError, r"shard must be.*got 1"),
    ("add-episodes-lengths", lambda s: s.add_episodes({k: ([v, v] if isinstance(v, list) else np.stack([v, v]))
                                                       for k, v in episode(7).items()}, lengths=[0, T]),
     ValueError, r"lengths"),
    ("pin-env-shard", lambda s: s.pin_env("env-9", 1), ValueError, r"shard must be an int in \[0, 1\).*got 1"),
    ("update-priorities-uniform", lambda s: s.update_priorities([0], [1.0]), ValueError,
     r"update_priorities needs a PrioritizedSampler"),
    ("writer-mode", lambda s: s.writer(2, "sometimes"), ValueError, r"autoreset_mode.*'sometimes'"),
    ("writer-num-envs", lambda s: s.writer(0), ValueError, r"num_envs must be an int >= 1, got 0"),
    ("writer-env-ids", lambda s: s.writer(2, env_ids=["a"]), ValueError, r"env_ids must be 2 strings, got \['a'\]"),
    ("writer-env-count", lambda s: s.writer(2, "next_step").add(**step(3)), ab.SchemaError,
     r"leading dims.*expected 2 envs"),
    ("writer-dtype", lambda s: s.writer(2, "next_step").add(**step(action=np.full(2, 0.5))), ab.SchemaError,
     r"field 'action': dtype float64; expected int64"),
    ("writer-shape", lambda s: s.writer(2, "next_step").add(**step(obs=np.zeros((2, 3), np.float32))),
     ab.SchemaError, r"obs.*\(3,\)"),
    ("writer-ragged-float", lambda s: s.writer(2, "next_step").add(**step(answer=[np.array([0.5])] * 2)),
     ab.SchemaError, r"answer.*float64"),
    # 26b9928: the writer stored the step (see above for what that did to the store).
    ("writer-text-surrogate", lambda s: s.writer(2, "next_step").add(**step(text=["ok", "\ud83d"])),
     ab.SchemaError, r"field 'text': '\\ud83d' is not valid Unicode text"),
    # 26b9928: accepted and dropped: the step stored next_obs (a same-step env's reset observation) as final.
    ("writer-final-obs-next-step", lambda s: s.writer(2, "next_step").add(**step(), final_obs=np.ones((2, 2))),
     ValueError, r"final_obs is for autoreset_mode='same_step'.*this writer is in 'next_step' mode"),
    ("writer-final-obs-disabled", lambda s: s.writer(2, "disabled").add(**step(), final_obs=np.ones((2, 2))),
     ValueError, r"final_obs is for autoreset_mode='same_step'.*this writer is in 'disabled' mode"),
    ("writer-final-obs-no-mode", lambda s: s.writer(2).add(**step(), final_obs=np.ones((2, 2))),
     ab.AutoresetModeError, r"writer got final_obs"),
    ("compute-gae-gamma", lambda s: s.compute_gae(gamma=1.5), ValueError, r"gamma must be a number in \[0, 1\]"),
    ("episodes-include-open", lambda s: s.episodes(include_open=1), ValueError, r"include_open must be a bool"),
]

PRIORITIZED = [
    ("priorities-nan", lambda s: s.update_priorities([0, 1], [math.nan, 1.0]), ValueError,
     r"priority must be finite and >= 0, got \[nan\]"),
    ("priorities-negative", lambda s: s.update_priorities([0, 1], [-1.0, 1.0]), ValueError,
     r"priority must be finite and >= 0, got \[-1\.0\]"),
    ("priorities-mismatch", lambda s: s.update_priorities([0, 1], [1.0]), ValueError,
     r"index has 2 entries but priority has 1"),
    ("priorities-float-index", lambda s: s.update_priorities([0.0], [1.0]), ValueError,
     r"index must hold integers.*float64"),
    ("priorities-str", lambda s: s.update_priorities([0], ["high"]), ValueError, r"priority must hold real numbers"),
    ("priorities-wait", lambda s: s.update_priorities([0], [1.0], wait="no"), ValueError,
     r"wait must be True or False, got 'no'"),
]


@pytest.mark.parametrize("name, call, error, pattern", PLAIN, ids=[case[0] for case in PLAIN])
def test_a_bad_argument_is_refused_naming_it_and_the_store_goes_on_unchanged(name, call, error, pattern):
    assert_refused(make(), make(), call, error, pattern)


@pytest.mark.parametrize("name, call, error, pattern", PRIORITIZED, ids=[case[0] for case in PRIORITIZED])
def test_bad_priorities_are_refused_and_the_sum_tree_is_unchanged(name, call, error, pattern):
    store, twin = make(ab.PrioritizedSampler(alpha=0.6)), make(ab.PrioritizedSampler(alpha=0.6))
    total = store.sampler.tree.total
    assert_refused(store, twin, call, error, pattern)
    assert store.sampler.tree.total == total


def test_a_refused_text_value_leaves_the_store_readable_everywhere(tmp_path):
    # 26b9928: the lone surrogate was stored, and to_arrow, to_parquet and save raised UnicodeEncodeError
    # from then on.
    store = make()
    with pytest.raises(ab.SchemaError, match="not valid Unicode text"):
        store.add_episode(episode(7, text=["\udc80"] * T))
    store.add_episode(episode(8, text=["caf\u00e9 \U0001f600"] * T))   # valid non-ASCII text is kept
    assert "caf\u00e9 \U0001f600" in store.to_arrow()["text"].to_pylist()
    back = ab.ExperienceStore.load(store.save(tmp_path / "ckpt"))
    assert back.to_arrow()["text"].to_pylist() == store.to_arrow()["text"].to_pylist()
    assert ab.ExperienceStore.from_parquet(store.to_parquet(tmp_path / "export")).num_episodes == 4


# -- arguments of constructors and of files -------------------------------------------------------------


@pytest.mark.parametrize("call, error, pattern", [
    # 26b9928: AttributeError: 'int' object has no attribute 'items'.
    (lambda: ab.ExperienceStore(10, schema=3), ab.SchemaError, r"a schema is a mapping.*got 3"),
    (lambda: ab.Schema(["obs", "action"]), ab.SchemaError, r"a schema is a mapping.*\['obs', 'action'\]"),
    # 26b9928: Field("float32", (2.5,)) was the field (2,): a silent truncation of the shape.
    (lambda: ab.Field("float32", (2.5,)), ab.SchemaError, r"shape must be a tuple of ints.*got \(2\.5,\)"),
    (lambda: ab.Field("float32", (True,)), ab.SchemaError, r"shape must be a tuple of ints.*got \(True,\)"),
    # 26b9928: kept as observation='yes' (truthy: an observation).
    (lambda: ab.Field("float32", (2,), observation="yes"), ab.SchemaError,
     r"observation must be True or False, got 'yes'"),
    (lambda: ab.Field("float32", derived=1), ab.SchemaError, r"derived must be True or False, got 1"),
    (lambda: ab.Field("int64", (None,), max_bytes=2.5), ab.SchemaError, r"max_bytes must be a positive int.*2\.5"),
    (lambda: ab.Field("uint8", (8, 8, 3), codec="jpeg:101"), ab.SchemaError, r"codec 'jpeg:101'"),
    # 26b9928: WithoutReplacementSampler(drop_last="no") dropped the last batch ("no" is truthy).
    (lambda: ab.WithoutReplacementSampler(drop_last="no"), ValueError, r"drop_last must be True or False, got 'no'"),
    (lambda: ab.GroupSampler("prompt", group_size=0), ValueError, r"group_size.*0"),
    (lambda: ab.PrioritizedSampler(alpha=-1), ValueError, r"alpha.*-1"),
    # 26b9928: numpy's "ufunc 'isfinite' not supported for the input types", naming no argument.
    (lambda: ab.PrioritizedSampler(alpha="0.6"), ValueError, r"alpha must be a finite number >= 0, got '0\.6'"),
    (lambda: ab.PrioritizedSampler(beta=None), ValueError, r"beta must be in \[0, 1\], got None"),
    (lambda: ab.PrioritizedSampler(eps="small"), ValueError, r"eps must be a finite number > 0, got 'small'"),
    # 26b9928: SequenceSampler(strict="no") was strict.
    (lambda: ab.SequenceSampler(seq_len=4, strict="no"), ValueError, r"strict must be True or False, got 'no'"),
    (lambda: ab.ExperienceStore(0), ValueError, r"capacity must be an int >= 1, got 0"),
    (lambda: ab.ExperienceStore(10, mode="ring"), ValueError, r"mode.*'ring'"),
])
def test_a_bad_constructor_argument_is_refused_naming_it(call, error, pattern):
    with pytest.raises(error, match=pattern):
        call()


@pytest.mark.parametrize("call, pattern", [
    # 26b9928: pyarrow's ArrowException "Unsupported compression: bogus", from the middle of the export.
    (lambda s, d: s.to_parquet(d, compression="bogus"), r"compression must be one of .*got 'bogus'"),
    (lambda s, d: s.to_parquet(d, compression=None), r"compression must be one of .*got None"),
    # 26b9928: any truthy value was taken for True.
    (lambda s, d: s.to_parquet(d, progress="no"), r"progress must be None .*got 'no'"),
    (lambda s, d: s.to_parquet(d, overwrite="no"), r"overwrite must be True or False, got 'no'"),
    (lambda s, d: s.save(d, progress="no"), r"progress must be None .*got 'no'"),
    (lambda s, d: s.to_parquet(d, rows_per_file=0), r"rows_per_file must be an int >= 1 or None, got 0"),
])
def test_bad_file_arguments_are_refused_before_a_file_is_written(tmp_path, call, pattern):
    store, twin = make(), make()
    assert_refused(store, twin, lambda s: call(s, tmp_path / "out"), ValueError, pattern)
    assert not (tmp_path / "out").exists()
    assert list(tmp_path.iterdir()) == []   # nor a hidden sibling left over


def test_bad_arguments_of_load_and_open_are_refused(tmp_path):
    store = make()
    saved, export = store.save(tmp_path / "ckpt"), store.to_parquet(tmp_path / "export")
    # 26b9928: the three were accepted ("no" is truthy: a progress bar).
    with pytest.raises(ValueError, match=r"progress must be None .*got 'no'"):
        ab.ExperienceStore.load(saved, progress="no")
    with pytest.raises(ValueError, match=r"progress must be None .*got 'no'"):
        ab.ExperienceStore.from_parquet(export, progress="no")
    with pytest.raises(ValueError, match=r"progress must be None .*got 'no'"):
        ab.open_dataset(export, progress="no")
    assert not (export / ".arrowbuf-cache").exists()   # nothing converted
    with pytest.raises(ab.FormatError, match="nope"):
        ab.ExperienceStore.load(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"capacity.*-1"):
        ab.ExperienceStore.from_parquet(export, capacity=-1)
    # 26b9928: pathlib's "expected str, bytes or os.PathLike object, not int", naming no argument.
    for call in (lambda: store.save(3), lambda: store.to_parquet(None), lambda: ab.ExperienceStore.load(3),
                 lambda: ab.ExperienceStore.from_parquet(3), lambda: ab.open_dataset(3)):
        with pytest.raises(TypeError, match=r"path must be a path \(a str or os.PathLike\), got (3|None)"):
            call()
    with pytest.raises(TypeError, match=r"cache_dir must be a path \(a str or os.PathLike\), got 3"):
        ab.open_dataset(export, cache_dir=3)
    assert ab.ExperienceStore.load(saved, progress=False).to_arrow().equals(store.to_arrow())


def test_a_dataset_refuses_bad_sample_arguments_as_a_store_does(tmp_path):
    export = make().to_parquet(tmp_path / "export")
    dataset, twin = ab.open_dataset(export, seed=0), ab.open_dataset(export, seed=0)
    for call, pattern in [
        # 26b9928: 0.5 padded with 0s, and 2**70 raised numpy's OverflowError after the draw.
        (lambda d: d.sample(4, pad={"answer": 0.5}), r"pad: the value for 'answer' must be a whole number.*0\.5"),
        (lambda d: d.sample(4, pad={"answer": 2 ** 70}), r"pad: the value for 'answer' must be a whole number"),
        (lambda d: next(d.iter_batches(4, pad={"answer": math.inf})), r"pad: the value for 'answer'.*inf"),
        (lambda d: d.sample(0), r"batch_size must be an int >= 1, got 0"),
        (lambda d: d.sample(4, keys=["nope"]), r"nope"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            call(dataset)
    assert dataset.sample(8)["index"].tolist() == twin.sample(8)["index"].tolist()


@pytest.mark.parametrize("field, value, pattern", [
    ("pixels", np.zeros((T + 1, 8, 8, 3), np.float32), r"field 'pixels': dtype float32; expected uint8"),
    ("pixels", np.zeros((T + 1, 8, 8, 4), np.uint8), r"field 'pixels': per-step shape \(8, 8, 4\).*expected \(8, 8, 3\)"),
    ("pixels", np.full((T + 1, 8, 8, 3), 300, np.int16), r"field 'pixels': dtype int16; expected uint8"),
    ("depth", np.full((T, 4), 0.1), r"field 'depth': dtype float64; expected float32"),
    ("pixels", [b"not a frame"] * (T + 1), r"field 'pixels'"),
])
def test_an_encoded_field_refuses_values_of_another_dtype_or_shape(field, value, pattern):
    def encoded():
        store = ab.ExperienceStore(capacity=50, seed=0, schema={
            "pixels": ab.Field("uint8", (8, 8, 3), observation=True, codec="jpeg:90", max_bytes=1 << 16),
            "depth": ab.Field("float32", (4,), codec="zstd"), "reward": "float32", "terminated": "bool"})
        store.add_episode(encoded_episode())
        return store

    def encoded_episode(**fields):
        return {"pixels": np.zeros((T + 1, 8, 8, 3), np.uint8), "depth": np.ones((T, 4), np.float32),
                "reward": np.ones(T, np.float32), "terminated": np.arange(T) == T - 1, **fields}

    store, twin = encoded(), encoded()
    before = (len(store), store.episodes().to_pylist(), store.to_arrow().to_pylist())
    with pytest.raises(ab.SchemaError, match=pattern):
        store.add_episode(encoded_episode(**{field: value}))
    assert (len(store), store.episodes().to_pylist(), store.to_arrow().to_pylist()) == before
    assert store.sample(4)["index"].tolist() == twin.sample(4)["index"].tolist()


def test_a_group_sampler_whose_key_is_not_a_field_is_refused_before_the_first_write():
    # 26b9928: the store was made and filled; the error came at its first sample.
    no_key = {"obs": ab.Field("float32", (1,), observation=True), "reward": "float32", "terminated": "bool"}
    with pytest.raises(ValueError, match=r"GroupSampler key 'prompt' must be a scalar field of the store; its fields "
                                         r"are \{'obs': \(1,\), 'reward': \(\), 'terminated': \(\)\}"):
        ab.ExperienceStore(64, sampler=ab.GroupSampler("prompt", group_size=2), schema=no_key)
    store = ab.ExperienceStore(64, seed=0, sampler=ab.GroupSampler("prompt", group_size=2))
    steps = {"obs": np.zeros((5, 1), np.float32), "reward": np.ones(4, np.float32), "terminated": np.arange(4) == 3}
    with pytest.raises(ValueError, match=r"GroupSampler key 'prompt' must be a scalar field"):
        store.add_episode(steps)
    with pytest.raises(ValueError, match=r"GroupSampler key 'prompt' must be a scalar field"):
        store.add_episode({**steps, "prompt": np.zeros((4, 3), np.int64)})   # a vector: not a key
    writer = store.writer(1, "next_step")
    with pytest.raises(ValueError, match=r"GroupSampler key 'prompt' must be a scalar field"):
        writer.add(obs=np.zeros((1, 1), np.float32), action=np.zeros(1, np.int64), reward=np.ones(1, np.float32),
                   terminated=np.ones(1, bool), truncated=np.zeros(1, bool), next_obs=np.ones((1, 1), np.float32))
    assert store.schema is None and len(store) == 0   # nothing recorded, not even the schema
    store.add_episode({**steps, "prompt": np.array([0, 0, 1, 1])})
    groups = store.sample(4)["prompt"].view(2, 2)
    assert (groups[:, 0] == groups[:, 1]).all()   # whole groups


def test_a_ray_store_refuses_a_group_key_it_lacks_at_construction_not_with_a_dead_actor(ray_session):
    # 26b9928: made; (with the check in the shards alone) each shard actor died in its constructor.
    with pytest.raises(ValueError, match=r"GroupSampler key 'prompt' must be a scalar field"):
        ab.ExperienceStore(64, backend="ray", sampler=ab.GroupSampler("prompt", group_size=2), schema=SCHEMA)


@pytest.mark.parametrize("returned, pattern", [
    # 26b9928: numpy's "could not convert string to float: np.str_('x')", naming no argument.
    (lambda td: "x", r"bootstrap_value returned 'x'; expected 3 finite values"),
    (lambda td: np.ones(3) * 1j, r"bootstrap_value returned ndarray of dtype complex128.*expected 3 finite values"),
    (lambda td: torch.zeros(4), r"bootstrap_value returned Tensor .* shape \(4,\); expected 3 finite values"),
    (lambda td: torch.full((3,), math.nan), r"expected 3 finite values"),
])
def test_compute_gae_refuses_a_bad_bootstrap_value_and_writes_nothing(returned, pattern):
    def cut():
        store = ab.ExperienceStore(capacity=100, seed=0)
        for _ in range(3):   # truncated: each bootstraps from its final observation's value
            store.add_episode({"obs": np.zeros((5, 2), np.float32), "reward": np.ones(4, np.float32),
                               "value": np.zeros(4, np.float32), "terminated": np.zeros(4, bool),
                               "truncated": np.arange(4) == 3})
        return store

    store, twin = cut(), cut()
    with pytest.raises(ValueError, match=pattern):
        store.compute_gae(value_key="value", bootstrap_value=returned)
    assert "advantage" not in store.schema.fields and store.to_arrow().equals(twin.to_arrow())
    assert store.compute_gae(value_key="value", bootstrap_value=lambda td: torch.ones(td.shape[0])) == 12


@pytest.mark.parametrize("dtype, pad, expected", [
    ("float32", 0.5, 0.5), ("float32", math.nan, math.nan), ("float32", -math.inf, -math.inf),
    ("float32", 1e39, r"pad: the value for 'a' overflows the field's float32"),   # 26b9928: inf, silently
    ("float16", 70000, r"pad: the value for 'a' overflows the field's float16"),
    ("uint8", 255, 255), ("uint8", 256, r"whole number in \[0, 255\] \(the field is uint8\), got 256"),
    ("uint8", -1, r"whole number in \[0, 255\].*got -1"),   # 26b9928: padded with 255
    ("bool", 1, True), ("bool", 2, r"whole number in \[0, 1\] \(the field is bool\), got 2"),
])
def test_a_pad_value_is_checked_against_its_fields_dtype(dtype, pad, expected):
    store = ab.ExperienceStore(capacity=50, seed=0, schema={"obs": ab.Field("float32", (1,), observation=True),
                                                            "a": ab.Field(dtype, (None,)), "terminated": "bool"})
    store.add_episode({"obs": np.zeros((4, 1), np.float32), "a": [np.ones(n + 1, dtype) for n in range(3)],
                       "terminated": np.arange(3) == 2})
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            store.sample(3, pad={"a": pad})
        assert store.stats()["samples"] == 0
        return
    batch, = store.iter_batches(3, shuffle=False, pad={"a": pad})   # rows of 1, 2 and 3 values
    assert batch["a_length"].tolist() == [1, 2, 3]
    np.testing.assert_array_equal(batch["a"][:2, 2].double().numpy(), np.full(2, float(expected)))


# -- properties ------------------------------------------------------------------------------------------

QUICK = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture
def shared_pair():
    """A store and its twin, shared by a property's examples (each refusal must leave them alike)."""
    return make(), make()


@QUICK
@given(world_size=st.integers(-2, 5), rank=st.one_of(st.none(), st.integers(-2, 6)))
def test_world_size_and_rank_are_checked_before_any_batch_is_drawn(shared_pair, world_size, rank):
    store, twin = shared_pair
    if world_size >= 1 and (rank is None or 0 <= rank < world_size):
        shares = [len(b) if rank is not None else sum(map(len, b)) for b in store.iter_batches(6, world_size=world_size,
                                                                                               rank=rank)]
        [b for b in twin.iter_batches(6, world_size=world_size, rank=rank)]
        assert rank is not None or sum(shares) == len(store)
        return
    bad = "world_size" if world_size < 1 else "rank"
    value = world_size if world_size < 1 else rank
    assert_refused(store, twin, lambda s: next(s.iter_batches(6, world_size=world_size, rank=rank)), ValueError,
                   rf"{bad}.*{re.escape(str(value))}")


@QUICK
@given(pad=st.one_of(st.integers(-2 ** 80, 2 ** 80), st.floats(allow_nan=True, allow_infinity=True)))
def test_a_pad_value_is_used_only_when_the_field_holds_it_exactly(shared_pair, pad):
    store, twin = shared_pair
    info = np.iinfo(np.int64)
    exact = (isinstance(pad, int) or (math.isfinite(pad) and float(pad).is_integer())) and info.min <= pad <= info.max
    if exact:
        padded = store.sample(4, pad={"answer": pad})["answer"]
        twin.sample(4)
        lengths = store.sample(4, pad={"answer": pad})["answer_length"]
        twin.sample(4)
        assert padded.dtype == torch.int64 and lengths.dtype == torch.int64
        return
    assert_refused(store, twin, lambda s: s.sample(4, pad={"answer": pad}), ValueError,
                   r"pad: the value for 'answer' must be a whole number")


@QUICK
@given(batch_size=st.one_of(st.integers(-3, 0), st.floats(0.5, 8.5).filter(lambda x: not x.is_integer()),
                            st.booleans(), st.just("8")))
def test_a_batch_size_that_is_not_a_positive_int_is_refused_everywhere(shared_pair, batch_size):
    store, twin = shared_pair
    for call in (lambda s: s.sample(batch_size), lambda s: next(s.iter_batches(batch_size)),
                 lambda s: s.sample_iter(batch_size)):
        assert_refused(store, twin, call, ValueError, rf"batch_size must be an int >= 1, got {re.escape(repr(batch_size))}")


@QUICK
@given(index=st.lists(st.integers(-2 ** 63, 2 ** 63 - 1) | st.integers(-3, 15), min_size=1, max_size=6),
       bad=st.sampled_from([None, math.nan, -0.5, math.inf, -math.inf]), where=st.integers(0, 5))
def test_priorities_of_any_indices_apply_to_the_live_ones_or_are_refused_whole(index, bad, where):
    store, twin = make(ab.PrioritizedSampler(alpha=1.0)), make(ab.PrioritizedSampler(alpha=1.0))
    priority = np.full(len(index), 3.0)
    if bad is not None:
        priority[where % len(index)] = bad
        total = store.sampler.tree.total
        assert_refused(store, twin, lambda s: s.update_priorities(index, priority), ValueError,
                       r"priority must be finite and >= 0, got \[")
        assert store.sampler.tree.total == total
        return
    live = sum(0 <= i < len(store) for i in index)   # 3 episodes of 4 transitions: indices 0..11, none evicted
    assert store.update_priorities(np.array(index, np.int64), priority) == live
    assert twin.update_priorities(np.array(index, np.int64), priority) == live
    assert store.sample(8)["index"].tolist() == twin.sample(8)["index"].tolist()


# -- mixtures ---------------------------------------------------------------------------------------------


def test_a_mixture_with_an_empty_source_draws_from_none_of_them():
    # 26b9928: the sources before the empty one drew their rows (generator, sample and reuse counts
    # moved) for a batch that was never returned.
    full, twin = make(), make()
    online = ab.ExperienceStore(capacity=100, seed=0, schema=SCHEMA)
    mixture = ab.Mixture({"demos": full, "online": online}, weights={"demos": 0.5, "online": 0.5}, seed=0)
    for kwargs in ({}, {"keys": ["obs", "answer"]}):
        before = snapshot(full)
        with pytest.raises(ab.EmptyStoreError, match=r"source 'online' holds 0 transitions .* asks it for 4 rows"):
            mixture.sample(8, **kwargs)
        assert snapshot(full) == before
    assert full.sample(4)["index"].tolist() == twin.sample(4)["index"].tolist()
    online.add_episode(episode(5))
    assert mixture.sample(8)["source"].tolist() == [0] * 4 + [1] * 4


def test_mixture_options_a_later_source_refuses_are_refused_before_any_source_draws():
    # 26b9928: the first source drew and counted its rows, then the second refused n_step (no reward) or pad.
    first, twin = make(), make()
    second = ab.ExperienceStore(capacity=50, seed=0, schema={"obs": ab.Field("float32", (2,), observation=True),
                                                             "action": "int64", "terminated": "bool"})
    second.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.zeros(3, np.int64),
                        "terminated": np.arange(3) == 2})
    mixture = ab.Mixture({"a": first, "b": second}, weights={"a": 0.5, "b": 0.5}, seed=0)
    before = snapshot(first)
    with pytest.raises(ValueError, match=r"source 'b': n_step > 1 needs a 'reward' field.*nothing was drawn"):
        mixture.sample(8, n_step=2)
    with pytest.raises(ValueError, match=r"source 'b': pad: 'answer' is not a ragged field.*nothing was drawn"):
        mixture.sample(8, pad={"answer": 0})
    assert snapshot(first) == before and second.stats()["samples"] == 0
    assert first.sample(4)["index"].tolist() == twin.sample(4)["index"].tolist()
    assert mixture.sample(8, keys=["obs"])["source"].tolist() == [0] * 4 + [1] * 4


def test_mixture_keys_a_later_source_lacks_are_refused_before_any_source_draws(ray_stores):
    # 1b3f084: the first source (local, or Ray) drew and counted its rows, then the second refused
    # keys naming a field it lacks (and sample_iter's n_step: the first stream drew before the second started).
    first, twin = make(), make()
    second = ab.ExperienceStore(capacity=50, seed=0, schema={"obs": ab.Field("float32", (2,), observation=True),
                                                             "action": "int64", "terminated": "bool"})
    second.add_episode({"obs": np.zeros((4, 2), np.float32), "action": np.zeros(3, np.int64),
                        "terminated": np.arange(3) == 2})
    remote = ray_store(ray_stores)

    def seen(source):
        return snapshot(source) if source is first else (*ray_snapshot(source), source.stats()["samples"])

    for source in (first, remote):
        mixture = ab.Mixture({"a": source, "b": second}, weights={"a": 0.5, "b": 0.5}, seed=0)
        before, drawn = seen(source), second.stats()["samples"]
        with pytest.raises(ValueError, match=r"source 'b': keys: no field 'answer'.*nothing was drawn"):
            mixture.sample(8, keys=["obs", "answer"])
        with pytest.raises(ValueError, match=r"source 'b': n_step > 1 needs a 'reward' field.*nothing was drawn"):
            next(mixture.sample_iter(8, n_step=2))   # (sample_iter takes no keys): its streams started in turn
        assert seen(source) == before and second.stats()["samples"] == drawn
        if source is first:   # no draw was spent: it goes on as its twin
            assert first.sample(4)["index"].tolist() == twin.sample(4)["index"].tolist()
        assert mixture.sample(8, keys=["obs"])["source"].tolist() == [0] * 4 + [1] * 4

def test_mixture_priorities_are_checked_for_every_source_before_any_is_updated():
    # 26b9928: the first source's priorities were set, then the second's NaN refused.
    per = ab.PrioritizedSampler(alpha=1.0)
    first, second = make(per), make(ab.PrioritizedSampler(alpha=1.0))
    mixture = ab.Mixture({"a": first, "b": second}, weights={"a": 0.5, "b": 0.5}, seed=0)
    batch = mixture.sample(8)
    totals = (first.sampler.tree.total, second.sampler.tree.total)
    priority = np.r_[np.full(4, 5.0), np.full(3, 5.0), math.nan]
    with pytest.raises(ValueError, match=r"priority must be finite and >= 0, got \[nan\]"):
        mixture.update_priorities(batch, priority)
    assert (first.sampler.tree.total, second.sampler.tree.total) == totals
    with pytest.raises(ValueError, match=r"batch must be a batch of this mixture"):
        mixture.update_priorities(first.sample(4), np.ones(4))
    assert mixture.update_priorities(batch, np.full(8, 5.0)) == {"a": 4, "b": 4}


# -- the RLightning compat layer ------------------------------------------------------------------------


def compat_buffer():
    from arrowbuf.compat import build_data_buffer
    from arrowbuf.types import BatchedData, EnvMeta, EnvRet, PolicyResponse

    config = SimpleNamespace(type="ReplayBuffer", capacity=1000)
    buffer = build_data_buffer(config.type, config, cluster=None)
    ids = ["env-0", "env-1"]
    buffer.init([EnvMeta(e, num_envs=1) for e in ids], ids)
    for t in range(6):
        rets = [EnvRet(e, np.full(3, t, np.float32)) if t == 0 else
                EnvRet(e, np.full(3, t, np.float32), last_reward=1.0, last_terminated=False, last_truncated=False)
                for e in ids]
        buffer.add_batched_transition(BatchedData(ids, rets),
                                      BatchedData(ids, [PolicyResponse(e, action=np.int64(t)) for e in ids]),
                                      [t == 5] * 2)
    return buffer


def test_compat_refuses_bad_arguments_by_name_and_keeps_its_data():
    from arrowbuf.types import EnvRet, PolicyResponse

    buffer = compat_buffer()
    before = buffer.store.to_arrow().to_pylist()
    assert len(buffer) == 10
    ret = EnvRet("env-0", np.zeros(3, np.float32))
    # 26b9928: AttributeError: 'int' object has no attribute 'env_id'.
    with pytest.raises(TypeError, match=r"policy_resp must be a PolicyResponse, got int"):
        buffer.add_transition("env-0", ret, 3)
    with pytest.raises(TypeError, match=r"env_ret must be an EnvRet, got str"):
        buffer.add_transition("env-0", "obs", PolicyResponse("env-0", action=np.int64(0)))
    # 26b9928: a str was read as a list of one-character env ids, none open: nothing was truncated, silently.
    with pytest.raises(TypeError, match=r"truncate_episodes takes a list of env ids .*got 'env-0'"):
        buffer.truncate_episodes("env-0")
    # 26b9928: "no" is truthy: a shuffled batch.
    with pytest.raises(ValueError, match=r"shuffle must be True or False, got 'no'"):
        buffer.sample(4, shuffle="no")
    with pytest.raises(ValueError, match=r"drop_last must be True or False, got 'no'"):
        buffer.sample(4, drop_last="no")
    with pytest.raises(ValueError, match=r"batch_size must be an int >= 1 or None, got 0"):
        buffer.sample(0)
    with pytest.raises(ValueError, match=r"not enough data in the buffer for a batch of 11"):
        buffer.sample(11)
    assert buffer.store.to_arrow().to_pylist() == before
    batch, = buffer.sample(4, shuffle=False)
    assert batch["observation"].shape == (4, 3)


# -- Ray: the same refusals, and errors raised in a shard reach the caller -----------------------------

RAY = [
    ("text-surrogate", lambda s: s.add_episode(episode(7, text=["\ud800"] * T)), ab.SchemaError,
     r"field 'text': '\\ud800' is not valid Unicode text"),
    ("pin-env-shard", lambda s: s.pin_env("env-9", 2), ValueError, r"shard must be an int in \[0, 2\).*got 2"),
    # Raised in the shard actor (26b9928: stored, after evicting the shard's every episode).
    ("over-max-bytes", lambda s: s.add_episode(episode(7, answer=[np.arange(1000)] * T), env_id="env-0"),
     ab.CapacityError, r"field 'answer': an episode of 32,000 bytes of values, more than the 2,048 bytes"),
    ("priorities-nan", lambda s: s.update_priorities([0], [math.nan]), ValueError,
     r"priority must be finite and >= 0, got \[nan\]"),
    ("priorities-nan-no-wait", lambda s: s.update_priorities([0], [math.nan], wait=False), ValueError,
     r"priority must be finite and >= 0, got \[nan\]"),
    ("iter-rank", lambda s: next(s.iter_batches(4, world_size=2, rank=-1)), ValueError, r"rank.*got -1"),
    ("pad-fraction", lambda s: s.sample(4, pad={"answer": 0.25}), ValueError,
     r"pad: the value for 'answer' must be a whole number .*got 0\.25"),
    ("writer-env-count", lambda s: s.writer(2, "next_step").add(**step(3)), ab.SchemaError,
     r"leading dims.*expected 2 envs"),
    ("writer-text-surrogate", lambda s: s.writer(2, "next_step").add(**step(text=["ok", "\udfff"])),
     ab.SchemaError, r"field 'text': '\\udfff' is not valid Unicode text"),
    ("world-size-without-rank", lambda s: next(s.iter_batches(4, world_size=2, balance="answer")), ValueError,
     r"rank"),
]


def ray_store(ray_stores):
    store = ray_stores.get(capacity=200, num_shards=2, seed=3, schema=SCHEMA,
                           sampler=ab.PrioritizedSampler(alpha=0.6))
    for tag in range(3):
        store.add_episode(episode(tag), env_id=f"env-{tag}")
    return store


def ray_snapshot(store):
    store.flush()
    return len(store), store.episodes().to_pylist(), store.to_arrow().to_pylist()


@pytest.mark.parametrize("name, call, error, pattern", RAY, ids=[case[0] for case in RAY])
def test_a_ray_store_refuses_the_same_bad_arguments_and_its_shards_stay_readable(ray_stores, name, call, error,
                                                                                 pattern):
    store = ray_store(ray_stores)
    before = ray_snapshot(store)
    with pytest.raises(error, match=pattern):
        call(store)
    assert ray_snapshot(store) == before   # 26b9928 (text): the shard's blocks no longer sealed: every read failed
    assert len(store.sample(4)) == 4


def test_an_error_raised_in_a_shard_reaches_the_caller_with_its_message(ray_stores, tmp_path):
    store = ray_store(ray_stores)
    # 26b9928: pyarrow's ArrowException, raised in the shard actors in the middle of the export.
    with pytest.raises(ValueError, match=r"compression must be one of .*got 'bogus'"):
        store.to_parquet(tmp_path / "out", compression="bogus")
    assert not (tmp_path / "out").exists()
    # An error the shard itself raises: an episode id it does not hold.
    with pytest.raises(KeyError, match="123456"):
        store.episode(123456)
    before = ray_snapshot(store)
    writer = store.writer(1, "next_step")
    writer.add(**step(1, text=["fine"]))
    writer.close()
    assert ray_snapshot(store)[0] == before[0] + 1
