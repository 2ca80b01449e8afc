"""Ragged and text fields on the Ray backend, and in add_episodes: every path gives back, element by element,
what was written, as an embedded store with the same contents does (sample, epochs, pad=, keys=, reads by
index and by reference, ranks, checkpoints, exports)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import arrowbuf as ab
from arrowbuf.errors import SchemaError

from test_ragged import tokens

pytestmark = pytest.mark.usefixtures("ray_session")

SCHEMA = {"obs": ab.Field("float32", (2,), observation=True), "tokens": ab.Field("int32", (None,)),
          "instruction": ab.Field("string"), "action": ab.Field("int64"), "reward": ab.Field("float32"),
          "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}


def instruction(e: int) -> str:
    return f"stack block {e}" + " gently" * (e % 3)


def episode(e: int, steps: int, form: str = "list") -> dict:
    """Episode ``e``: action 100 e + t says where each row came from (its tokens, its instruction)."""
    seqs = [tokens(e, t) for t in range(steps)]
    if form == "nested":
        seqs = torch.nested.nested_tensor([torch.from_numpy(s) for s in seqs], layout=torch.jagged)
    return {"obs": np.zeros((steps + 1, 2), np.float32), "tokens": seqs, "instruction": [instruction(e)] * steps,
            "action": np.arange(steps) + 100 * e, "reward": np.full(steps, e, np.float32),
            "terminated": np.arange(steps) == steps - 1, "truncated": np.zeros(steps, bool)}


def batch_of(episodes: list[int], steps: int) -> dict:
    """``add_episodes``' input: stacked fields [E, T, ...], ragged and text fields one value per episode."""
    one = [episode(e, steps) for e in episodes]
    stacked = {k: np.stack([ep[k] for ep in one]) for k in ("obs", "action", "reward", "terminated", "truncated")}
    return stacked | {"tokens": [ep["tokens"] for ep in one], "instruction": [ep["instruction"] for ep in one]}


def write(store: ab.ExperienceStore) -> list[int]:
    """The same contents into any store: add_episode (two input forms), add_episodes, and a staged writer
    (a Ray writer, or a mode='fixed' store's) of 2 envs; the actions written."""
    for e, steps in ((0, 9), (1, 14), (2, 5)):
        store.add_episode(episode(e, steps, ("list", "nested")[e % 2]))
    store.add_episodes(batch_of([3, 4, 5], 6), lengths=[6, 2, 4])
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    for t in range(12):   # env 0 ends an episode at t = 6 and starts another, env 1 runs on until flush()
        writer.add(obs=np.zeros((2, 2), np.float32), tokens=[tokens(7 + e, t) for e in range(2)],
                   instruction=[instruction(7 + e) for e in range(2)], action=np.array([700 + t, 800 + t]),
                   reward=np.zeros(2, np.float32), terminated=np.array([t == 6, False]),
                   truncated=np.zeros(2, bool), next_obs=np.zeros((2, 2), np.float32))
    writer.flush()
    store.flush()
    return [100 * e + t for e, n in ((0, 9), (1, 14), (2, 5), (3, 6), (4, 2), (5, 4), (7, 12), (8, 12))
            for t in range(n)]


