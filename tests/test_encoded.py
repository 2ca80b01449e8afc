"""Encoded fields (``ab.Field(..., codec=...)``): rows stored encoded, read and sampled decoded.

Frames are crops of a real photograph (matplotlib's bundled ``grace_hopper.jpg``) that pan like a
camera. Lossless codecs are compared with the raw store element by element on every path; JPEG by
its PSNR and its size.
"""

from __future__ import annotations

import glob

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf import byte_heap
from arrowbuf.byte_heap import ByteHeap
from arrowbuf.errors import FormatError, SchemaError

pytest.importorskip("simplejpeg")
pytest.importorskip("zstandard")

SIDE = 48


@pytest.fixture(scope="module")
def photo():
    from matplotlib import cbook
    from PIL import Image

    with Image.open(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)) as image:
        return np.asarray(image.convert("RGB"))


def frames(photo, episode: int, count: int, side: int = SIDE) -> np.ndarray:
    """``count`` crops that pan across the photo, from a start of the episode's own."""
    assert count <= 60
    y0, x0 = (37 * episode) % (photo.shape[0] - side - 180), (53 * episode) % (photo.shape[1] - side - 120)
    return np.stack([photo[y0 + 3 * t:y0 + 3 * t + side, x0 + 2 * t:x0 + 2 * t + side] for t in range(count)])


def schema(codec: str | None, side: int = SIDE) -> dict:
    return {"obs": ab.Field("uint8", (side, side, 3), observation=True, codec=codec), "action": ab.Field("int64"),
            "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}


def episode(photo, e: int, steps: int) -> dict:
    return {"obs": frames(photo, e, steps + 1), "action": np.arange(steps) + 100 * e,
            "reward": np.full(steps, e, np.float32), "terminated": np.r_[np.zeros(steps - 1, bool), True],
            "truncated": np.zeros(steps, bool)}


def filled(photo, codec: str | None, capacity: int = 400, lengths=(30, 12, 41, 25), seed: int = 0) -> ab.ExperienceStore:
    store = ab.ExperienceStore(capacity=capacity, schema=schema(codec), seed=seed)
    for e, steps in enumerate(lengths):
        store.add_episode(episode(photo, e, steps))
    return store


def expected_obs(photo, batch, shift: int = 0) -> np.ndarray:
    """The frames written for the batch's transitions, known by their action (100 x episode + step)."""
    action = batch["action"].numpy()
    return np.stack([frames(photo, e, s + shift + 1)[s + shift] for e, s in zip((action // 100).tolist(),
                                                                                (action % 100).tolist())])


def encoded_column(store: ab.ExperienceStore, name: str = "obs"):
    return store.engine.shard.arena[name]


@pytest.mark.parametrize("codec", ["zstd", "zstd:9", "png"])
def test_lossless_codecs_sample_exactly_what_the_raw_store_samples_with_every_lookup(photo, codec):
    raw, coded = filled(photo, None), filled(photo, codec)
    for kwargs in ({}, {"n_step": 3, "gamma": 0.9}, {"frame_stack": 3}):
        a, b = raw.sample(64, **kwargs), coded.sample(64, **kwargs)
        assert set(a.keys(include_nested=True, leaves_only=True)) == set(b.keys(include_nested=True, leaves_only=True))
        for key in a.keys(include_nested=True, leaves_only=True):
            assert a[key].dtype == b[key].dtype
            np.testing.assert_array_equal(a[key].numpy(), b[key].numpy(), err_msg=f"{codec} {kwargs} {key}")
    batch = coded.sample(32)
    np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs(photo, batch))
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), expected_obs(photo, batch, shift=1))
    seen = sum(len(b) for b in coded.iter_batches(16, shuffle=False))
    assert seen == len(coded) == 30 + 12 + 41 + 25


