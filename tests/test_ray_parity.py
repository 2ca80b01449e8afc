"""Switch the backend with one line, lose nothing: the same public calls on a local store and on a Ray
store (1 and 2 shards) leave what a user sees the same (sizes, ``stats()`` counts, the episode table,
every row and gathered value, errors and the store after each refused call).

Episode ids are the shards' (``id % num_shards`` is the shard) and a shard evicts its own oldest
episodes, so with 2 shards the tables are compared without ids and, where eviction chooses, by size
(docs/ray.md says both). Ray stores are shared by the tests of this module (`support.ray_stores`):
counters such as ``inserts`` are compared as the change a test makes.
"""

from __future__ import annotations

import gc

import numpy as np
import pyarrow.compute as pc
import pytest
import torch
from scipy.stats import chisquare

import arrowbuf as ab

from support.episodes import EPISODE_SCHEMA, make_episode
from test_ragged import tokens

pytestmark = pytest.mark.usefixtures("ray_session")

#: Columns of the episode table that name storage or the shard, not the episode.
STORAGE = {"episode_id", "inserted_at", "shard", "first_row", "first_index"}
RAGGED = {"obs": ab.Field("float32", (2,), observation=True), "tokens": ab.Field("int32", (None,), max_bytes=600),
          "instruction": ab.Field("string"), "action": ab.Field("int64"), "reward": ab.Field("float32"),
          "terminated": ab.Field("bool"), "truncated": ab.Field("bool")}
GROUPED = {**EPISODE_SCHEMA.fields, "prompt": ab.Field("int64")}
VALUED = {**EPISODE_SCHEMA.fields, "value": ab.Field("float32")}


@pytest.fixture(params=[2], ids=["2-shards"])   # (1 shard: the same paths less the split; its own cases below)
def num_shards(request) -> int:
    return request.param


def twins(ray_stores, num_shards: int, capacity: int = 40, **kwargs) -> tuple[ab.ExperienceStore, ab.ExperienceStore]:
    """A new local store and an emptied shared Ray store of the same settings (a sampler made anew for each)."""
    sampler = kwargs.pop("sampler", None)
    local = ab.ExperienceStore(capacity, seed=0, sampler=sampler() if sampler else None, **kwargs)
    remote = ray_stores.get(capacity=capacity, num_shards=num_shards, seed=0,
                            sampler=sampler() if sampler else None, **kwargs)
    return local, remote


def seen(store: ab.ExperienceStore, inserts_before: int = 0) -> dict:
    """What a user sees of ``store``: sizes, counts, the episode table and every row (ids and storage aside)."""
    store.flush()
    stats = store.stats()
    table = [{k: v for k, v in row.items() if k not in STORAGE}
             for row in store.episodes(include_open=True).to_pylist()]
    rows = store.to_arrow()
    rows = rows.drop_columns(["episode_id"]) if rows.num_columns else rows
    return {"len": len(store), "num_episodes": store.num_episodes, "transitions": stats["transitions"],
            "episodes": stats["episodes"], "inserts": stats["inserts"] - inserts_before,
            "table": sorted(map(repr, table)), "rows": sorted(map(repr, rows.to_pylist()))}


def outcome(call, *args, **kwargs):
    """("ok", result) or (error type, message) of ``call``."""
    try:
        return "ok", call(*args, **kwargs)
    except Exception as err:   # every error a user may see
        return type(err), str(err)


def refused_alike(local: ab.ExperienceStore, remote: ab.ExperienceStore, names: str, call) -> None:
    """``call(store)`` raises the same error type on both stores, its message naming ``names``, and
    leaves each store's sizes as they were (`seen` tells the rest: a test compares it after its refusals)."""
    sizes = [(len(s), s.num_episodes, s.stats()["inserts"]) for s in (local, remote)]
    got = [outcome(call, local), outcome(call, remote)]
    assert got[0][0] is got[1][0] and got[0][0] != "ok", got
    for word in names.split():
        assert word in got[0][1] and word in got[1][1], (word, got)
    after = [(len(s), s.num_episodes, s.stats()["inserts"]) for s in (local, remote)]
    assert after == sizes, f"a refusal changed a store: {sizes} -> {after}"


def batch_of(tags: list[int], steps: int) -> dict:
    one = [make_episode(tag, steps) for tag in tags]
    return {key: np.stack([episode[key] for episode in one]) for key in one[0]}


