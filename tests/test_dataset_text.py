"""Text fields in datasets: `open_dataset` keeps a text field's strings in its cache, each
distinct string once, and samples them as a store does (a NonTensorStack of str)."""

from __future__ import annotations

import numpy as np
import pytest

import arrowbuf as ab
from arrowbuf import _dataset_heaps
from arrowbuf._dataset_heaps import MappedHeap, text_column

TASKS = ["pick the red cup", "open the drawer", "", "place the bowl on the plate ✓"]


def instructed(episodes: int = 12, seed: int = 0) -> ab.ExperienceStore:
    """Episode e: obs = e, its instruction TASKS[e % 4] at every step, tokens of its steps."""
    store = ab.ExperienceStore(capacity=1_000, seed=seed)
    for e in range(episodes):
        steps = 5 + e % 7
        store.add_episode({"obs": np.full((steps + 1, 2), e, np.float32), "action": np.arange(steps) + 100 * e,
                           "instruction": [TASKS[e % 4]] * steps, "terminated": np.arange(steps) == steps - 1,
                           "tokens": [np.full(1 + t % 3, e, np.int32) for t in range(steps)]})
    return store


def check(batch) -> None:
    episode = batch["obs"][:, 0].numpy().astype(int)
    assert [batch["instruction"][i] for i in range(len(episode))] == [TASKS[e % 4] for e in episode]
    offsets, values = batch["tokens"].offsets().numpy(), batch["tokens"].values().numpy()
    for i, e in enumerate(episode):
        assert (values[offsets[i]:offsets[i + 1]] == e).all()


def test_a_dataset_samples_its_text_field_as_the_store_did_and_stores_each_string_once(tmp_path):
    store = instructed()
    export = store.to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, cache_dir=tmp_path / "cache", seed=0)
    for _ in range(5):
        check(dataset.sample(32))
    assert dataset.to_arrow().column("instruction").to_pylist() == store.to_arrow().column("instruction").to_pylist()
    heap = tmp_path / "cache" / _dataset_heaps.heap_fields(dataset.schema)["instruction"]
    assert heap.stat().st_size == sum(len(t.encode()) for t in TASKS)   # each distinct string once
    again = ab.open_dataset(export, cache_dir=tmp_path / "cache", seed=0)   # the cache, read back
    check(again.sample(64))


def test_strings_past_the_remembered_ones_are_written_per_batch_and_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(_dataset_heaps, "TEXT_REMEMBERED", 2)
    store = instructed()
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), cache_dir=tmp_path / "cache", seed=0)
    check(dataset.sample(128))
    assert dataset.to_arrow().column("instruction").to_pylist() == store.to_arrow().column("instruction").to_pylist()


def test_a_mixture_joins_a_dataset_s_instructions_with_an_online_store_s(tmp_path):
    dataset = ab.open_dataset(instructed().to_parquet(tmp_path / "export"), seed=0)
    mixture = ab.Mixture({"demos": dataset, "online": instructed(seed=1)}, weights={"demos": 0.5, "online": 0.5},
                         shuffle=True, seed=0)
    batch = mixture.sample(40)
    check(batch)
    assert batch["source"].bincount().tolist() == [20, 20]


def test_text_bytes_that_are_not_utf8_or_lie_outside_the_file_are_a_format_error_naming_the_row(tmp_path):
    data = np.frombuffer("ok".encode() + b"\xff\xfe", np.uint8)
    heap = MappedHeap(data, "instruction", tmp_path / "heap-0.bytes")
    assert text_column("instruction", np.array([[0, 2], [0, 2], [0, 0]]), heap)[np.arange(3)].tolist() == \
        ["ok", "ok", ""]
    with pytest.raises(ab.FormatError, match=r"field 'instruction', row 1: its bytes are not UTF-8"):
        text_column("instruction", np.array([[0, 2], [2, 2]]), heap)
    with pytest.raises(ab.FormatError, match="the cache is damaged"):
        text_column("instruction", np.array([[0, 2], [3, 9]]), heap)