def test_a_step_writer_s_rows_are_encoded_once_and_a_ring_that_laps_frees_what_it_overwrote(photo, monkeypatch):
    monkeypatch.setattr(byte_heap, "CHUNK_BYTES", 64 << 10)   # small chunks: the ring laps many of them
    store = ab.ExperienceStore(capacity=120, schema=schema("zstd"), seed=1)
    num_envs, played = 3, 0
    writer = store.writer(num_envs=num_envs)
    ends = [7, 11, 16]   # each env's episodes have their own length
    t_in = np.zeros(num_envs, int)
    episode_of = np.arange(num_envs)
    for _ in range(400):
        obs = np.stack([frames(photo, int(e), int(t) + 1)[int(t)] for e, t in zip(episode_of, t_in)])
        nxt = np.stack([frames(photo, int(e), int(t) + 2)[int(t) + 1] for e, t in zip(episode_of, t_in)])
        done = t_in + 1 == np.array(ends)
        writer.add(obs=obs, action=episode_of * 100 + t_in, reward=episode_of.astype(np.float32),
                   terminated=done, truncated=np.zeros(num_envs, bool), next_obs=nxt)
        played += num_envs
        t_in += 1
        episode_of = np.where(done, episode_of + num_envs, episode_of)
        t_in[done] = 0
    writer.flush()
    assert len(store) == 120
    batch = store.sample(200)
    np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs(photo, batch))
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), expected_obs(photo, batch, shift=1))
    np.testing.assert_array_equal(batch["action"].numpy() % 100, batch["step"].numpy())
    column = encoded_column(store)
    heap = column.heap
    # Every byte held belongs to a row of the arena, and the chunks hold little more.
    assert heap.live == int(column.size.sum())
    assert heap.allocated <= 1.5 * heap.live + 2 * heap.chunk_bytes
    assert heap.allocated < played * 0.5 * int(column.size[column.size > 0].mean())


def test_jpeg_rows_keep_their_psnr_in_an_eighth_of_the_raw_bytes(photo):
    store = ab.ExperienceStore(capacity=2000, schema=schema("jpeg:90", side=224), seed=0)
    written = {e: frames(photo, e, 41, side=224) for e in range(8)}
    for e, rows in written.items():
        store.add_episode({"obs": rows, "action": np.arange(40), "reward": np.zeros(40, np.float32),
                           "terminated": np.r_[np.zeros(39, bool), True], "truncated": np.zeros(40, bool)})
    column = encoded_column(store)
    held = int((column.size > 0).sum())
    assert held == 8 * 41
    assert column.heap.live / (held * 224 * 224 * 3) <= 1 / 8
    batch = store.sample(256)
    got = batch["obs"].numpy().astype(np.float64)
    want = np.stack([written[e][s] for e, s in zip(batch["episode_id"].tolist(), batch["step"].tolist())]
                    ).astype(np.float64)
    psnr = 10 * np.log10(255.0 ** 2 / ((got - want) ** 2).reshape(len(got), -1).mean(axis=1))
    assert psnr.mean() >= 35 and psnr.min() >= 30, (psnr.mean(), psnr.min())


