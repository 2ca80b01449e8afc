"""Text fields (``ab.Field("string")``): a str per step, stored as codes into a dictionary of the
strings seen, sampled as NonTensorStacks of str, and read back as written on every path."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

import arrowbuf as ab
from arrowbuf.errors import SchemaError

SCHEMA = {"obs": ab.Field("float32", (2,), observation=True), "instruction": ab.Field("string"),
          "action": ab.Field("int64"), "reward": ab.Field("float32"), "terminated": ab.Field("bool"),
          "truncated": ab.Field("bool")}


def instruction(episode: int) -> str:
    return f"put block {episode} in the bin" + " quickly" * (episode % 3)


def episode(e: int, steps: int, form: str = "list") -> dict:
    texts = [instruction(e)] * steps
    if form == "array":
        texts = np.array(texts)
    elif form == "arrow":
        texts = pa.array(texts).dictionary_encode()
    return {"obs": np.zeros((steps + 1, 2), np.float32), "instruction": texts, "action": np.arange(steps) + 100 * e,
            "reward": np.zeros(steps, np.float32), "terminated": np.r_[np.zeros(steps - 1, bool), True],
            "truncated": np.zeros(steps, bool)}


def filled() -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=300, schema=SCHEMA, seed=0)
    for e, steps in enumerate((6, 9, 4, 11)):
        store.add_episode(episode(e, steps, ("list", "array", "arrow")[e % 3]))
    return store


def check(batch) -> None:
    texts = batch["instruction"]   # a list of the str (tensordict's getitem); batch.get gives the stack
    assert type(batch.get("instruction")).__name__ == "NonTensorStack"
    assert list(texts) == [instruction(a // 100) for a in batch["action"].tolist()]


def test_every_path_reads_back_the_strings_written(tmp_path):
    store = filled()
    check(store.sample(32))
    for batch in store.iter_batches(8):
        check(batch)
    assert set(store.sample(4, keys=["action"]).keys()) == {"action", "index", "episode_id", "step"}
    column = store.to_arrow().column("instruction")
    assert pa.types.is_dictionary(column.type)   # the codes, each string once
    store.to_parquet(tmp_path / "export")
    imported = ab.ExperienceStore.from_parquet(tmp_path / "export")
    assert imported.schema.fields["instruction"] == ab.Field("string")
    check(imported.sample(32))
    store.save(tmp_path / "checkpoint")
    check(ab.ExperienceStore.load(tmp_path / "checkpoint").sample(32))
    copied = ab.ExperienceStore(capacity=300, schema=SCHEMA, seed=0)
    copied.add_episode(store.episode(3))
    check(copied.sample(8))
    duckdb = pytest.importorskip("duckdb")
    found = duckdb.sql(f"select distinct instruction from read_parquet('{tmp_path}/export/steps/*.parquet') "
                       "where not is_last").fetchall()
    assert sorted(text for (text,) in found) == sorted(instruction(e) for e in range(4))


def test_a_step_writer_takes_one_str_per_env_and_inference_finds_text():
    store = ab.ExperienceStore(capacity=100, schema=SCHEMA, seed=0)
    writer = store.writer(num_envs=3)
    for t in range(7):
        writer.add(obs=np.zeros((3, 2), np.float32), instruction=[instruction(k) for k in range(3)],
                   action=np.arange(3) * 100 + t, reward=np.zeros(3, np.float32), terminated=np.zeros(3, bool),
                   truncated=np.full(3, t == 6), next_obs=np.zeros((3, 2), np.float32))
    assert len(store) == 21
    check(store.sample(30))
    inferred = ab.ExperienceStore(capacity=50, seed=0)
    inferred.add_episode({"task": ["open the drawer", "open the drawer"], "action": np.zeros(2),
                          "terminated": np.array([False, True])})
    assert inferred.schema.fields["task"] == ab.Field("string")
    assert list(inferred.sample(3)["task"]) == ["open the drawer"] * 3


def test_a_repeated_instruction_is_stored_once_plus_four_bytes_a_step():
    store = ab.ExperienceStore(capacity=100_000, seed=0, schema={"instruction": ab.Field("string"),
                                                                "action": "int64", "terminated": "bool"})
    for e in range(100):
        store.add_episode({"instruction": [instruction(e)] * 1000, "action": np.zeros(1000, np.int64),
                           "terminated": np.r_[np.zeros(999, bool), True]})
    column = store.engine.shard.arena["instruction"]
    assert len(column.strings) == 101 and column.codes.dtype == np.int32   # 100 distinct and "", 4 B a row
    distinct = sum(len(instruction(e).encode()) for e in range(100))
    held = 4 * len(store) + sum(len(s.encode()) for s in column.strings)
    assert held <= 1.1 * distinct + 4 * len(store)


def test_bad_text_is_refused_naming_the_field_and_leaves_the_store_as_it_was():
    store = filled()
    before = store.to_arrow()
    for field, value, message in (("instruction", np.arange(4), "a text field takes str values"),
                                  ("instruction", ["a", "b", 3, "d"], "mixes strings"),
                                  ("action", ["a", "b", "c", "d"], "not strings: declare ab.Field\\('string'\\)"),
                                  # an object array: not text until read (it named no field on the exact path)
                                  ("instruction", np.array([object(), 3, None, "d"], dtype=object), "")):
        bad = episode(7, 4)
        bad[field] = value
        with pytest.raises(SchemaError, match=f"field '{field}'.*{message}"):
            store.add_episode(bad)
    assert store.to_arrow().equals(before)
    with pytest.raises(SchemaError, match="one str per step"):
        ab.Field("string", (2,))
    with pytest.raises(SchemaError, match="one str per step"):
        ab.Field("string", observation=True)
    stacked = {k: np.stack([v, v]) for k, v in episode(0, 3).items() if k != "instruction"}
    for texts, message in (([[instruction(0)] * 3, ["a", 3, "b"]], "episode 1: field 'instruction'.*mixes strings"),
                           ([[instruction(0)] * 3, np.arange(3)], "episode 1: field 'instruction'"),
                           ([[instruction(0)] * 3, ["a"]], "field 'instruction': episode 1 has 1 rows for its 3")):
        with pytest.raises(SchemaError, match=message):
            store.add_episodes(stacked | {"instruction": texts})
    assert store.to_arrow().equals(before)


def test_a_torchrl_batch_with_strings_is_refused_not_stripped():
    import torch
    from tensordict import NonTensorStack, TensorDict

    batch = TensorDict({"observation": torch.zeros(2, 3, 2), "action": torch.zeros(2, 3),
                        "instruction": NonTensorStack.from_list([["stack the cups"] * 3] * 2),
                        ("next", "observation"): torch.zeros(2, 3, 2), ("next", "reward"): torch.zeros(2, 3, 1),
                        ("next", "terminated"): torch.zeros(2, 3, 1, dtype=torch.bool),
                        ("next", "truncated"): torch.zeros(2, 3, 1, dtype=torch.bool)}, batch_size=[2, 3])
    store = ab.ExperienceStore(capacity=50, seed=0)
    with pytest.raises(SchemaError, match=r"extend: keys \['instruction'\] hold non-tensor data"):
        store.extend(batch)
    assert len(store) == 0 and store.schema is None
    store.extend(batch.exclude("instruction"))
    assert len(store) == 6


def test_open_dataset_samples_an_export_s_text_field_as_the_store_wrote_it(tmp_path):
    store = filled()
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=0)
    assert dataset.to_arrow().column("instruction").to_pylist() == store.to_arrow().column("instruction").to_pylist()
    assert len(dataset.sample(8)["instruction"]) == 8   # (rows against their steps: tests/test_dataset_text.py)

def test_arrow_reads_of_a_text_column_see_strings_added_after_an_earlier_read():
    # `TextColumn.stored` keeps the dictionary as an Arrow array between reads (it converted every
    # string on every sealed run before); a string added later must still be in the next read.
    from arrowbuf.text import TextColumn

    column = TextColumn(6, "instruction")
    column[0:3] = np.array(["pick", "place", "pick"], object)
    first = column.stored(0, 3)
    assert first.to_pylist() == ["pick", "place", "pick"]
    column[3:6] = np.array(["open the drawer", "pick", "stack"], object)
    assert column.stored(0, 6).to_pylist() == ["pick", "place", "pick", "open the drawer", "pick", "stack"]
    assert column.stored(3, 6).dictionary.to_pylist() == ["", "pick", "place", "open the drawer", "stack"]
    assert first.to_pylist() == ["pick", "place", "pick"], "an earlier read keeps its values"