# -- capacity, modes, refusals ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["fixed", "circular"])
def test_a_store_at_exact_capacity_holds_evicts_and_refuses_as_a_local_one(ray_stores, num_shards, mode):
    local, remote = twins(ray_stores, num_shards, mode=mode, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    for store in (local, remote):
        ids = store.add_episodes(batch_of([0, 1, 2, 3], 10), env_ids=[f"env-{e}" for e in range(4)],
                                 metadata=[{"e": e} for e in range(4)])
        assert [store.episode(i).column("action").to_pylist()[0] for i in ids] == [0, 1000, 2000, 3000]
    assert seen(local) == seen(remote, inserts)   # exactly full: 40 of 40
    if mode == "fixed":
        refused_alike(local, remote, "capacity", lambda s: s.add_episode(make_episode(9, 1), env_id="env-0"))
        refused_alike(local, remote, "capacity", lambda s: s.add_episodes(batch_of([7, 8], 2), env_ids="env-1"))
        assert seen(local) == seen(remote, inserts)
        return
    for store in (local, remote):   # circular: the oldest steps go
        store.add_episode(make_episode(9, 5), env_id="env-0")
    local_seen, remote_seen = seen(local), seen(remote, inserts)
    # By design (docs/ray.md): a local store evicts the front 5 steps of its oldest episode, a Ray
    # shard the whole of its oldest (its sealed blocks hold whole episodes).
    assert [local_seen[k] for k in ("len", "num_episodes", "inserts")] == [40, 5, 45]
    assert [remote_seen[k] for k in ("len", "num_episodes", "inserts")] == [35, 4, 45]
    if num_shards == 1:
        assert remote_seen["table"] == [row for row in local_seen["table"] if "'first_step': 5" not in row]


def test_a_full_fixed_store_names_the_stores_capacity_and_what_to_do_on_every_shard(ray_stores, num_shards):
    """Users see the store: a shard's refusal names the store's capacity (not the shard's share) and the
    local store's remedies, and a refused single episode is not called one of a batch."""
    local, remote = twins(ray_stores, num_shards, mode="fixed", schema=EPISODE_SCHEMA)
    for store in (local, remote):
        store.add_episodes(batch_of([0, 1, 2, 3], 10), env_ids=[f"env-{e}" for e in range(4)])
    for env in range(4):   # whichever shard the env's episodes go to
        messages = [outcome(lambda s: s.add_episode(make_episode(9, 2), env_id=f"env-{env}"), s) for s in (local, remote)]
        assert messages[0][0] is messages[1][0] is ab.CapacityError, messages
        for _, message in messages:
            assert "capacity=40" in message and "the 2 transition(s) were not written" in message, message
            assert message.endswith("Sample or clear() the store, raise the capacity, or use mode='circular'"), message
        assert "capacity=20" not in messages[1][1] and "of the 1 episodes" not in messages[1][1], messages


def test_bad_arguments_are_refused_alike_naming_the_argument_and_change_nothing(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    for store in (local, remote):
        store.add_episode(make_episode(0, 6), env_id="env-0")
    before = seen(local), seen(remote, inserts)
    episode = make_episode(1, 4)
    for names, call in [
            ("capacity", lambda s: s.add_episode(make_episode(2, 50))),
            ("unknown zz", lambda s: s.add_episode({**episode, "zz": np.zeros(4)})),
            ("action int64", lambda s: s.add_episode({**episode, "action": np.zeros(4, np.float32)})),
            ("env_id", lambda s: s.add_episode(episode, env_id=3)),
            ("metadata", lambda s: s.add_episode(episode, metadata={"a": object()})),
            ("shard", lambda s: s.add_episode(episode, shard=5)),
            ("timeout", lambda s: s.add_episode(episode, timeout=-1)),
            ("lengths", lambda s: s.add_episodes({k: np.stack([v, v]) for k, v in episode.items()}, lengths=[5, 1])),
            ("env_ids", lambda s: s.add_episodes({k: np.stack([v, v]) for k, v in episode.items()}, env_ids=["a"])),
            ("metadata", lambda s: s.add_episodes({k: np.stack([v, v]) for k, v in episode.items()}, metadata=[{}])),
            ("batch_size", lambda s: s.sample(0)), ("n_step", lambda s: s.sample(4, n_step=0)),
            ("gamma", lambda s: s.sample(4, gamma=2.0)), ("frame_stack", lambda s: s.sample(4, frame_stack=0)),
            ("num_workers", lambda s: s.sample(4, num_workers=3)), ("keys zzz", lambda s: s.sample(4, keys=["zzz"])),
            ("layout", lambda s: s.sample(4, layout="x")), ("min_version", lambda s: s.sample(4, min_version=-1)),
            ("rank", lambda s: s.iter_batches(4, world_size=2, rank=2)),
            ("world_size", lambda s: s.iter_batches(4, rank=0)),
            ("balance", lambda s: s.iter_batches(4, world_size=2, rank=0, balance="action")),
            ("shuffle", lambda s: s.iter_batches(4, shuffle=1)), ("epochs", lambda s: s.iter_batches(4, epochs=0)),
            ("keys zzz", lambda s: s.iter_batches(4, keys=["zzz"])),
            ("gamma", lambda s: s.compute_gae(gamma=2)), ("value_key", lambda s: s.compute_gae(value_key="nope")),
            ("bootstrap_value", lambda s: s.compute_gae(value_key="reward", bootstrap_value=3)),
            ("update_priorities PrioritizedSampler", lambda s: s.update_priorities([0], [1.0])),
            ("index", lambda s: s.gather(np.zeros((2, 2), np.int64))),
            ("episode_id", lambda s: s.episode("x")), ("include_open", lambda s: s.episodes(include_open=1))]:
        refused_alike(local, remote, names, call)
    assert (seen(local), seen(remote, inserts)) == before


def test_a_one_shard_ray_store_names_its_one_shard_as_a_store_not_a_local_one(ray_stores):
    _, remote = twins(ray_stores, 1, schema=EPISODE_SCHEMA)
    with pytest.raises(ValueError, match=r"shard must be an int in \[0, 1\)") as refused:
        remote.add_episode(make_episode(0, 3), shard=1)
    assert "local" not in str(refused.value)


def test_a_fixed_store_refuses_max_bytes_before_any_shard_starts(ray_session, num_shards):
    for backend in ({}, {"backend": "ray", "num_shards": num_shards}):   # a ValueError, not a dead actor
        with pytest.raises(ValueError, match=r"fields \['tokens'\] have max_bytes.*mode='fixed'"):
            ab.ExperienceStore(40, schema=RAGGED, mode="fixed", **backend)


def test_a_sampler_a_local_store_uses_is_refused_by_a_ray_store_too(ray_session):
    sampler = ab.PrioritizedSampler(alpha=0.6, beta=0.4)
    ab.ExperienceStore(40, sampler=sampler, schema=EPISODE_SCHEMA)
    for backend in ({}, {"backend": "ray"}):   # a ValueError, not Ray's failure to copy the bound sampler
        with pytest.raises(ValueError, match="already used by another store; create one sampler per store"):
            ab.ExperienceStore(40, sampler=sampler, schema=EPISODE_SCHEMA, **backend)


# -- the episode table ---------------------------------------------------------------------------------


def test_the_episode_tables_first_index_reads_each_episode_back_through_gather(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    for store in (local, remote):
        for tag in range(5):
            store.add_episode(make_episode(tag, 4), env_id=f"env-{tag}")
        store.flush()
        table = store.episodes()
        for first, length, episode_id in zip(*(table.column(c).to_pylist()
                                               for c in ("first_index", "length", "episode_id"))):
            rows = store.gather(np.arange(first, first + length))   # the store's indices, as a batch's "index"
            assert rows["episode_id"].unique().tolist() == [episode_id]
            assert rows["step"].tolist() == list(range(length))
        assert sorted(table.column("first_index").to_pylist()) == sorted(store.episode_spans()[1].tolist())


def test_clear_empties_alike_and_ids_stay_unique(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    for store in (local, remote):
        before = [store.add_episode(make_episode(t, 3), env_id=f"env-{t}") for t in range(3)]
        store.clear()
        assert (len(store), store.num_episodes, store.episodes().num_rows) == (0, 0, 0)
        with pytest.raises(ab.EmptyStoreError):
            store.sample(2)
        after = [store.add_episode(make_episode(t, 3), env_id=f"env-{t}") for t in range(3, 5)]
        assert not set(before) & set(after)
    assert seen(local) == seen(remote, inserts)


# -- ragged and text fields ----------------------------------------------------------------------------


def ragged_episode(e: int, steps: int) -> dict:
    return {"obs": np.zeros((steps + 1, 2), np.float32), "tokens": [tokens(e, t) for t in range(steps)],
            "instruction": [f"task {e}"] * steps, "action": np.arange(steps) + 100 * e,
            "reward": np.full(steps, e, np.float32), "terminated": np.arange(steps) == steps - 1,
            "truncated": np.zeros(steps, bool)}


def test_ragged_and_text_fields_keep_max_bytes_values_keys_and_pad_alike(ray_stores):
    local, remote = twins(ray_stores, 1, capacity=200, schema=RAGGED)   # one shard: max_bytes evicts the same
    for store in (local, remote):
        for e in range(8):   # ~250 B of tokens an episode against max_bytes=600: the oldest go
            store.add_episode(ragged_episode(e, 6), env_id="env-0")
    assert seen(local) == seen(remote, remote.stats()["inserts"] - local.stats()["inserts"])
    assert local.num_episodes < 8
    for keys, pad in ((None, None), (["tokens", "action"], None), (["instruction"], None), (None, {"tokens": -1})):
        batches = [store.sample(16, keys=keys, pad=pad) for store in (local, remote)]
        assert sorted(batches[0].keys()) == sorted(batches[1].keys())
        for store, batch in zip((local, remote), batches):   # each item is the stored row its action names
            assert set(keys or ["tokens", "instruction", "action"]) <= set(batch.keys())
            actions = store.gather(batch["index"])["action"].tolist()
            for k, (e, t) in enumerate(divmod(action, 100) for action in actions):
                if pad is not None:
                    n = int(batch["tokens_length"][k])
                    assert batch["tokens"][k, :n].tolist() == tokens(e, t).tolist()
                    assert (batch["tokens"][k, n:] == -1).all()
                elif "tokens" in (keys or ["tokens"]):
                    assert batch["tokens"][k].tolist() == tokens(e, t).tolist()
                if "instruction" in (keys or ["instruction"]):
                    assert batch["instruction"][k] == f"task {e}"
    epochs = [[(b["action"].tolist(), [x.tolist() for x in b["tokens"].unbind()], list(b["instruction"]))
               for b in s.iter_batches(5, shuffle=False)] for s in (local, remote)]
    assert epochs[0] == epochs[1]



def _framed(tag: int, steps: int) -> dict:
    """`make_episode` with a step field of 64 random (incompressible) bytes a step, encoded by zstd."""
    frames = np.random.default_rng(tag).integers(0, 256, (steps, 64), dtype=np.uint8)
    return {**make_episode(tag, steps), "frame": frames}


def test_an_encoded_episode_over_max_bytes_is_refused_before_anything_is_evicted_alike(ray_stores):
    # 1b3f084: its bytes were known only once encoded, in the write: it evicted every episode held
    # first, then was stored over the budget anyway (local, and in a Ray shard).
    from arrowbuf.codecs import encode_rows, parse_codec

    row = len(encode_rows(parse_codec("zstd", "uint8", (64,), "frame"), _framed(0, 1)["frame"])[0])
    budget = 5 * row   # exactly one episode of 5 steps
    local, remote = twins(ray_stores, 1, capacity=40, schema={
        **EPISODE_SCHEMA.fields, "frame": ab.Field("uint8", (64,), codec="zstd", max_bytes=budget)})
    for store in (local, remote):
        for tag in range(3):   # each evicts the one before: the budget holds one
            store.add_episode(_framed(tag, 5), env_id=f"env-{tag}")
        store.flush()
        assert store.num_episodes == 1
    held = seen(local)
    assert held == seen(remote) and held["len"] == 5
    for call in (lambda s: s.add_episode(_framed(7, 6)),
                 lambda s: s.add_episodes({k: np.stack([v]) for k, v in _framed(8, 6).items()})):
        refused_alike(local, remote, f"'frame' {6 * row:,} {budget:,} max_bytes", call)
        assert seen(local) == seen(remote) == held   # nothing evicted
    for store in (local, remote):   # the one held reads back whole
        batch = store.sample(16)
        np.testing.assert_array_equal(batch["frame"].numpy(), _framed(2, 5)["frame"][batch["step"].numpy()])

def test_a_gather_of_no_indices_has_the_same_fields_on_both_backends(ray_stores):
    local, remote = twins(ray_stores, 1, capacity=200, schema=RAGGED)
    for store in (local, remote):
        store.add_episode(ragged_episode(0, 3), env_id="env-0")
    empty = [store.gather(np.zeros(0, np.int64)) for store in (local, remote)]
    assert sorted(map(str, empty[0].keys(include_nested=True))) == sorted(map(str, empty[1].keys(include_nested=True)))
    assert {"instruction", "tokens", ("next", "obs"), "index"} <= set(empty[1].keys(include_nested=True))
    assert empty[0].batch_size == empty[1].batch_size == (0,)
    unwritten = ab.ExperienceStore(10).gather(np.zeros(0, np.int64))   # no schema yet (a Ray store's, as well)
    assert sorted(unwritten.keys()) == ["episode_id", "index", "step"] and unwritten.batch_size == (0,)


def test_n_step_and_frame_stack_treat_ragged_fields_alike(ray_stores):
    local, remote = twins(ray_stores, 1, capacity=200, schema=RAGGED)
    for store in (local, remote):
        for e in range(2):
            store.add_episode(ragged_episode(e, 5), env_id="env-0")
    for kwargs in ({"n_step": 3}, {"frame_stack": 2}):
        got = [outcome(lambda s: s.sample(8, **kwargs), s) for s in (local, remote)]
        assert got[0][0] == got[1][0]
        if got[0][0] == "ok":
            assert sorted(got[0][1].keys()) == sorted(got[1][1].keys())


# -- epochs --------------------------------------------------------------------------------------------


def test_epochs_walk_every_transition_alike(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    for store in (local, remote):
        store.add_episodes(batch_of([0, 1, 2], 7), env_ids=["env-0", "env-1", "env-2"])
    everything = sorted(tag * 1000 + t for tag in range(3) for t in range(7))
    for store in (local, remote):
        ordered = [b["action"].tolist() for b in store.iter_batches(5, shuffle=False)]
        assert [len(b) for b in ordered] == [5, 5, 5, 5, 1] and sorted(sum(ordered, [])) == everything
        assert [len(b) for b in store.iter_batches(5, drop_last=True)] == [5, 5, 5, 5]
        shuffled = [a for b in store.iter_batches(5, epochs=2) for a in b["action"].tolist()]
        assert sorted(shuffled) == sorted(everything * 2)
        shares = [[a for b in store.iter_batches(8, shuffle=False, world_size=2, rank=r) for a in b["action"].tolist()]
                  for r in range(2)]   # in order: one handle walks the same epoch for each rank
        assert sorted(shares[0] + shares[1]) == everything and abs(len(shares[0]) - len(shares[1])) <= 2


def test_group_sampler_epochs_walk_complete_groups_whole_as_a_local_store(ray_stores):
    """25 rows, groups of 3 by ``prompt = row // 3``: the last, of 1 row, is incomplete."""
    local, remote = twins(ray_stores, 1, capacity=60, schema=GROUPED,
                          sampler=lambda: ab.GroupSampler("prompt", group_size=3))
    for store in (local, remote):
        for tag in range(5):
            store.add_episode({**make_episode(tag, 5), "prompt": (np.arange(5) + 5 * tag) // 3}, env_id="env-0")
    for store in (local, remote):
        for shuffle in (False, True):
            batches = list(store.iter_batches(6, shuffle=shuffle))
            assert [len(b) for b in batches] == [6, 6, 6, 6]
            for b in batches:   # whole groups only
                assert (np.bincount(b["prompt"].numpy()) % 3 == 0).all()
            assert sorted(p for b in batches for p in b["prompt"].tolist()) == sorted(list(range(8)) * 3)
        with pytest.raises(ValueError, match="batch_size=4 is not a multiple of group_size=3"):
            store.iter_batches(4)
        batch = store.sample(6)
        assert (np.bincount(batch["prompt"].numpy()) % 3 == 0).all()


def test_group_epochs_skip_only_the_rows_evicted_meanwhile_as_a_local_store(ray_stores, monkeypatch):
    """Rows evicted between an epoch's order and its gathers are skipped, the rest of their batch kept: a
    Ray store dropped every batch that named one of them. 10 episodes of 6 rows fill 60, groups of 3
    (2 an episode); an episode of 6 more evicts the oldest, groups 0 and 1."""
    local, remote = twins(ray_stores, 1, capacity=60, schema=GROUPED,
                          sampler=lambda: ab.GroupSampler("prompt", group_size=3))
    for store in (local, remote):
        for tag in range(10):
            store.add_episode({**make_episode(tag, 6), "prompt": (np.arange(6) + 6 * tag) // 3}, env_id="env-0")

    def evict(store):
        store.add_episode({**make_episode(10, 6), "prompt": np.full(6, 99)}, env_id="env-0")

    reader = remote._backend._reader   # a Ray epoch reads the blocks it syncs to once the shard drew its order:
    synced = reader.sync               # the eviction comes between the two (locally: before the lazy gathers)
    monkeypatch.setattr(reader, "sync", lambda *args, **kwargs: (evict(remote), synced(*args, **kwargs))[1])
    epochs = []
    for store in (local, remote):
        batches = store.iter_batches(6, shuffle=True)
        if store is local:
            evict(local)
        epochs.append([b["prompt"].tolist() for b in batches])
    for batches in epochs:
        prompts = sorted(p for b in batches for p in b)
        assert prompts == sorted(list(range(2, 20)) * 3), batches   # groups 0 and 1 alone are gone
        for b in batches:   # the groups kept are whole
            assert (np.bincount(b) % 3 == 0).all(), batches


def test_group_sampler_episode_epochs_are_refused_alike(ray_stores):
    local, remote = twins(ray_stores, 1, capacity=60, schema=GROUPED,
                          sampler=lambda: ab.GroupSampler("prompt", group_size=2, unit="episode"))
    for store in (local, remote):
        for tag in range(4):
            store.add_episode({**make_episode(tag, 3), "prompt": np.full(3, tag // 2)}, env_id="env-0")
    refused_alike(local, remote, "GroupSampler(unit='episode') sample()", lambda s: s.iter_batches(4))
    drawn = [s.sample(4) for s in (local, remote)]
    assert drawn[0].batch_size == drawn[1].batch_size == (4, 3)   # episodes, padded, with a mask


def test_group_sampler_draws_the_keys_of_lent_episodes(ray_session):
    """An episode of block_bytes / 8 or more is lent to its shard, whose arena gets its rows only when
    the shard reads them: a group's key must be read from its rows."""
    store = ab.ExperienceStore(200, backend="ray", seed=0, schema=GROUPED, ray_options=ab.RayOptions(block_bytes=1024),
                               sampler=ab.GroupSampler("prompt", group_size=3))
    try:
        for tag in range(5):
            store.add_episode({**make_episode(tag, 30), "prompt": (np.arange(30) + 30 * tag) // 3})
        batch = store.sample(30)
        assert (np.bincount(batch["prompt"].numpy()) % 3 == 0).all()
        tag, step = np.divmod(batch["action"].numpy(), 1000)
        assert (batch["prompt"].numpy() == (step + 30 * tag) // 3).all()   # each row's own key
    finally:
        store.close()


# -- samplers, limiters, versions -----------------------------------------------------------------------


@pytest.mark.parametrize("num_shards", [2], ids=["2-shards"])   # (1 shard: the same path, minus the split)
def test_prioritized_draws_follow_updated_priorities_alike(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA,
                          sampler=lambda: ab.PrioritizedSampler(alpha=1.0, beta=0.4))
    for store in (local, remote):
        store.add_episodes(batch_of([0, 1], 5), env_ids=["env-0", "env-1"])
        index = store.gather(np.concatenate([np.arange(a, b) for a, b in store.live_ranges()]))["index"]
        action = store.gather(index)["action"]
        assert store.update_priorities(index, torch.where(action % 1000 == 0, 10.0, 1.0)) == 10
        assert store.update_priorities(index + (1 << 40), torch.ones(10)) == 0   # none live
        drawn = torch.cat([store.sample(250)["action"] for _ in range(8)]).numpy()
        counts = np.array([(drawn % 1000 == t).sum() for t in range(5)])   # steps 0: 20 of the 28 of mass
        assert chisquare(counts, np.array([20, 2, 2, 2, 2]) / 28 * counts.sum()).pvalue > 1e-3


def test_one_shard_rate_limiters_and_reuse_counts_match_a_local_store(ray_stores):
    local, remote = twins(ray_stores, 1, schema=EPISODE_SCHEMA, rate_limiter=ab.MinSize(12), track_reuse=True)
    for store in (local, remote):
        store.add_episodes(batch_of([0, 1], 5), env_ids="env-0")
    refused_alike(local, remote, "MinSize 12", lambda s: s.sample(4))
    for store in (local, remote):
        store.add_episode(make_episode(2, 5), env_id="env-0")
        for _ in range(3):
            store.sample(10)
    stats = [local.stats(), remote.stats()]
    assert stats[0]["samples"] == stats[1]["samples"] == 30
    assert stats[0]["reuse"]["max"] >= 1 and stats[1]["shards"][0]["reuse"]["max"] >= 1   # Ray: per shard
    assert stats[0]["reuse"]["mean"] == stats[1]["shards"][0]["reuse"]["mean"] == 2.0


def test_policy_versions_bound_samples_epochs_and_evictions_alike(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards)
    for store in (local, remote):
        for version in range(4):
            store.add_episode(make_episode(version, 5), env_id=f"env-{version}", policy_version=version)
        assert set(store.sample(64, min_version=2)["policy_version"].tolist()) <= {2, 3}
        assert sum(len(b) for b in store.iter_batches(4, min_version=3)) == 5
        assert store.evict(min_version=2) == 2
        store.flush()
        assert (len(store), store.num_episodes) == (10, 2)
    refused_alike(local, remote, "min_version 9 newest", lambda s: s.sample(4, min_version=9))



def test_a_declared_policy_version_field_takes_the_keyword_on_both_backends(ray_stores):
    # 1b3f084: the episode was read against the declared schema before the keyword gave its column,
    # and refused with "missing ['policy_version']" (on both backends).
    local, remote = twins(ray_stores, 1, schema={**EPISODE_SCHEMA.fields, "policy_version": ab.Field("int64")})
    for store in (local, remote):
        store.add_episode(make_episode(0, 3), policy_version=4)
        store.add_episodes(batch_of([1, 2], 3), policy_version=[5, 6])
        store.add_episode({**make_episode(3, 3), "policy_version": np.full(3, 7)})   # the field in the data
        store.flush()
    refused_alike(local, remote, "policy_version field policy_version= give one",
                  lambda s: s.add_episode({**make_episode(4, 3), "policy_version": np.full(3, 7)}, policy_version=8))
    refused_alike(local, remote, "policy_version -1", lambda s: s.add_episode(make_episode(4, 3), policy_version=-1))
    assert seen(local) == seen(remote)
    for store in (local, remote):
        rows = store.to_arrow().filter(pc.invert(pc.field("is_last")))   # a final row holds only its observation
        held = {(int(a) // 1000, int(v)) for a, v in zip(rows.column("action").to_numpy(),
                                                         rows.column("policy_version").to_numpy())}
        assert held == {(0, 4), (1, 5), (2, 6), (3, 7)}
        assert set(store.sample(32, min_version=6)["policy_version"].tolist()) == {6, 7}

# -- writers, advantages, exports ----------------------------------------------------------------------


@pytest.mark.parametrize("autoreset_mode", ["disabled", "next_step"])
def test_writers_store_the_same_episodes_in_each_autoreset_mode(ray_stores, num_shards, autoreset_mode):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    for store in (local, remote):
        writer = store.writer(num_envs=2, autoreset_mode=autoreset_mode)
        obs = np.zeros((2, 2))
        for t in range(8):
            writer.add(obs=obs + t, action=np.array([t, 100 + t]), reward=np.ones(2),
                       terminated=np.array([t == 3, t == 5]), truncated=np.zeros(2, bool), next_obs=obs + t + 1)
        writer.flush()
    assert seen(local) == seen(remote, inserts)


def test_a_store_flush_counts_its_writers_open_steps_as_a_local_store(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    writers = [store.writer(num_envs=2, autoreset_mode="disabled") for store in (local, remote)]
    for store, writer in zip((local, remote), writers):
        for t in range(3):   # no episode ends
            writer.add(obs=np.full((2, 2), t), action=np.array([t, 100 + t]), reward=np.ones(2),
                       terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1))
        store.flush()
        assert (len(store), store.num_episodes, store.episodes(include_open=True).num_rows) == (6, 0, 2)
    tables = [sorted((row["env_id"], row["length"], row["first_step"], row["open"])
                     for row in store.episodes(include_open=True).to_pylist()) for store in (local, remote)]
    assert tables[0] == tables[1] == [("env-0", 3, 0, True), ("env-1", 3, 0, True)]   # the open episodes
    for writer in writers:
        writer.close()
    assert seen(local) == seen(remote, inserts)


def test_open_episodes_list_read_and_export_their_written_steps_alike(ray_stores, num_shards, tmp_path):
    """An episode still being written shows what is written of it on both backends: in
    ``episodes(include_open=True)`` its return so far and its last observation (``has_final``, ``num_rows``),
    in ``to_arrow()`` and exports every written step and the observation after the last. Locally a demo
    first makes the writer's regions small, so its episodes are a sealed piece and an open tail."""
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    writers = [store.writer(num_envs=2, autoreset_mode="disabled") for store in (local, remote)]
    for store, writer in zip((local, remote), writers):
        store.add_episode(make_episode(0, 4), env_id="env-9")
        for t in range(3):   # no episode ends
            writer.add(obs=np.full((2, 2), t), action=np.array([t, 100 + t]), reward=np.array([1.0, 2.0]),
                       terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1))
        store.flush()
        listed = [row for row in store.episodes(include_open=True).to_pylist() if row["open"]]
        assert sorted((row["env_id"], row["length"], row["num_rows"], row["has_final"], row["return"])
                      for row in listed) == [("env-0", 3, 4, True, 3.0), ("env-1", 3, 4, True, 6.0)]
        rows = store.to_arrow().to_pylist()
        for env, opened in enumerate(sorted(listed, key=lambda row: row["env_id"])):
            held = [row for row in rows if row["episode_id"] == opened["episode_id"]]
            assert [(row["action"], row["obs"], row["is_last"]) for row in held] == \
                [(100 * env + t, [t, t], False) for t in range(3)] + [(0, [3.0, 3.0], True)], held
        store.to_parquet(tmp_path / ("local" if store is local else "ray"))
    assert seen(local) == seen(remote, inserts)
    back = [ab.ExperienceStore.from_parquet(tmp_path / name) for name in ("local", "ray")]
    assert seen(back[0]) == seen(back[1])
    assert (len(back[0]), back[0].num_episodes) == (10, 3)
    for writer in writers:
        writer.close()


def test_a_writer_dropped_without_flush_keeps_its_steps_alike(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    inserts = remote.stats()["inserts"]
    for store in (local, remote):
        writer = store.writer(num_envs=2, autoreset_mode="disabled")
        for t in range(4):
            writer.add(obs=np.full((2, 2), t), action=np.array([t, 100 + t]), reward=np.ones(2),
                       terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1))
        del writer
        gc.collect()
    assert seen(local) == seen(remote, inserts)
    assert (len(local), local.num_episodes) == (8, 2)


@pytest.mark.parametrize("num_shards", [2], ids=["2-shards"])   # (1 shard: the same path, minus the split)
def test_compute_gae_writes_the_same_advantages(ray_stores, num_shards):
    local, remote = twins(ray_stores, num_shards, schema=VALUED)
    for store in (local, remote):
        for tag in range(3):   # episode 1 is cut (no final observation): bootstrapped
            store.add_episode({**make_episode(tag, 5, has_final=tag != 1, terminated=tag != 1),
                               "value": np.linspace(0, 1, 5, dtype=np.float32)}, env_id=f"env-{tag}")
        assert store.compute_gae(0.9, 0.8, bootstrap_value=lambda final: np.full(final.batch_size[0], 2.0)) == 14
    advantages = []
    for store in (local, remote):
        table = store.to_arrow()
        order = np.lexsort((table.column("step").to_numpy(), table.column("action").to_numpy() // 1000))
        advantages.append(table.column("advantage").to_numpy()[order])
    np.testing.assert_array_equal(advantages[0], advantages[1])


def test_to_parquet_exports_load_back_alike(ray_stores, num_shards, tmp_path):
    local, remote = twins(ray_stores, num_shards, schema=EPISODE_SCHEMA)
    for name, store in (("local", local), ("ray", remote)):
        for tag in range(3):
            store.add_episode(make_episode(tag, 4), env_id=f"env-{tag}", metadata={"tag": tag})
        store.to_parquet(tmp_path / name)
    back = [ab.ExperienceStore.from_parquet(tmp_path / name) for name in ("local", "ray")]
    assert seen(back[0]) == seen(back[1]) == seen(local)