def test_exports_checkpoints_and_episodes_read_back_keep_the_encoded_bytes_as_they_were(photo, tmp_path):
    store = filled(photo, "jpeg:80")
    stored = store.to_arrow().column("obs").combine_chunks()
    assert stored.type == pa.large_binary()
    store.to_parquet(tmp_path / "export")
    imported = ab.ExperienceStore.from_parquet(tmp_path / "export")
    assert imported.schema.fields["obs"].codec == "jpeg:80"
    assert imported.to_arrow().column("obs").combine_chunks().equals(stored)   # not decoded and encoded again
    store.save(tmp_path / "checkpoint")
    loaded = ab.ExperienceStore.load(tmp_path / "checkpoint")
    assert loaded.to_arrow().column("obs").combine_chunks().equals(stored)
    copied = ab.ExperienceStore(capacity=400, schema=schema("jpeg:80"))
    for episode_id in store.episodes()["episode_id"].to_pylist():
        copied.add_episode(store.episode(episode_id))
    assert copied.to_arrow().column("obs").combine_chunks().equals(stored)
    assert store.sample(40)["obs"].shape == loaded.sample(40)["obs"].shape == (40, SIDE, SIDE, 3)
    # An encoded store's episodes go into a raw store decoded.
    raw = ab.ExperienceStore(capacity=400, schema=schema(None))
    raw.add_episode(store.episode(0))
    np.testing.assert_array_equal(raw.to_arrow().column("obs").combine_chunks().storage.flatten().to_numpy(),
                                  store.engine.shard.arena["obs"][np.arange(31)].reshape(-1))
    # The export's files are plain Parquet: the encoded field is a binary column with its codec and shape.
    files = sorted(glob.glob(str(tmp_path / "export" / "steps" / "*.parquet")))
    field = pq.read_schema(files[0]).field("obs")
    assert field.type == pa.large_binary() and field.metadata[b"arrowbuf.codec"] == b"jpeg:80"
    duckdb = pytest.importorskip("duckdb")
    sizes = duckdb.sql(f"select octet_length(obs) from read_parquet({files!r})").fetchall()
    assert sorted(s for (s,) in sizes) == sorted(len(v) for v in stored.to_pylist())


def test_max_bytes_evicts_the_oldest_episodes_to_hold_the_bytes_it_allows(photo, tmp_path):
    sizes = encoded_column(filled(photo, "png", lengths=(30,))).size
    budget = int(sizes.sum()) * 3   # about three episodes of 31 rows
    field = ab.Field("uint8", (SIDE, SIDE, 3), observation=True, codec="png", max_bytes=budget)
    store = ab.ExperienceStore(capacity=1000, schema={**schema("png"), "obs": field}, seed=0)
    for e in range(8):
        store.add_episode(episode(photo, e, 30))
        assert encoded_column(store).heap.live <= budget
    episodes = store.episodes()["episode_id"].to_pylist()
    assert 2 <= len(episodes) <= 3 and episodes == list(range(8 - len(episodes), 8))   # the newest, oldest gone
    assert len(store) == 30 * len(episodes)
    batch = store.sample(64)
    np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs(photo, batch))
    # A step writer's rows are bounded too; the budget travels with the schema.
    writer = store.writer(num_envs=2)
    for t in range(58):
        obs = np.stack([frames(photo, 20 + k, t + 1)[t] for k in range(2)])
        nxt = np.stack([frames(photo, 20 + k, t + 2)[t + 1] for k in range(2)])
        writer.add(obs=obs, action=np.array([2000 + t, 2100 + t]), reward=np.zeros(2, np.float32),
                   terminated=np.full(2, t % 20 == 19), truncated=np.zeros(2, bool), next_obs=nxt)
    writer.flush()
    assert encoded_column(store).heap.live <= budget
    batch = store.sample(64)
    np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs(photo, batch))
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), expected_obs(photo, batch, shift=1))
    store.save(tmp_path / "checkpoint")
    assert ab.ExperienceStore.load(tmp_path / "checkpoint").schema.fields["obs"].max_bytes == budget
    with pytest.raises(SchemaError, match="this field is neither"):
        ab.Field("uint8", (SIDE, SIDE, 3), max_bytes=10)
    with pytest.raises(ValueError, match="never evicts"):
        ab.ExperienceStore(capacity=100, schema={**schema("png"), "obs": field}, mode="fixed")


def test_keys_leave_encoded_fields_undecoded(photo, monkeypatch):
    store = filled(photo, "zstd")
    codec = encoded_column(store).codec
    calls = []
    decode = type(codec).decode
    monkeypatch.setattr(type(codec), "decode", lambda self, data, out: (calls.append(1), decode(self, data, out)))
    store.sample(32, keys=["action", "reward"])
    assert not calls
    batch = store.sample(32, keys=["obs"])
    assert len(calls) == len(np.unique(batch["index"].numpy()))   # a transition drawn twice is decoded once