def check(batch, padded: bool = False) -> None:
    """Every row's tokens and instruction are those written at its (episode, step), known by its action."""
    action = batch["action"].tolist()
    assert list(batch["instruction"]) == [instruction(a // 100) for a in action]
    if padded:
        dense, lengths = batch["tokens"].numpy(), batch["tokens_length"].numpy()
        assert dense.shape == (len(action), lengths.max(initial=0)) and dense.dtype == np.int32
        for row, n, a in zip(dense, lengths, action):
            np.testing.assert_array_equal(row[:n], tokens(a // 100, a % 100))
            assert (row[n:] == -1).all()
        return
    nested = batch["tokens"]
    assert nested.layout == torch.jagged and nested.dtype == torch.int32
    offsets, values = nested.offsets().numpy(), nested.values().numpy()
    assert len(offsets) == len(action) + 1
    for i, a in enumerate(action):
        np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], tokens(a // 100, a % 100))


@pytest.fixture(scope="module")
def stores():
    """(a Ray store of 2 shards, an embedded one of the same contents, the actions written)."""
    ray_store = ab.ExperienceStore(capacity=500, schema=SCHEMA, backend="ray", num_shards=2, seed=0)
    local = ab.ExperienceStore(capacity=500, schema=SCHEMA, seed=0, mode="fixed")   # its writer stages too
    written = write(ray_store)
    assert write(local) == written
    yield ray_store, local, written
    ray_store.close()


def test_samples_epochs_pad_and_keys_give_what_was_written_as_a_local_store_gives_it(stores):
    store, local, written = stores
    assert len(store) == len(local) == len(written) and store.num_episodes == local.num_episodes == 9
    check(store.sample(64))
    check(next(iter(store.sample_iter(32))))
    check(store.sample(48, pad={"tokens": -1}), padded=True)
    seen = []
    for batch in store.iter_batches(24):
        check(batch)
        seen += batch["action"].tolist()
    assert sorted(seen) == sorted(written)   # every transition once
    for keys in (["tokens"], ["instruction", "action"], ["action"]):
        assert sorted(store.sample(8, keys=keys).keys()) == sorted(local.sample(8, keys=keys).keys())
    ray_batch, local_batch = store.sample(16), local.sample(16)
    def kinds(batch) -> dict:   # every leaf's key, type and dtype
        return {str(k): (type(v).__name__, getattr(v, "dtype", None))
                for k, v in batch.items(include_nested=True, leaves_only=True)}

    assert kinds(ray_batch) == kinds(local_batch)
    with pytest.raises(ValueError, match="one row per item"):
        store.gather_refs([np.zeros((2, 2), np.int64)])
    copying = ab.ExperienceStore.attach(store.name, ray_options=ab.RayOptions(copy_blocks=True))
    check(copying.sample(32))   # blocks copied into this process's memory, as from another node


def test_reads_by_index_and_by_reference_give_each_row_s_own_values(stores):
    from arrowbuf.ray import resolve

    store, local, _ = stores
    index = store.sample(40)["index"]
    assert len(np.unique(index.numpy() >> 48)) == 2   # both shards: the parts are put in order
    again = store.gather(index)
    check(again)
    assert again["index"].equal(index)
    refs = store.gather_refs([index, index[:5]])
    check(resolve(refs[0]))
    check(resolve(refs[1]))
    empty = store.gather(np.zeros(0, np.int64))
    assert empty.batch_size[0] == 0 and empty["tokens"].dtype == torch.int32


def test_each_rank_gathers_its_share_and_the_shares_make_every_global_batch_once(stores):
    store, _, written = stores
    world = 3
    whole = ab.ExperienceStore.attach(store.name, seed=7)   # one handle per rank process, seeded alike
    ranks = [ab.ExperienceStore.attach(store.name, seed=7) for _ in range(world)]
    global_batches = [b["action"].tolist() for b in whole.iter_batches(24)]
    shares = [list(h.iter_batches(24, world_size=world, rank=r, balance="tokens")) for r, h in enumerate(ranks)]
    assert all(len(s) == len(global_batches) for s in shares)
    for k, actions in enumerate(global_batches):
        parts = [shares[r][k] for r in range(world)]
        for part in parts:
            check(part)
        assert sorted(a for p in parts for a in p["action"].tolist()) == sorted(actions)
        totals = [int(p["tokens"].offsets()[-1]) for p in parts]
        longest = max(len(tokens(a // 100, a % 100)) for a in actions)
        assert max(totals) - min(totals) <= longest   # largest first: within one row of each other
    assert sorted(a for s in shares for b in s for a in b["action"].tolist()) == sorted(written)
    grouped = ab.ExperienceStore(capacity=10, schema=SCHEMA, backend="ray", num_shards=1,
                                 sampler=ab.GroupSampler("action", group_size=2))
    try:
        with pytest.raises(ValueError, match="GroupSampler.*do not keep groups together"):
            grouped.iter_batches(4, world_size=2, rank=0)
    finally:
        grouped.close()


def test_checkpoints_and_exports_of_a_ray_store_keep_every_sequence_and_string(stores, tmp_path):
    store, _, written = stores
    store.save(tmp_path / "checkpoint")
    loaded = ab.ExperienceStore.load(tmp_path / "checkpoint")
    try:
        assert loaded.backend == "ray" and len(loaded) == len(written)
        check(loaded.sample(64))
    finally:
        loaded.close()
    store.to_parquet(tmp_path / "export")
    imported = ab.ExperienceStore.from_parquet(tmp_path / "export")
    assert imported.schema.fields["tokens"] == SCHEMA["tokens"] and len(imported) == len(written)
    seen = []
    for batch in imported.iter_batches(32):
        check(batch)
        seen += batch["action"].tolist()
    assert sorted(seen) == sorted(written)


def test_bad_sequences_and_strings_are_refused_naming_the_field_and_leave_the_store_unchanged(stores):
    store, local, _ = stores
    for target in (store, local):
        before = len(target), target.num_episodes
        bad_tokens = batch_of([9, 10], 3)
        bad_tokens["tokens"][1] = [np.zeros((2, 2), np.int32)] * 3   # a 2-D row for a (None,) field
        bad_text = batch_of([9, 10], 3)
        bad_text["instruction"][0] = ["a", 3, "b"]
        for bad, message in ((bad_tokens, "episode 1: field 'tokens'"),
                             (bad_text, "episode 0: field 'instruction'.*mixes strings")):
            with pytest.raises(SchemaError, match=message):
                target.add_episodes(bad)
        writer = target.writer(num_envs=2)
        with pytest.raises(SchemaError, match="field 'tokens'"):
            writer.add(obs=np.zeros((2, 2), np.float32), tokens=[np.zeros(3, np.float64), np.zeros(1, np.float64)],
                       instruction=["a", "b"], action=np.zeros(2, np.int64), reward=np.zeros(2, np.float32),
                       terminated=np.ones(2, bool), truncated=np.zeros(2, bool), next_obs=np.zeros((2, 2), np.float32))
        writer.close()
        target.flush()
        assert (len(target), target.num_episodes) == before


def test_add_episodes_takes_every_ragged_form_and_inference_finds_ragged_and_text_fields():
    store = ab.ExperienceStore(capacity=200, seed=0)   # no schema: inferred from the first call
    data = batch_of([0, 1, 2], 5)
    data["tokens"][1] = torch.nested.nested_tensor([torch.from_numpy(tokens(1, t)) for t in range(5)],
                                                   layout=torch.jagged)
    ids = store.add_episodes(data, lengths=[5, 3, 4], env_ids=["a", "b", "c"])
    assert len(ids) == 3 and len(store) == 12
    assert store.schema.fields["tokens"] == ab.Field("int32", (None,))
    assert store.schema.fields["instruction"] == ab.Field("string")
    same = {k: v for k, v in batch_of([4, 5], 3).items() if k not in ("tokens", "instruction")}
    same["tokens"] = np.stack([np.stack([np.full(2, 400 + k, np.int32)] * 3) for k in range(2)])   # [E, T, L]
    same["instruction"] = np.array([[instruction(4)] * 3, [instruction(5)] * 3])                 # [E, T] str
    store.add_episodes(same)
    batch = store.gather(np.arange(len(store)))
    actions = batch["action"].tolist()
    offsets, values = batch["tokens"].offsets().numpy(), batch["tokens"].values().numpy()
    for i, a in enumerate(actions):
        e, t = divmod(a, 100)
        expected = tokens(e, t) if e < 4 else np.full(2, 400 + e - 4, np.int32)
        np.testing.assert_array_equal(values[offsets[i]:offsets[i + 1]], expected)
    assert list(batch["instruction"]) == [instruction(a // 100) for a in actions]
    assert sorted(actions) == sorted([100 * e + t for e, n in ((0, 5), (1, 3), (2, 4), (4, 3), (5, 3))
                                      for t in range(n)])


@pytest.mark.parametrize("mode", ["circular", "fixed", "ray"])   # steps written in place, staged, shipped in pieces
def test_a_checkpoint_keeps_a_writer_s_open_sequences_and_strings_and_its_writer_goes_on(tmp_path, mode):
    store = ab.ExperienceStore(capacity=200, schema=SCHEMA, seed=0, mode="circular" if mode == "ray" else mode,
                               **({"backend": "ray", "num_shards": 1} if mode == "ray" else {}))

    def step(writer, t: int) -> None:   # env 0 ends an episode at t = 3; env 1 never ends before flush()
        writer.add(obs=np.zeros((2, 2), np.float32), tokens=[tokens(7 + e, t) for e in range(2)],
                   instruction=[instruction(7 + e) for e in range(2)], action=np.array([700 + t, 800 + t]),
                   reward=np.zeros(2, np.float32), terminated=np.array([t == 3, False]),
                   truncated=np.zeros(2, bool), next_obs=np.zeros((2, 2), np.float32))

    writer = store.writer(num_envs=2, name="runner", autoreset_mode="disabled")
    for t in range(6):
        step(writer, t)
    store.save(tmp_path / mode)
    if mode == "ray":
        store.close()
    loaded = ab.ExperienceStore.load(tmp_path / mode)
    try:
        resumed = loaded.writer(num_envs=2, name="runner", autoreset_mode="disabled")
        for t in range(6, 9):
            step(resumed, t)
        resumed.flush()
        loaded.flush()
        seen = []
        for batch in loaded.iter_batches(8):
            check(batch)
            seen += batch["action"].tolist()
        assert sorted(seen) == sorted([700 + t for t in range(9)] + [800 + t for t in range(9)])
        assert loaded.num_episodes == 3   # env 1's steps before and after the save are one episode
    finally:
        loaded.close()


def test_a_writer_state_s_staged_sequences_and_strings_read_back_as_saved_and_bad_ones_are_refused():
    from arrowbuf.row_stage import RowStage

    stage = RowStage((2, 3), SCHEMA["tokens"], "tokens")
    stage[np.array([0, 1]), np.array([0, 2])] = [tokens(1, 1), tokens(2, 2)]
    saved = stage.saved()
    back = RowStage.from_saved(saved, SCHEMA["tokens"], "tokens")
    assert [len(r) for r in back.cells.reshape(-1)] == [10, 0, 0, 0, 0, 7]
    np.testing.assert_array_equal(back[1, :3].values, tokens(2, 2))
    lengths, values = saved["lengths"], saved["values"]
    for bad in ({"lengths": lengths, "values": values[:-1]}, {"lengths": -lengths, "values": values},
                {"values": values}, {"lengths": lengths, "values": values.astype(np.float32)}):
        with pytest.raises(ValueError, match="field 'tokens'"):
            RowStage.from_saved(bad, SCHEMA["tokens"], "tokens")
    texts = RowStage((1, 2), SCHEMA["instruction"], "instruction")
    texts[0, 1] = "open the drawer"
    back = RowStage.from_saved(texts.saved(), SCHEMA["instruction"], "instruction")
    assert list(back[0, :2]) == ["", "open the drawer"]
    with pytest.raises(ValueError, match="field 'instruction'"):
        RowStage.from_saved({"codes": np.array([[0, 5]]), "strings": ["a"]}, SCHEMA["instruction"], "instruction")


def test_a_durable_ray_store_refuses_ragged_and_text_fields_before_it_starts(tmp_path):
    with pytest.raises(SchemaError, match=r"\['tokens', 'instruction'\]: a durable Ray store's episode log.*durable"):
        ab.ExperienceStore(capacity=50, schema=SCHEMA, backend="ray", num_shards=1, durable=tmp_path / "log")
    assert not (tmp_path / "log").exists() or not any((tmp_path / "log").iterdir())


def test_sealed_blocks_count_the_values_of_ragged_fields_in_their_size():
    """A block holds about block_bytes, values included (a ragged row's fixed part is 0 bytes: counted by
    rows alone, ten episodes of 32 KB of tokens were sealed into one block of 5x block_bytes)."""
    store = ab.ExperienceStore(capacity=5_000, schema=SCHEMA, backend="ray", num_shards=1, seed=0,
                               ray_options=ab.RayOptions(block_bytes=1 << 16))
    try:
        data = batch_of(list(range(10)), 8)
        data["tokens"] = [[np.full(1000, 100 * e + t, np.int32) for t in range(8)] for e in range(10)]   # 32 KB each
        store.add_episodes(data)
        store.flush()
        batch = store.sample(64)
        for i, a in enumerate(batch["action"].tolist()):
            assert (batch["tokens"].values()[batch["tokens"].offsets()[i]:batch["tokens"].offsets()[i + 1]] == a).all()
        assert store.stats()["reader"]["blocks"] >= 4   # 320 KB of values in blocks of about 64 KB
    finally:
        store.close()
