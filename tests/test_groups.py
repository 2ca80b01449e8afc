"""GRPO's groups: `GroupSampler` draws whole groups, and `iter_batches(world_size=, rank=, balance=)` splits
each global batch over data-parallel ranks, every row once, groups whole, tokens balanced."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import arrowbuf as ab
from arrowbuf.groups import balanced_ranks


def grouped_store(sizes, group_size, seed=0, capacity=2000, sampler=None, lengths=None):
    """One episode whose steps carry group keys: group k has ``sizes[k]`` rows (complete when == group_size)."""
    keys = np.repeat(np.arange(len(sizes)), sizes)
    rng = np.random.default_rng(seed)
    np.random.default_rng(1).shuffle(keys)   # members of a group lie anywhere in the store
    n = len(keys)
    lengths = lengths if lengths is not None else rng.integers(1, 30, n)
    store = ab.ExperienceStore(capacity, seed=seed, sampler=sampler or ab.GroupSampler("group", group_size),
                               schema={"obs": ab.Field("float32", (1,), observation=True), "group": "int64",
                                       "tokens": ab.Field("int32", (None,)), "action": "int64",
                                       "terminated": "bool"})
    store.add_episode({"obs": np.zeros((n + 1, 1), np.float32), "group": keys, "action": np.arange(n),
                       "tokens": [np.full(int(k), i, np.int32) for i, k in enumerate(lengths)],
                       "terminated": np.r_[np.zeros(n - 1, bool), True]})
    return store, keys


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5), st.lists(st.integers(1, 7), min_size=1, max_size=12), st.integers(1, 4))
def test_a_batch_holds_whole_complete_groups_only(group_size, sizes, groups_per_batch):
    sizes = [group_size] + sizes   # at least one complete group
    store, keys = grouped_store(sizes, group_size)
    batch = store.sample(group_size * groups_per_batch)
    got = batch["group"].numpy().reshape(groups_per_batch, group_size)
    assert (got == got[:, :1]).all()                                 # each run of G rows is one group
    assert all(sizes[k] == group_size for k in got[:, 0].tolist())   # and a complete one
    actions = batch["action"].numpy().reshape(groups_per_batch, group_size)
    for k, members in zip(got[:, 0].tolist(), actions.tolist()):      # its G distinct rows, in stored order
        assert members == np.flatnonzero(keys == k).tolist()


def test_a_batch_size_that_splits_a_group_names_the_sizes_that_do_not():
    store, _ = grouped_store([4, 4, 3], 4)
    with pytest.raises(ValueError, match="batch_size=10 is not a multiple of group_size=4.*use 8 or 12"):
        store.sample(10)
    with pytest.raises(ab.EmptyStoreError, match="no complete group of 5"):
        grouped_store([4, 4], 5)[0].sample(5)


def test_complete_groups_are_drawn_uniformly():
    sizes = [3] * 8 + [2, 5]
    store, _ = grouped_store(sizes, 3)
    counts = np.bincount(np.concatenate([store.sample(60)["group"].numpy()[::3] for _ in range(100)]),
                         minlength=len(sizes))
    assert counts[8:].sum() == 0
    assert stats.chisquare(counts[:8]).pvalue > 1e-3


def test_episode_groups_give_their_steps_padded_with_a_mask():
    store = ab.ExperienceStore(200, seed=0, sampler=ab.GroupSampler("task", 2, unit="episode"))
    for e in range(6):   # tasks 0, 0, 1, 1, 2 (alone: incomplete), 3 (alone)
        steps = 3 + e
        store.add_episode({"obs": np.zeros((steps + 1, 1)), "task": np.full(steps, [0, 0, 1, 1, 2, 3][e]),
                           "action": np.full(steps, e), "terminated": np.r_[np.zeros(steps - 1, bool), True]})
    batch = store.sample(6)
    assert batch.batch_size[0] == 6 and batch["mask"].shape == batch["task"].shape
    task, episode = batch["task"][:, 0].numpy(), batch["action"][:, 0].numpy()
    assert (task.reshape(3, 2) == task.reshape(3, 2)[:, :1]).all() and set(task) <= {0, 1}
    assert (batch["mask"].sum(1).numpy() == 3 + episode).all()
    with pytest.raises(ValueError, match="multiple of group_size=2"):
        store.sample(3)


def test_a_checkpoint_keeps_the_group_sampler(tmp_path):
    store, _ = grouped_store([2, 2, 2], 2)
    store.save(tmp_path / "checkpoint")
    loaded = ab.ExperienceStore.load(tmp_path / "checkpoint")
    assert repr(loaded.sampler) == "GroupSampler('group', group_size=2, unit='step')"
    assert loaded.sample(4)["group"].shape == (4,)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3000), min_size=1, max_size=200), st.integers(1, 9), st.data())
def test_balanced_ranks_place_every_item_once_groups_whole_within_the_greedy_bound(weights, world_size, data):
    groups = np.array(data.draw(st.lists(st.integers(0, 20), min_size=len(weights), max_size=len(weights))))
    owner = balanced_ranks(np.array(weights), world_size, groups)
    assert owner.shape == (len(weights),) and ((owner >= 0) & (owner < world_size)).all()
    for g in np.unique(groups):
        assert len(set(owner[groups == g].tolist())) == 1
    totals = np.bincount(groups, weights=weights)
    loads = np.bincount(owner, weights=weights, minlength=world_size)
    assert loads.max() <= loads.sum() / world_size + totals.max() + 1e-9   # largest-first's guarantee
    assert owner.tolist() == greedy_ranks(weights, world_size, groups.tolist())   # few items: greedy


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 9), st.integers(0, 400), st.sampled_from(["lognormal", "uniform", "equal", "spiky"]),
       st.integers(0, 2**32 - 1))
def test_many_items_are_dealt_every_rank_within_the_largest_small_item_of_the_mean(world_size, extra, kind, seed):
    rng = np.random.default_rng(seed)
    n = 16 * world_size + extra   # enough items for the deal (`DEAL_MIN_ITEMS` a rank)
    weights = {"lognormal": lambda: np.rint(rng.lognormal(np.log(600), 0.8, n)),
               "uniform": lambda: rng.integers(0, 5000, n), "equal": lambda: np.full(n, 7),
               "spiky": lambda: np.where(rng.random(n) < 0.05, 100_000, rng.integers(0, 3, n))}[kind]().astype(np.int64)
    owner = balanced_ranks(weights, world_size)
    assert owner.tolist() == balanced_ranks(weights.copy(), world_size).tolist()   # every rank computes the same
    assert ((owner >= 0) & (owner < world_size)).all()
    loads = np.bincount(owner, weights=weights, minlength=world_size)
    assert loads.sum() == weights.sum()   # every item on exactly one rank
    mean, ordered = weights.sum() / world_size, np.sort(weights)[::-1]
    if owner.tolist() == greedy_ranks(weights.tolist(), world_size, list(range(n))):
        assert loads.max() <= mean + ordered[0] + 1e-9   # too few small items to even out: greedy's bound
    else:   # dealt: within the largest of the smallest quarter of the mean, both ways
        small = ordered[n - n // 4]
        assert mean - small - 1e-9 <= loads.min() and loads.max() <= mean + small + 1e-9


def test_the_deal_balances_lognormal_token_batches_as_closely_as_issue_34_asks():
    rng = np.random.default_rng(7)
    worst = 0.0
    for _ in range(200):   # global batches of 512 rows over 8 ranks (the dealt path)
        lengths = np.rint(rng.lognormal(np.log(600), 0.8, 512)).astype(np.int64) + 1
        loads = np.bincount(balanced_ranks(lengths, 8), weights=lengths, minlength=8)
        worst = max(worst, loads.max() / loads.mean())
    assert worst <= 1.02


def greedy_ranks(weights, world_size, groups):
    """Largest-first, the plain way: each group (largest total first, ties in order of first
    appearance among equal keys sorted) to the rank with the fewest tokens so far, the lowest on a tie."""
    keys = sorted(set(groups))
    totals = [sum(w for w, g in zip(weights, groups) if g == k) for k in keys]
    load, rank_of = [0] * world_size, {}
    for k in sorted(range(len(keys)), key=lambda i: -totals[i]):   # sorted() is stable
        rank = min(range(world_size), key=lambda r: (load[r], r))
        rank_of[keys[k]] = rank
        load[rank] += totals[k]
    return [rank_of[g] for g in groups]


def test_ranks_share_each_global_batch_exactly_once_with_balanced_tokens():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(600), 0.8, 1024).astype(int) + 1, 8000)
    world, shares = 8, []
    for rank in range(world):   # each rank a process of its own: a store of the same seed and contents
        store, _ = grouped_store([1] * 1024, 1, seed=3, capacity=2048, lengths=lengths, sampler=ab.UniformSampler())
        shares.append(list(store.iter_batches(512, world_size=world, rank=rank, balance="tokens")))
    reference, _ = grouped_store([1] * 1024, 1, seed=3, capacity=2048, lengths=lengths, sampler=ab.UniformSampler())
    global_batches = [b["action"].numpy() for b in reference.iter_batches(512)]
    assert len(global_batches) == 2 and all(len(s) == 2 for s in shares)
    for k, whole in enumerate(global_batches):
        parts = [share[k]["action"].numpy() for share in shares]
        assert sorted(np.concatenate(parts).tolist()) == sorted(whole.tolist())   # every row once
        tokens = np.array([lengths[p].sum() for p in parts])
        assert tokens.max() / tokens.mean() <= 1.02
        for share in shares:   # the ragged field came along, each row's own tokens
            batch = share[k]
            assert (batch["tokens"].offsets().diff().numpy() == lengths[batch["action"].numpy()]).all()


def test_groups_stay_on_one_rank_and_bad_splits_are_refused():
    store, keys = grouped_store([4] * 32, 4, seed=2)
    owners = {}   # (global batch, group) -> the ranks its rows went to
    for rank in range(3):
        again, _ = grouped_store([4] * 32, 4, seed=2)
        for k, batch in enumerate(again.iter_batches(32, world_size=3, rank=rank, balance="tokens")):
            for g in batch["group"].tolist():
                owners.setdefault((k, g), set()).add(rank)
    assert len(owners) == 32 and all(len(ranks) == 1 for ranks in owners.values())   # each group once, whole
    for kwargs, message in (({"rank": 0}, "give world_size"), ({"world_size": 2, "rank": 2}, r"\[0, 2\)"),
                            ({"world_size": 0, "rank": 0}, "world_size must be"),
                            ({"world_size": 2, "rank": 0, "balance": "action"}, "must name a ragged field")):
        with pytest.raises(ValueError, match=message):
            store.iter_batches(8, **kwargs)


def test_an_epoch_walks_each_complete_group_once_and_whole():
    store, keys = grouped_store([3] * 10 + [2], 3)
    for shuffle in (True, False):
        batches = [b["group"].numpy() for b in store.iter_batches(6, shuffle=shuffle)]
        assert [len(b) for b in batches] == [6] * 5
        groups = np.concatenate(batches).reshape(-1, 3)
        assert (groups == groups[:, :1]).all() and sorted(groups[:, 0].tolist()) == list(range(10))
    with pytest.raises(ValueError, match="multiple of group_size=3"):
        store.iter_batches(4)


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.sampled_from([1, 2, 4]), st.booleans(), st.booleans())
def test_without_rank_each_global_batch_is_every_ranks_share_exactly_as_each_rank_gets_it(
        world_size, groups_per_batch, group_size, shuffle, padded):
    sizes = [group_size] * 30
    kwargs = {"world_size": world_size, "balance": "tokens", "shuffle": shuffle, "epochs": 2,
              "pad": {"tokens": -1} if padded else None}
    batch_size = group_size * groups_per_batch
    store, _ = grouped_store(sizes, group_size, seed=4)
    shares = list(store.iter_batches(batch_size, **kwargs))   # a driver's: a list of world_size shares each
    assert shares and all(isinstance(s, list) and len(s) == world_size for s in shares)
    for rank in range(world_size):   # each rank a process of its own: a store of the same seed and contents
        again, _ = grouped_store(sizes, group_size, seed=4)
        own = list(again.iter_batches(batch_size, rank=rank, **kwargs))
        mine = [s[rank] for s in shares if len(s[rank])]   # a rank is given no empty share
        assert len(own) == len(mine)
        for got, expected in zip(mine, own):   # the same rows, in the same order, with the same values
            assert set(got.keys(True, True)) == set(expected.keys(True, True))
            for key in expected.keys(True, True):
                a, b = got[key], expected[key]
                if a.is_nested:
                    assert a.offsets().tolist() == b.offsets().tolist() and a.values().tolist() == b.values().tolist()
                else:
                    assert a.tolist() == b.tolist()
    for batch in shares:   # each share owns its tokens: sending one moves its rows only
        assert sum(len(s) for s in batch) > 0
        if not padded:
            for share in batch:
                values = share["tokens"].values()
                assert values.untyped_storage().nbytes() == values.numel() * values.element_size()


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_drivers_shares_hold_every_fields_rows_as_a_gather_of_their_indices_gives_them(shuffle):
    rng = np.random.default_rng(5)
    n = 300
    store = ab.ExperienceStore(400, seed=1, schema={
        "obs": ab.Field("float32", (2,), observation=True), "tokens": ab.Field("int32", (None,)),
        "pairs": ab.Field("int16", (None, 2)), "task": ab.Field("string"), "terminated": "bool"})
    store.add_episode({"obs": rng.normal(size=(n + 1, 2)).astype(np.float32),
                       "tokens": [rng.integers(0, 99, int(k), dtype=np.int32) for k in rng.integers(0, 40, n)],
                       "pairs": [rng.integers(0, 9, (int(k), 2), dtype=np.int16) for k in rng.integers(0, 5, n)],
                       "task": [f"task {k % 7}" for k in range(n)], "terminated": np.r_[np.zeros(n - 1, bool), True]})
    batches = list(store.iter_batches(64, world_size=5, balance="tokens", shuffle=shuffle))
    assert sum(len(share) for shares in batches for share in shares) == n
    for shares in batches:
        for share in shares:
            if not len(share):
                continue
            expected = store.gather(share["index"])   # the same rows, gathered on their own
            assert set(share.keys(True, True)) == set(expected.keys(True, True))
            for key in expected.keys(True, True):
                a, b = share[key], expected[key]
                if key == "task":
                    assert a.tolist() == b.tolist()
                elif a.is_nested:
                    assert a.offsets().tolist() == b.offsets().tolist() and torch.equal(a.values(), b.values())
                    assert a.values().untyped_storage().nbytes() == a.values().numel() * a.values().element_size()
                else:
                    assert torch.equal(a, b)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_drivers_shares_of_a_torch_arena_store_are_a_numpy_stores_shares(shuffle):
    # A store with a storage_device gathers with its torch arena's gatherer, which holds no ragged
    # field: a driver's split (world_size, no rank) reached it with ragged copies it does not take.
    rng = np.random.default_rng(2)
    n = 120
    steps = {"obs": rng.normal(size=(n + 1, 3)).astype(np.float32), "action": rng.integers(0, 4, n),
             "terminated": np.r_[np.zeros(n - 1, bool), True]}
    stores = [ab.ExperienceStore(200, seed=3, **kwargs) for kwargs in ({}, {"storage_device": "cpu"})]
    for store in stores:
        store.add_episode(steps)
    numpy_batches, torch_batches = (list(s.iter_batches(32, world_size=3, shuffle=shuffle)) for s in stores)
    assert len(numpy_batches) == len(torch_batches) == 4
    for expected, got in zip(numpy_batches, torch_batches):
        assert [len(share) for share in got] == [len(share) for share in expected]
        for a, b in zip(got, expected):
            for key in b.keys(True, True):
                assert torch.equal(a[key], b[key]), key
    assert sorted(torch.cat([share["index"] for shares in torch_batches for share in shares]).tolist()) == \
        sorted(torch.cat([share["index"] for shares in numpy_batches for share in shares]).tolist())


def test_a_drivers_unshuffled_shares_of_a_store_with_a_text_field_are_gathered_not_viewed():
    # Contiguous shares are given as views of the arena, which a text field's strings are not: the
    # driver's split raised TypeError where a rank's own split (engine.gather) had been mended.
    store = ab.ExperienceStore(100, seed=0)
    store.add_episode({"obs": np.zeros((11, 2), np.float32), "action": np.arange(10),
                       "task": [f"task {t % 3}" for t in range(10)], "terminated": np.r_[np.zeros(9, bool), True]})
    shares = [share for batch in store.iter_batches(4, world_size=2, shuffle=False) for share in batch]
    actions = [a for share in shares for a in share["action"].tolist()]
    assert sorted(actions) == list(range(10))
    assert [t for share in shares for t in list(share["task"])] == [f"task {a % 3}" for a in actions]