def test_a_gather_decodes_each_distinct_row_once_and_copies_it_where_fields_and_frames_share_it(photo, monkeypatch):
    raw, coded = filled(photo, None), filled(photo, "zstd")
    column = encoded_column(coded)
    decoded = []
    decode = type(column.codec).decode
    monkeypatch.setattr(type(column.codec), "decode",
                        lambda self, data, out: (decoded.append(bytes(data)), decode(self, data, out)))
    for kwargs in ({}, {"frame_stack": 4}, {"frame_stack": 4, "keys": ["obs"]}):
        decoded.clear()
        a, b = raw.sample(64, **kwargs), coded.sample(64, **kwargs)
        np.testing.assert_array_equal(a["obs"].numpy(), b["obs"].numpy(), err_msg=str(kwargs))
        if "keys" not in kwargs:
            np.testing.assert_array_equal(a["next", "obs"].numpy(), b["next", "obs"].numpy(), err_msg=str(kwargs))
        # One decode per distinct frame: the batch's frames that differ are as many as the rows decoded.
        frames_read = np.concatenate([b["obs"].numpy().reshape(-1, SIDE * SIDE * 3)] + (
            [] if "keys" in kwargs else [b["next", "obs"].numpy().reshape(-1, SIDE * SIDE * 3)]))
        assert len(decoded) == len(set(decoded)) == len(np.unique(frames_read, axis=0))
        if kwargs.get("frame_stack"):
            assert len(decoded) < len(frames_read) / 2   # the 4 frames of a stack overlap the next stack's 3


