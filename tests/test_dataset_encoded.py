"""Encoded and ragged fields in offline datasets: the cache keeps their rows as stored (an encoded
field's bytes, a ragged field's values), decoded or gathered as nested tensors when sampled.

Images are crops of a real photograph (matplotlib's ``grace_hopper.jpg``) that pan like a camera;
every sampled row is compared element by element with the store that wrote it, or with the frames
written (a transition's action is 100 x episode + step).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

import arrowbuf as ab
from arrowbuf._dataset_heaps import MappedHeap
from arrowbuf import _dataset_cache
from arrowbuf._persist import CHECKSUM, file_digest, write_manifest
from arrowbuf.errors import FormatError

pytest.importorskip("simplejpeg")

SIDE = 32
LENGTHS = (30, 12, 41, 25)
HEAP_ROW = 16   # bytes rows.arrow holds per row of an encoded or ragged field: its (offset, size)


@pytest.fixture(scope="module")
def photo():
    from matplotlib import cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as image:
        return np.asarray(image.convert("RGB"))


def frames(photo, episode: int, count: int) -> np.ndarray:
    """``count`` crops that pan across the photo, from a start of the episode's own."""
    y0, x0 = (37 * episode) % (photo.shape[0] - SIDE - 180), (53 * episode) % (photo.shape[1] - SIDE - 120)
    return np.stack([photo[y0 + 3 * t:y0 + 3 * t + SIDE, x0 + 2 * t:x0 + 2 * t + SIDE] for t in range(count)])