@pytest.mark.parametrize("spec, message", [
    (("uint8", (SIDE, SIDE), "jpeg"), "shape (H, W, C)"),
    (("uint8", (SIDE, SIDE, 2), "jpeg"), "C in (1, 3)"),
    (("float32", (SIDE, SIDE, 3), "jpeg"), "float32"),
    (("uint8", (SIDE, SIDE, 3), "webp"), "unknown codec 'webp'"),
    (("uint8", (SIDE, SIDE, 3), "jpeg:0"), "[1, 100]"),
    (("uint8", (SIDE, SIDE, 3), "png:3"), "takes none"),
    (("uint8", (), "zstd"), "scalar"),
])
def test_a_codec_its_field_cannot_take_is_refused_with_the_fix(spec, message):
    dtype, shape, codec = spec
    with pytest.raises(SchemaError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        ab.Field(dtype, shape, observation=True, codec=codec)


def test_rows_of_another_shape_or_damaged_bytes_are_refused_and_leave_the_store_as_it_was(photo):
    store = filled(photo, "jpeg")
    before = store.to_arrow()
    bad = episode(photo, 9, 5)
    bad["obs"] = bad["obs"][:, :, :SIDE - 1]
    with pytest.raises(SchemaError, match=r"field 'obs': per-step shape \(48, 47, 3\)"):
        store.add_episode(bad)
    batch = store.episode(0)
    obs = batch.column("obs").to_pylist()
    obs[3] = obs[3][:len(obs[3]) - 100]   # cut short
    damaged = batch.set_column(0, batch.schema.field("obs"), pa.array(obs, pa.large_binary()))
    with pytest.raises(FormatError, match=r"field 'obs', row 3: .*cut short"):
        store.add_episode(damaged)
    obs[3] = b"\xff\xd8" + b"garbage" * 10 + b"\xff\xd9"
    with pytest.raises(FormatError, match=r"field 'obs', row 3: not a JPEG"):
        store.add_episode(batch.set_column(0, batch.schema.field("obs"), pa.array(obs, pa.large_binary())))
    assert store.to_arrow().equals(before)


def test_a_damaged_row_met_when_gathered_is_a_format_error_naming_the_field_and_row(photo):
    store = filled(photo, "zstd")
    column = encoded_column(store)
    row = int(np.flatnonzero(column.size)[5])
    column.heap.view(int(column.addr[row]), int(column.size[row]))[8:40] = 7   # bytes damaged in memory
    with pytest.raises(FormatError, match=rf"field 'obs', row {row} "):
        store.engine.shard.gatherer(np.array([row]))


def test_a_jpeg_row_of_another_size_met_when_gathered_is_a_format_error_naming_the_field_and_row(photo):
    import simplejpeg

    store = filled(photo, "jpeg")
    column = encoded_column(store)
    row = int(np.flatnonzero(column.size)[5])
    for side in ((SIDE // 2, SIDE // 2), (SIDE, SIDE - 8), (SIDE + 8, SIDE)):   # smaller ones fit the row's buffer
        small = simplejpeg.encode_jpeg(np.ascontiguousarray(photo[:side[0], :side[1]]), colorsubsampling="420")
        column.store(np.array([row]), [small])   # bytes no write stores: no check met them
        with pytest.raises(FormatError, match=rf"field 'obs', row {row} .*{side[0]}(x|, ){side[1]}"):
            store.engine.shard.gatherer(np.array([row]))


def test_an_encoded_store_needs_no_storage_device():
    pytest.importorskip("torch")
    with pytest.raises(SchemaError, match="storage_device=None"):
        ab.ExperienceStore(capacity=10, schema=schema("jpeg"), storage_device="cpu")


def test_a_ray_store_puts_encoded_rows_in_its_blocks_and_samples_them_exactly(photo, ray_session):
    import ray

    from arrowbuf.ray.options import NAMESPACE

    store = ab.ExperienceStore(capacity=400, schema=schema("png"), backend="ray", num_shards=2, seed=0)
    try:
        for e, steps in enumerate((30, 12, 41, 25)):
            store.add_episode(episode(photo, e, steps), env_id=f"env{e}")
        store.flush()
        batch = store.sample(64)
        np.testing.assert_array_equal(batch["obs"].numpy(), expected_obs(photo, batch))
        np.testing.assert_array_equal(batch["next", "obs"].numpy(), expected_obs(photo, batch, shift=1))
        handles = [ray.get_actor(f"{store.name}:{s}", namespace=NAMESPACE) for s in range(2)]

        def blocks(server):
            return [(type(c).__name__, c.nbytes) for b in server.blocks.blocks
                    for c in [ray.get(b.ref)["obs"] if b.part is None else ray.get(b.ref)[b.part]["obs"]]]

        held = [kind_bytes for h in handles for kind_bytes in ray.get(h.__ray_call__.remote(blocks))]
        assert held and all(kind == "EncodedRows" for kind, _ in held)
        assert sum(n for _, n in held) < 0.8 * (30 + 12 + 41 + 25 + 4) * SIDE * SIDE * 3   # PNG's size, not raw
    finally:
        store.close()


def test_the_codec_pool_shares_a_few_large_rows_with_the_caller_and_leaves_small_ones_to_it(monkeypatch):
    import threading

    from arrowbuf import codecs

    monkeypatch.setattr(codecs, "_threads", lambda: 2)
    frame, caller = 224 * 224 * 3, threading.current_thread().name
    for count in (2, 4, 8):   # large rows: two tasks, run at once by the caller and a pool thread
        half = count // 2
        both = threading.Barrier(2, timeout=60)   # passes only while a row of each task runs
        threads = [None] * count

        def work(i: int) -> None:
            threads[i] = threading.current_thread().name
            if i % half == 0:
                both.wait()

        codecs.map_rows(work, count, count * frame)
        first, second = set(threads[:half]), set(threads[half:])
        assert len(first) == len(second) == 1 and first != second and caller in first | second
        assert all(name == caller or name.startswith("arrowbuf-codec") for name in threads)
    for count, row_bytes in ((8, 48 * 48 * 3), (1, 4 * frame)):   # little work: all on the caller
        threads = [None] * count

        def work(i: int) -> None:
            threads[i] = threading.current_thread().name

        codecs.map_rows(work, count, count * row_bytes)
        assert set(threads) == {caller}

    def fails(i: int) -> None:
        if i in (1, 3):
            raise FormatError(f"row {i}")

    with pytest.raises(FormatError, match="row 1"):   # the first row's error, once every task ended
        codecs.map_rows(fails, 4, 4 * frame)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 300)), min_size=1, max_size=80))
def test_the_byte_heap_keeps_every_held_row_and_frees_chunks_that_empty(operations):
    heap, held, rng = ByteHeap(chunk_bytes=1024), {}, np.random.default_rng(0)
    for k, (release, size) in enumerate(operations):
        if release and held:
            key = sorted(held)[size % len(held)]
            addr, data = held.pop(key)
            heap.release(np.array([addr]), np.array([len(data)]))
        else:
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            addr, n = heap.append([data])
            held[k] = (int(addr[0]), data)
        assert heap.live == sum(len(d) for _, d in held.values())
        for addr, data in held.values():
            assert not data or heap.view(addr, len(data)).tobytes() == data
        # Chunks with no live row are freed, but for the one being filled.
        assert heap.allocated <= heap.live + (len({a >> 32 for a, d in held.values() if d}) + 1) * 1024 + 300


def test_a_durable_shard_s_log_replays_encoded_rows_as_they_were_stored(photo, tmp_path):
    from arrowbuf.durable import DurableShard
    from arrowbuf.engine import ShardEngine
    from arrowbuf.episode_read import read_episode
    from arrowbuf.schema import Schema

    def new_engine() -> ShardEngine:
        return ShardEngine(400, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=3)

    store_schema = Schema(schema("png"))
    durable = DurableShard(tmp_path)
    engine = durable.recover(new_engine)
    added = []
    for e, steps in enumerate((9, 14)):
        read, _ = read_episode(episode(photo, e, steps), store_schema)
        added.append((engine.add(read, store_schema), read))
    durable.commit(engine, added, None)
    durable.close()
    with DurableShard(tmp_path) as again:
        replayed = again.recover(new_engine)
    for episode_id in (0, 1):
        assert replayed.episode(episode_id).column("obs").equals(engine.episode(episode_id).column("obs"))
    rows = replayed.shard.arena["obs"][np.arange(10)]
    np.testing.assert_array_equal(rows, frames(photo, 0, 10))


def test_a_notebook_plots_an_encoded_field_s_frames_decoded(photo, tmp_path):
    pytest.importorskip("matplotlib")
    from arrowbuf.inspect import plot_frames

    store = filled(photo, "png", lengths=(9,))
    for source in (store, store.to_parquet(tmp_path / "export", progress=False)):
        figure = plot_frames(source, 0, max_frames=4)
        images = [ax.images[0] for ax in figure.axes if ax.images]
        np.testing.assert_array_equal(images[0].get_array(), frames(photo, 0, 1)[0])
        np.testing.assert_array_equal(images[-1].get_array(), frames(photo, 0, 10)[9])


def test_a_lossy_field_s_observation_chain_accepts_the_row_given_again_and_refuses_another(photo):
    store = ab.ExperienceStore(capacity=100, schema=schema("jpeg:90"), seed=0)
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    a, b = frames(photo, 0, 3), frames(photo, 1, 8)
    rest = dict(action=np.zeros(2, np.int64), reward=np.zeros(2, np.float32), truncated=np.zeros(2, bool))
    writer.add(obs=np.stack([a[0], b[0]]), next_obs=np.stack([a[1], b[1]]), terminated=np.array([False, True]), **rest)
    # env 0 goes on with the obs it was given (JPEG reads it back otherwise); env 1 was reset: a new first frame
    writer.add(obs=np.stack([a[1].copy(), b[5]]), next_obs=np.stack([a[2], b[6]]), terminated=np.zeros(2, bool), **rest)
    with pytest.raises(ab.ObservationMismatchError, match="env 0"):
        writer.add(obs=np.stack([b[7], b[6].copy()]), next_obs=np.stack([a[2], b[7]]), terminated=np.zeros(2, bool),
                   **rest)
    assert len(store) == 4   # env 0: 2 open steps; env 1: 1 sealed, 1 open; the refused step left nothing