def image_store(photo, codec: str | None, lengths=LENGTHS, first: int = 0, seed: int = 0) -> ab.ExperienceStore:
    """Episodes ``first``, ``first + 1``...; the third has no final observation."""
    schema = {"obs": ab.Field("uint8", (SIDE, SIDE, 3), observation=True, codec=codec), "action": ab.Field("int64"),
              "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
    store = ab.ExperienceStore(capacity=1_000, schema=schema, seed=seed)
    for k, steps in enumerate(lengths):
        e = first + k
        store.add_episode({"obs": frames(photo, e, steps + (k != 2)), "action": np.arange(steps) + 100 * e,
                           "reward": np.full(steps, e, np.float32), "terminated": np.arange(steps) == steps - 1,
                           "truncated": np.zeros(steps, bool)})
    return store


def same(a, b) -> None:
    assert set(a.keys(True, True)) == set(b.keys(True, True))
    for key in a.keys(True, True):
        if a[key].is_nested:
            assert torch.equal(a[key].offsets(), b[key].offsets()) and torch.equal(a[key].values(), b[key].values())
        else:
            assert torch.equal(a[key], b[key]), key


def check_frames(photo, batch) -> None:
    """Every row's observation and next observation are the frames written at its step."""
    action = batch["action"].numpy()
    for i, (e, t) in enumerate(zip((action // 100).tolist(), (action % 100).tolist())):
        written = frames(photo, e, t + 2)
        np.testing.assert_array_equal(batch["obs"][i].numpy(), written[t])
        np.testing.assert_array_equal(batch["next", "obs"][i].numpy(), written[t + 1])


def cache_of(export: Path) -> tuple[Path, dict]:
    cache = export / ".arrowbuf-cache"
    return cache, json.loads((cache / _dataset_cache.MANIFEST).read_text())


def test_a_png_field_is_cached_as_its_bytes_and_samples_exactly_as_the_store_does(tmp_path, photo):
    store = image_store(photo, "png")
    export = store.to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, seed=0)
    for kwargs in ({}, {"n_step": 3, "gamma": 0.9}, {"frame_stack": 3}):
        for _ in range(3):   # the same seed draws the same transitions
            same(dataset.sample(64, **kwargs), store.sample(64, **kwargs))
    index = np.arange(len(store))
    every = dataset.gather(index)
    same(every, store.gather(index))
    check_frames(photo, every)
    for batch in dataset.iter_batches(50, shuffle=True):
        check_frames(photo, batch)

    # The cache holds the export's bytes of each row, and 16 bytes a row of where they are: no pixel.
    cache, manifest = cache_of(export)
    rows = manifest["num_rows"]
    encoded = int(pc.sum(pc.binary_length(store.to_arrow().column("obs"))).as_py())
    assert manifest["format_version"] == 4 and (cache / manifest["heaps"]["obs"]).stat().st_size == encoded
    small = HEAP_ROW + 8 + 4 + 1 + 1   # obs's reference, action, reward, the flags
    assert (cache / "rows.arrow").stat().st_size < rows * small + 4096
    raw = rows * SIDE * SIDE * 3
    assert encoded < 0.8 * raw and dataset.nbytes < encoded + rows * small + 4096
    decoded = ab.open_dataset(image_store(photo, None).to_parquet(tmp_path / "raw"))
    assert decoded.nbytes > raw > 1.25 * dataset.nbytes


def test_jpeg_rows_read_back_as_the_store_decodes_them_and_export_their_bytes(tmp_path, photo):
    store = image_store(photo, "jpeg:80")
    dataset = ab.open_dataset(store.to_parquet(tmp_path / "export"), seed=3)
    index = np.arange(len(store))
    same(dataset.gather(index), store.gather(index))        # the same bytes through the same decoder
    assert dataset.to_arrow().equals(store.to_arrow())        # the stored binary column, as a store's
    ids = store.episodes().column("episode_id").to_pylist()
    for episode_id in ids:
        assert dataset.episode(episode_id).equals(store.episode(episode_id))
    assert dataset.to_arrow().schema.field("obs").type == pa.large_binary()


def test_keys_that_leave_the_encoded_field_out_decode_nothing(tmp_path, photo, monkeypatch):
    dataset = ab.open_dataset(image_store(photo, "png").to_parquet(tmp_path / "export"), seed=0)
    codec = dataset.engine.shard.arena["obs"].codec

    def refuse(self, data, out):
        raise AssertionError("decoded a row")

    monkeypatch.setattr(type(codec), "decode", refuse)
    batch = dataset.sample(64, keys=["action", "reward"])
    assert "obs" not in batch.keys() and batch["action"].shape == (64,)
    assert dataset.sample(16, keys=["reward"], n_step=3)["reward"].shape == (16,)
    assert sum(len(b) for b in dataset.iter_batches(40, keys=["action"])) == len(dataset)
    with pytest.raises(AssertionError, match="decoded a row"):
        dataset.sample(8)


def _ipc_directory(path: Path, rows: pa.Table, episodes: pa.Table) -> Path:
    path.mkdir()
    for name, table in (("rows.arrow", rows), ("episodes.arrow", episodes)):
        with pa.OSFile(str(path / name), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    return path


def test_a_damaged_row_is_a_format_error_naming_the_field_and_row_and_the_rest_still_samples(tmp_path, photo):
    store = image_store(photo, "png")
    table = store.to_arrow()
    obs = table.column("obs").to_pylist()
    row = LENGTHS[0] + 1 + 5          # episode 1's step 5 (episode 0 has 30 steps and its final row)
    damaged = bytearray(obs[row])
    damaged[len(damaged) // 2:len(damaged) // 2 + 8] = bytes(8)   # header and end intact: it passes the checks
    obs[row] = bytes(damaged)
    at = table.schema.get_field_index("obs")
    table = table.set_column(at, table.schema.field("obs"), pa.array(obs, pa.large_binary()))
    dataset = ab.open_dataset(_ipc_directory(tmp_path / "ipc", table, store.episodes()))
    transition = LENGTHS[0] + 5       # the transition at that row; the one before reads it as its next
    for index in (transition, transition - 1):
        with pytest.raises(FormatError, match=rf"field 'obs', row {row} \(encoded by 'png'\): not a PNG"):
            dataset.gather(np.array([index]))
    check_frames(photo, dataset.gather(np.array([transition + 1, transition - 2])))
    assert dataset.sample(256, keys=["action"])["action"].shape == (256,)


def test_damage_to_a_heap_file_is_refused_at_open(tmp_path, photo):
    export = image_store(photo, "png").to_parquet(tmp_path / "export")
    ab.open_dataset(export)
    cache, manifest = cache_of(export)
    heap = cache / manifest["heaps"]["obs"]
    data = bytearray(heap.read_bytes())
    data[len(data) // 3] ^= 0x10
    heap.write_bytes(bytes(data))
    with pytest.raises(FormatError, match="heap-0.bytes: its content differs from the cache's recorded SHA-256"):
        ab.open_dataset(export, rebuild=False)
    heap.write_bytes(bytes(data[:-10]))
    with pytest.raises(FormatError, match="heap-0.bytes: .* bytes, the cache's manifest says"):
        ab.open_dataset(export, rebuild=False)


def _rerecord(cache: Path, name: str) -> None:
    """Record ``name``'s current stat and hash in the manifest: damage that no open would see (bit rot)."""
    path = cache / _dataset_cache.MANIFEST
    manifest = json.loads(path.read_text())
    manifest["files"][name].update(_dataset_cache._stat_entry((cache / name).stat()), sha256=file_digest(cache / name))
    write_manifest(path, {k: v for k, v in manifest.items() if k != CHECKSUM})


def _references(cache: Path, field: str) -> tuple[int, int]:
    """(where field's (offset, size) rows start in rows.arrow, its rows)."""
    with pa.memory_map(str(cache / "rows.arrow")) as mapped:
        whole = mapped.read_buffer()
        column = pa.ipc.open_file(pa.BufferReader(whole)).get_batch(0).column(field)
        return column.buffers()[1].address - whole.address, len(column)


@pytest.mark.parametrize("field", ["obs", "tokens"])
def test_a_reference_past_its_heap_file_is_a_format_error_never_a_read_past_the_mapping(tmp_path, photo, field):
    store = image_store(photo, "zstd") if field == "obs" else ragged_store()
    export = store.to_parquet(tmp_path / "export")
    ab.open_dataset(export)
    cache, manifest = cache_of(export)
    start, rows = _references(cache, field)
    refs = np.fromfile(cache / "rows.arrow", np.int64, count=2 * rows, offset=start).reshape(rows, 2)
    row = int(np.flatnonzero(refs[:, 1])[3])
    bad = {0: (refs[row, 0] + (1 << 40), refs[row, 1]), 1: (refs[row, 0], -8), 2: (refs[row, 0], refs[row, 1] + 1)}
    size = (cache / manifest["heaps"][field]).stat().st_size
    for case, ref in bad.items():
        if case == 2 and field == "obs":
            ref = (size - 4, 8)       # an encoded row of any size, but past the end
        with open(cache / "rows.arrow", "r+b") as f:
            f.seek(start + 16 * row)
            f.write(np.array(ref, np.int64).tobytes())
        _rerecord(cache, "rows.arrow")
        dataset = ab.open_dataset(export, rebuild=False)
        with pytest.raises(FormatError, match=rf"field '{field}' has a row at bytes .* the cache is damaged"):
            dataset.gather(np.arange(len(dataset)))
        dataset.close()


def test_a_mixture_samples_an_encoded_dataset_beside_a_raw_or_encoded_online_store(tmp_path, photo):
    dataset = ab.open_dataset(image_store(photo, "png").to_parquet(tmp_path / "export"), seed=0)
    for codec in (None, "png"):
        online = image_store(photo, codec, lengths=(20, 15, 18), first=10, seed=1)
        mixture = ab.Mixture({"demos": dataset, "online": online}, weights={"demos": 0.5, "online": 0.5}, seed=0)
        for kwargs in ({}, {"device": "cpu"}, {"n_step": 2}):   # one pooled batch; each source's batch joined
            batch = mixture.sample(32, **kwargs)
            assert batch["source"].bincount().tolist() == [16, 16]
            assert ((batch["action"] >= 1000) == (batch["source"] == 1)).all()
            if not kwargs.get("n_step"):
                check_frames(photo, batch)


# -- ragged fields ------------------------------------------------------------------------------


def tokens(episode: int, step: int) -> np.ndarray:
    """The sequence written at (episode, step): its length and values say where it came from."""
    return (np.arange((7 * episode + 3 * step) % 13) + 1000 * episode + 10 * step).astype(np.int32)


def points(episode: int, step: int) -> np.ndarray:
    return np.full(((episode + step) % 4, 3), episode + step / 10, np.float32)


def ragged_store(episodes=((0, 9), (1, 14), (2, 5), (3, 11))) -> ab.ExperienceStore:
    schema = {"obs": ab.Field("float32", (2,), observation=True), "tokens": ab.Field("int32", (None,)),
              "points": ab.Field("float32", (None, 3)), "action": ab.Field("int64"), "reward": ab.Field("float32"),
              "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
    store = ab.ExperienceStore(capacity=500, schema=schema, seed=0)
    for e, steps in episodes:
        store.add_episode({"obs": np.full((steps + 1, 2), e, np.float32), "tokens": [tokens(e, t) for t in range(steps)],
                           "points": [points(e, t) for t in range(steps)], "action": np.arange(steps) + 100 * e,
                           "reward": np.ones(steps, np.float32), "terminated": np.arange(steps) == steps - 1,
                           "truncated": np.zeros(steps, bool)})
    return store


def check_ragged(batch) -> None:
    """Every row's sequences are the ones written at its (episode, step), known by its action."""
    assert batch["tokens"].layout == torch.jagged and batch["points"].dtype == torch.float32
    for key, written in (("tokens", tokens), ("points", points)):
        offsets, values = batch[key].offsets().numpy(), batch[key].values().numpy()
        for i, a in enumerate(batch["action"].tolist()):
            np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], written(a // 100, a % 100))


def test_ragged_fields_are_cached_as_their_values_and_sample_as_the_store_s_nested_tensors(tmp_path):
    store = ragged_store()
    export = store.to_parquet(tmp_path / "export")
    dataset = ab.open_dataset(export, seed=0)
    for kwargs in ({}, {"n_step": 3, "gamma": 0.9}):
        for _ in range(3):
            batch = dataset.sample(32, **kwargs)
            same(batch, store.sample(32, **kwargs))
            check_ragged(batch)
    index = np.arange(len(store))
    same(dataset.gather(index), store.gather(index))
    padded = dataset.sample(16, pad={"tokens": -1})
    lengths = padded["tokens_length"].numpy()
    assert padded["tokens"].shape == (16, lengths.max())
    for row, length, a in zip(padded["tokens"].numpy(), lengths, padded["action"].tolist()):
        np.testing.assert_array_equal(row[:length], tokens(a // 100, a % 100))
        assert (row[length:] == -1).all()
    epoch = list(dataset.iter_batches(10, shuffle=False, pad={"points": 0.0}))
    assert sum(len(b) for b in epoch) == len(store) and epoch[0]["points"].ndim == 3
    for batch in dataset.iter_batches(10):
        check_ragged(batch)
    assert dataset.to_arrow().equals(store.to_arrow())
    for episode_id in store.episodes().column("episode_id").to_pylist():
        assert dataset.episode(episode_id).equals(store.episode(episode_id))
    check_ragged(dataset.sample(8, frame_stack=2))   # a step field: read at the step's row
    windows = ab.open_dataset(export, sampler=ab.SequenceSampler(seq_len=3))
    with pytest.raises(ValueError, match="one row per item, not in sequences; leave them out with keys="):
        windows.sample(4)
    assert windows.sample(4, keys=["action"])["action"].shape == (4, 3)
    with pytest.raises(ValueError, match="not a ragged field"):
        dataset.sample(4, pad={"obs": 0})

    cache, manifest = cache_of(export)
    table = store.to_arrow()
    for field, item in (("tokens", 4), ("points", 12)):
        values = int(pc.sum(pc.list_value_length(table.column(field))).as_py())
        assert (cache / manifest["heaps"][field]).stat().st_size == values * item
    assert (cache / "rows.arrow").stat().st_size < manifest["num_rows"] * (2 * HEAP_ROW + 8 + 8 + 4 + 2) + 4096


def test_an_arrow_ipc_directory_with_ragged_fields_opens_like_its_store(tmp_path):
    store = ragged_store()
    dataset = ab.open_dataset(_ipc_directory(tmp_path / "ipc", store.to_arrow(), store.episodes()), seed=0)
    same(dataset.sample(32), store.sample(32))


def test_a_mixture_joins_a_ragged_dataset_s_sequences_with_an_online_store_s(tmp_path):
    dataset = ab.open_dataset(ragged_store().to_parquet(tmp_path / "export"), seed=0)
    online = ragged_store(episodes=((10, 7), (11, 9)))
    mixture = ab.Mixture({"demos": dataset, "online": online}, weights={"demos": 0.5, "online": 0.5}, seed=0,
                         shuffle=True)
    batch = mixture.sample(8)
    check_ragged(batch)   # each row's tokens and points are its own step's, whichever source drew it
    assert batch["source"].bincount().tolist() == [4, 4]
    batch = mixture.sample(8, keys=["obs", "action"])
    assert "tokens" not in batch.keys() and batch["source"].bincount().tolist() == [4, 4]


def test_a_cache_of_an_older_format_keeps_the_encoded_field_decoded_and_still_reads(tmp_path, photo, monkeypatch):
    store = image_store(photo, "png")
    export = store.to_parquet(tmp_path / "export")
    monkeypatch.setattr(_dataset_cache, "FORMAT_VERSION", 3)
    ab.open_dataset(export, cache_dir=tmp_path / "v3")
    monkeypatch.undo()
    manifest = json.loads((tmp_path / "v3" / _dataset_cache.MANIFEST).read_text())
    assert manifest["format_version"] == 2 and "heaps" not in manifest          # as caches before heaps were
    old = ab.open_dataset(export, cache_dir=tmp_path / "v3", seed=0)           # read by this version
    assert old.nbytes > len(store) * SIDE * SIDE * 3
    index = np.arange(len(store))
    same(old.gather(index), store.gather(index))


def test_a_damaged_heap_reference_whose_end_wraps_past_int64_is_a_format_error_not_an_empty_row(tmp_path):
    # addr + size of such a reference wraps negative in int64: it must not read as a row of no bytes
    heap = MappedHeap(np.arange(16, dtype=np.uint8), "pixels", tmp_path / "heap-0.bytes")
    assert [bytes(v) for v in heap.views(np.array([0, 4]), np.array([4, 0]))] == [bytes([0, 1, 2, 3]), b""]
    for addr, size in ((2**63 - 5, 10), (12, 8), (-1, 2)):
        with pytest.raises(ab.FormatError, match="the cache is damaged"):
            heap.views(np.array([0, addr], np.int64), np.array([4, size], np.int64))
