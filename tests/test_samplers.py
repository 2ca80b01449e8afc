"""Samplers: distributions (chi-square), epochs (exact counts), windows and priorities.

Every stored value encodes its (episode, step) (see `support/episodes.py`), so a sample can
be checked against the store's current episode table: the index is live and the
row read is the row of that index.
"""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chisquare

import arrowbuf as ab
from arrowbuf.placement import arena_rows

from support.episodes import EPISODE_SCHEMA, LiveTable, add_tagged, check_batch_reads_its_rows, make_episode


DRAWS = 100_000
P_MIN = 1e-3


def make_store(capacity, sampler=None, seed=0, **kwargs):
    return ab.ExperienceStore(capacity=capacity, sampler=sampler, seed=seed, schema=EPISODE_SCHEMA, **kwargs)


def fill(store, steps, recorded=None, has_final=True):
    recorded = {} if recorded is None else recorded
    for n in steps:
        add_tagged(store, recorded, n, has_final=has_final, terminated=len(recorded) % 2 == 0)
    return recorded


def assert_chisquare(counts, expected_probability):
    expected = np.asarray(expected_probability, np.float64)
    expected = expected / expected.sum() * counts.sum()
    result = chisquare(counts, expected)
    assert result.pvalue > P_MIN, f"chi-square p = {result.pvalue:.2e}: counts {counts.tolist()}"


def counts_of(values, keys):
    """How often each of ``keys`` occurs in ``values`` (every value must be a key)."""
    keys = np.asarray(keys)
    order = np.argsort(keys)
    pos = np.searchsorted(keys, values, sorter=order)
    assert (keys[order][np.minimum(pos, len(keys) - 1)] == values).all(), "a value that is not a key"
    return np.bincount(order[pos], minlength=len(keys))


# -- histories: random episodes written until the ring wraps and evicts ----------------

@st.composite
def histories(draw, max_steps=10, max_capacity=40):
    """(capacity, [(steps, has_final), ...]) written cyclically until 2.5 laps of the ring."""
    episodes = draw(st.lists(st.tuples(st.integers(1, max_steps), st.booleans()), min_size=1, max_size=8))
    capacity = draw(st.integers(max(s + 1 for s, _ in episodes), max_capacity))
    return capacity, episodes


def replay(store, capacity, episodes):
    """Write ``episodes`` cyclically until 2.5 laps of the capacity (transitions), or of the
    arena's rows when the episodes hold no transitions (one step, no final observation: the
    full arena evicts them); yields the record after each write."""
    recorded = {}
    rows = transitions = k = 0
    while transitions < 2.5 * capacity and rows < 2.5 * arena_rows(capacity):
        steps, has_final = episodes[k % len(episodes)]
        add_tagged(store, recorded, steps, has_final=has_final, terminated=k % 3 != 0)
        rows += steps + has_final
        transitions += steps - (not has_final)
        k += 1
        yield recorded
    assert store.episodes()["episode_id"][0].as_py() > 0, "the history should have evicted episodes"


SAMPLERS = {
    "uniform": lambda: ab.UniformSampler(),
    "prioritized": lambda: ab.PrioritizedSampler(alpha=0.7, beta=0.5),
    "without_replacement": lambda: ab.WithoutReplacementSampler(),
    "episode": lambda: ab.EpisodeSampler(),
}


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@settings(max_examples=25, deadline=None)
@given(history=histories(), seed=st.integers(0, 2**16))
def test_every_sampler_reads_only_live_rows_while_the_ring_wraps(kind, history, seed):
    capacity, episodes = history
    store = make_store(capacity, SAMPLERS[kind](), seed=seed)
    for recorded in replay(store, capacity, episodes):
        if not len(store):
            continue
        batch = store.sample(8)
        check_batch_reads_its_rows(batch, recorded, LiveTable(store))


# -- uniform -------------------------------------------------------------------------

def test_uniform_sampling_draws_every_live_transition_equally_often():
    store = make_store(50)
    fill(store, [3, 7, 4, 9, 2, 6, 5, 8, 3, 4, 7, 1, 6])  # 78 rows: the ring wraps and evicts
    live = LiveTable(store)
    batch = store.sample(DRAWS)
    assert "weight" not in batch.keys() and "mask" not in batch.keys()
    assert_chisquare(counts_of(batch["index"].numpy(), live.indices()), np.ones(len(live.indices())))


def test_the_same_seed_draws_the_same_batches():
    stores = [make_store(50, seed=3) for _ in range(2)]
    for store in stores:
        fill(store, [4, 6, 5])
    a, b = (store.sample(32)["index"] for store in stores)
    assert torch.equal(a, b)


# -- prioritized -----------------------------------------------------------------------

def prioritized_store(capacity=64, alpha=0.6, beta=0.4, steps=(5, 5, 5, 5), seed=1):
    store = make_store(capacity, ab.PrioritizedSampler(alpha=alpha, beta=beta), seed=seed)
    return store, fill(store, steps)


def leaves_at(store, rows):
    return store.sampler.tree.leaves[rows]


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0])
def test_prioritized_frequencies_match_priorities_to_the_power_alpha(alpha):
    store, _ = prioritized_store(alpha=alpha)
    index = LiveTable(store).indices()
    priority = np.random.default_rng(0).permutation(np.arange(1, len(index) + 1, dtype=np.float64))
    assert store.update_priorities(torch.from_numpy(index), torch.from_numpy(priority)) == len(index)
    batch = store.sample(DRAWS)
    eps = store.sampler.eps
    assert_chisquare(counts_of(batch["index"].numpy(), index), (priority + eps) ** alpha)


def test_prioritized_frequencies_after_the_ring_wraps_count_only_live_transitions():
    alpha = 0.8
    store, _ = prioritized_store(capacity=25, alpha=alpha, steps=[5] * 7)   # 5 transitions each: 2 evicted
    eps = store.sampler.eps
    index = LiveTable(store).indices()
    priority = np.linspace(0.5, 4.0, len(index))
    store.update_priorities(index, priority)
    fill(store, [5, 5], recorded={-1: None, -2: None})                     # evicts 2 more, adds 2
    live = LiveTable(store)
    expected = {int(i): (p + eps) ** alpha for i, p in zip(index, priority)}
    newest = (4.0 + eps) ** alpha                                          # the max priority seen
    probability = [expected.get(int(i), newest) for i in live.indices()]
    assert len(live.indices()) == 25 and sum(int(i) not in expected for i in live.indices()) == 10
    batch = store.sample(DRAWS)
    assert_chisquare(counts_of(batch["index"].numpy(), live.indices()), probability)


def test_importance_weights_are_n_times_probability_to_the_minus_beta_over_the_batch_max():
    alpha, beta = 0.6, 0.4
    store, _ = prioritized_store(alpha=alpha, beta=beta, steps=(4, 7, 3))
    eps = store.sampler.eps
    index = LiveTable(store).indices()
    priority = np.arange(len(index), dtype=np.float64) * 0.5
    store.update_priorities(index, priority)
    batch = store.sample(512)
    p_alpha = (priority + eps) ** alpha
    assert len(np.unique(batch["index"].numpy())) > 1
    chosen = p_alpha[np.searchsorted(index, batch["index"].numpy())] / p_alpha.sum()
    weight = (len(index) * chosen) ** -beta
    assert batch["weight"].dtype == torch.float32 and batch["weight"].shape == (512,)
    np.testing.assert_allclose(batch["weight"].numpy(), weight / weight.max(), rtol=1e-5)
    assert batch["weight"].max().item() == 1.0


def test_new_transitions_get_the_largest_priority_seen_so_far():
    alpha = 0.5
    store, _ = prioritized_store(alpha=alpha, steps=(4, 4))
    live = LiveTable(store)
    assert np.allclose(leaves_at(store, live.rows()), 1.0), "before any update the max priority is 1"
    store.update_priorities(live.indices()[:3], [5.0, 0.25, 2.0])
    store.update_priorities(live.indices()[:3], [0.1, 0.1, 0.1])           # the max seen stays 5
    before = leaves_at(store, live.rows()).copy()
    fill(store, [3], recorded={-1: None, -2: None})
    after = LiveTable(store)
    new_rows = np.setdiff1d(after.rows(), live.rows())
    assert len(new_rows) == 3
    np.testing.assert_allclose(leaves_at(store, new_rows), (5.0 + store.sampler.eps) ** alpha, rtol=1e-12)
    np.testing.assert_array_equal(leaves_at(store, live.rows()), before)


def test_priority_updates_of_evicted_transitions_leave_the_rows_that_replaced_them_alone():
    store, _ = prioritized_store(capacity=25, steps=[5] * 5)               # 25 transitions: full
    old = store.sample(64)["index"]
    old_rows = LiveTable(store).rows()
    fill(store, [5] * 5, recorded={-i: None for i in range(1, 6)})          # every old episode evicted
    live = LiveTable(store)
    assert not np.isin(old.numpy(), live.indices()).any()
    assert np.isin(live.rows(), old_rows).all(), "the new episodes reuse the old slots"
    leaves = store.sampler.tree.leaves.copy()
    total = store.sampler.tree.total
    assert store.update_priorities(old, torch.full((64,), 50.0)) == 0
    np.testing.assert_array_equal(store.sampler.tree.leaves, leaves)
    assert store.sampler.tree.total == total
    mixed = np.concatenate([old.numpy()[:4], live.indices()[:2]])
    assert store.update_priorities(mixed, np.full(6, 3.0)) == 2


@st.composite
def priority_histories(draw):
    capacity, episodes = draw(histories(max_steps=8, max_capacity=36))
    alpha = draw(st.sampled_from([0.0, 0.5, 1.0]))
    return capacity, episodes, alpha


@settings(max_examples=40, deadline=None)
@given(history=priority_histories(), seed=st.integers(0, 2**16))
def test_sum_tree_leaves_are_the_priorities_of_live_transitions_and_zero_elsewhere(history, seed):
    capacity, episodes, alpha = history
    store = make_store(capacity, ab.PrioritizedSampler(alpha=alpha, beta=0.5), seed=seed)
    eps = store.sampler.eps
    rng = np.random.default_rng(seed)
    model: dict[int, float] = {}       # index -> priority (before alpha)
    max_priority = 1.0
    old_indices = np.zeros(0, np.int64)
    for _ in replay(store, capacity, episodes):
        live = LiveTable(store)
        for i in live.indices().tolist():
            model.setdefault(i, max_priority)
        if len(store):
            old_indices = np.concatenate([old_indices, store.sample(4)["index"].numpy()])
        # Update a mix of live and (possibly) stale indices, duplicates included.
        index = rng.choice(old_indices, size=min(6, len(old_indices))) if len(old_indices) else old_indices
        priority = rng.exponential(size=len(index)) * 3
        is_live = np.isin(index, live.indices())
        assert store.update_priorities(index, priority) == int(is_live.sum())
        for i, p in zip(index[is_live].tolist(), priority[is_live].tolist()):
            model[i] = p + eps
            max_priority = max(max_priority, p + eps)
        leaves = store.sampler.tree.leaves
        rows = live.rows()
        expected = np.array([model[i] for i in live.indices().tolist()]) ** alpha
        np.testing.assert_allclose(leaves[rows], expected, rtol=1e-12)
        dead = np.ones(len(leaves), bool)   # every row of the arena
        dead[rows] = False
        assert not leaves[dead].any(), "a row that holds no live transition has a priority"
        assert store.sampler.tree.total == pytest.approx(expected.sum(), rel=1e-9)


def test_the_sum_tree_has_the_levels_of_the_rows_the_ring_uses_not_of_the_arena():
    # A ring of whole episodes uses its capacity and a row per piece (30,300 rows here): one level
    # below a top of at most 1,024 nodes. The arena's 2.5x rows would need two: every search and
    # update walked the extra level (PER's sample + update ~20% slower, bench PER, session 23).
    capacity = 30_000
    store = make_store(capacity, ab.PrioritizedSampler())
    fill(store, [100] * 600)                                            # two laps of the ring
    used = int(LiveTable(store).first_row.max()) + 101
    assert store.engine.shard.rows >= 2 * capacity
    assert len(store.sampler.tree.levels) == 2, [len(x) for x in store.sampler.tree.levels]
    assert used <= store.sampler.tree.size < store.engine.shard.rows


def test_the_sum_tree_grows_with_the_rows_written_keeping_every_priority_and_a_checkpoint(tmp_path):
    # Capacity 1,000 starts with a tree of 1,024 leaves; 10-step episodes with final observations
    # use 1,100 rows, so the tree grows while the ring fills, with priorities set before it grew.
    store = make_store(1_000, ab.PrioritizedSampler(alpha=1.0, beta=0.5), seed=2)
    assert store.sampler.tree is None or store.sampler.tree.size == 1_024
    rng = np.random.default_rng(0)
    model, recorded = {}, {}
    for _ in range(150):
        fill(store, [10], recorded)
        live = LiveTable(store)
        for i in live.indices().tolist():
            model.setdefault(i, 1.0 if not model else max(model.values()))
        some = rng.choice(live.indices(), size=min(8, len(live.indices())), replace=False)
        priority = rng.exponential(size=len(some)) * 3
        store.update_priorities(some, priority)
        model.update({i: p + store.sampler.eps for i, p in zip(some.tolist(), priority.tolist())})
        leaves = store.sampler.tree.leaves
        expected = np.array([model[i] for i in live.indices().tolist()])
        np.testing.assert_allclose(leaves[live.rows()], expected, rtol=1e-12)
        assert leaves.sum() == pytest.approx(expected.sum(), rel=1e-9)
    assert store.sampler.tree.size > 1_024, "the ring never wrote past the first tree: no test"

    store.save(tmp_path / "per")
    loaded = ab.ExperienceStore.load(tmp_path / "per")
    assert loaded.sampler.tree.size == store.sampler.tree.size
    np.testing.assert_array_equal(loaded.sampler.tree.leaves, store.sampler.tree.leaves)
    assert loaded.sampler.tree.total == store.sampler.tree.total
    assert torch.equal(loaded.sample(64)["index"], store.sample(64)["index"])


@pytest.mark.parametrize("writer_per_rollout", [False, True])
def test_a_prioritized_store_of_exactly_num_envs_x_t_keeps_every_rollouts_priorities_as_its_tree_grows(
        writer_per_rollout):
    # The on-policy size: 20 envs x 50 steps = capacity 1,000, a tree of 1,024 leaves at first. A
    # writer's regions spread the rollouts over more rows than that (`regions.region_rows`), so the
    # tree grows while they replace each other; the store holds each whole rollout, and exactly the
    # held transitions have priorities, the newest at the largest seen.
    num_envs, steps = 20, 50
    store = ab.ExperienceStore(capacity=num_envs * steps, sampler=ab.PrioritizedSampler(alpha=1.0, beta=0.0), seed=0)
    rng = np.random.default_rng(3)
    writer = None
    for rollout in range(6):
        if writer is None or writer_per_rollout:
            writer = store.writer(num_envs, autoreset_mode="disabled")
        obs = np.zeros((num_envs, 2), np.float32)
        for t in range(steps):
            done = (rng.random(num_envs) < 0.05) | (t == steps - 1)
            writer.add(obs=obs, action=np.full(num_envs, rollout), reward=np.ones(num_envs, np.float32),
                       terminated=done, truncated=np.zeros(num_envs, bool), next_obs=obs + 1)
            obs = np.where(done[:, None], 0.0, obs + 1).astype(np.float32)
        writer.flush()
        assert len(store) == num_envs * steps
        pieces, tree = store.engine.shard.table, store.sampler.tree   # (a writer's episodes may be several pieces)
        first_row, first_index, length = (pieces.col(c).tolist() for c in ("first_row", "first_index", "length"))
        rows = np.concatenate([a + np.arange(n) for a, n in zip(first_row, length)])
        indices = np.concatenate([a + np.arange(n) for a, n in zip(first_index, length)])
        assert (store.gather(indices)["action"] == rollout).all(), "not exactly the last rollout"
        leaves = tree.leaves
        held = np.zeros(len(leaves), bool)
        held[rows] = True
        assert (leaves[held] == store.sampler.max_priority).all() and not leaves[~held].any()
        assert tree.total == pytest.approx(num_envs * steps * store.sampler.max_priority, rel=1e-12)
        batch = store.sample(256)
        assert np.isin(batch["index"].numpy(), indices).all() and (batch["action"] == rollout).all()
        store.update_priorities(batch["index"], np.full(256, 2.0 + rollout))   # the next rollout comes in at this
    assert store.sampler.tree.size > 1_024, "the rollouts never wrote past the first tree: no test"


def test_update_priorities_accepts_tensors_of_any_shape_and_returns_the_live_count():
    store, _ = prioritized_store(steps=(6,))
    index = torch.arange(6).reshape(2, 3)
    assert store.update_priorities(index, torch.ones(2, 3)) == 6
    assert store.update_priorities(index + 1000, torch.ones(2, 3)) == 0


# -- sequences -------------------------------------------------------------------------

def check_windows(batch, recorded, live, seq_len, strict):
    mask = batch["mask"].numpy()
    episode_id = batch["episode_id"].numpy()
    step = batch["step"].numpy().astype(np.int64)
    assert tuple(batch.batch_size) == (len(mask), seq_len)
    assert (episode_id == episode_id[:, :1]).all(), "a window crosses an episode boundary"
    assert mask[:, 0].all(), "a window starts on padding"
    assert (np.diff(mask.astype(np.int8), axis=1) <= 0).all(), "padding before a real step"
    contiguous = step[:, :1] + np.arange(seq_len)
    np.testing.assert_array_equal(step[mask], contiguous[mask])
    pos = live.position(episode_id[:, 0])
    end = live.first_step[pos] + live.length[pos]   # steps past the last held one (a trimmed piece starts later)
    assert (step[:, 0] >= live.first_step[pos]).all(), "a window starts on a step no longer held"
    np.testing.assert_array_equal(mask.sum(axis=1), np.minimum(seq_len, end - step[:, 0]))
    if strict:
        assert mask.all() and (step[:, 0] + seq_len <= end).all()
    check_batch_reads_its_rows(batch, recorded, live)


@settings(max_examples=50, deadline=None)
@given(history=histories(), seq_len=st.integers(1, 6), strict=st.booleans(), seed=st.integers(0, 2**16))
def test_sequence_windows_are_contiguous_steps_of_one_live_episode(history, seq_len, strict, seed):
    capacity, episodes = history
    store = make_store(capacity, ab.SequenceSampler(seq_len=seq_len, strict=strict), seed=seed)
    for recorded in replay(store, capacity, episodes):
        if not len(store):
            continue
        live = LiveTable(store)
        if strict and live.length.max() < seq_len:
            with pytest.raises(ValueError, match=f"no episode has {seq_len} transitions"):
                store.sample(8)
            continue
        check_windows(store.sample(8), recorded, live, seq_len, strict)


def test_loose_windows_work_when_every_episode_is_shorter_than_the_seq_len():
    store = make_store(100, ab.SequenceSampler(seq_len=8, strict=False))
    recorded = fill(store, [2, 3, 1, 4])
    batch = store.sample(256)
    check_windows(batch, recorded, LiveTable(store), 8, strict=False)
    assert not batch["mask"][:, 4:].any()


def test_strict_windows_raise_a_clear_error_when_no_episode_is_long_enough():
    store = make_store(100, ab.SequenceSampler(seq_len=8, strict=True))
    fill(store, [2, 3, 7])
    with pytest.raises(ValueError, match=r"no episode has 8 transitions.*longest: 7.*strict=False"):
        store.sample(4)


def test_strict_windows_are_drawn_uniformly_among_the_windows_that_fit():
    seq_len = 3
    store = make_store(40, ab.SequenceSampler(seq_len=seq_len), seed=5)
    fill(store, [4, 2, 6, 9, 3, 5, 7, 4])                                   # wraps: the first ones go
    live = LiveTable(store)
    starts = np.concatenate([f + np.arange(max(0, n - seq_len + 1)) for f, n in zip(live.first_index, live.length)])
    batch = store.sample(DRAWS // 4)
    assert_chisquare(counts_of(batch["index"][:, 0].numpy(), starts), np.ones(len(starts)))


# -- episodes ----------------------------------------------------------------------------

def test_episode_batches_hold_whole_episodes_padded_with_a_mask():
    store = make_store(100, ab.EpisodeSampler(), seed=2)
    recorded = fill(store, [3, 5, 2])
    fill(store, [1], recorded, has_final=False)                            # 0 transitions: never drawn
    live = LiveTable(store)
    batch = store.sample(64)
    mask = batch["mask"].numpy()
    episode_id = batch["episode_id"].numpy()
    assert tuple(batch.batch_size) == (64, 5)
    assert (episode_id == episode_id[:, :1]).all()
    pos = live.position(episode_id[:, 0])
    np.testing.assert_array_equal(mask.sum(axis=1), live.length[pos])
    step = batch["step"].numpy()
    np.testing.assert_array_equal(np.where(mask, step, -1), np.where(mask, np.arange(5), -1))
    assert (np.diff(mask.astype(np.int8), axis=1) <= 0).all()
    check_batch_reads_its_rows(batch, recorded, live)
    assert set(np.unique(episode_id).tolist()) == set(live.ids[live.length > 0].tolist())


def test_episodes_are_drawn_uniformly_whatever_their_length():
    store = make_store(60, ab.EpisodeSampler(), seed=4)
    fill(store, [2, 9, 4, 1, 7, 3, 12, 5, 2])                              # wraps
    live = LiveTable(store)
    batch = store.sample(DRAWS // 10)
    assert_chisquare(counts_of(batch["episode_id"][:, 0].numpy(), live.ids), np.ones(len(live.ids)))


# -- epochs: without replacement and iter_batches ------------------------------------------

def epoch_store(sampler=None, steps=(5, 7, 11), capacity=100):
    store = make_store(capacity, sampler, seed=7)
    return store, fill(store, steps)


def test_without_replacement_covers_every_transition_once_per_epoch_with_a_short_last_batch():
    sampler = ab.WithoutReplacementSampler()
    store, _ = epoch_store(sampler)                                         # 23 transitions
    index = LiveTable(store).indices()
    for epoch in (1, 2, 3):
        batches = [store.sample(5)["index"].numpy() for _ in range(5)]
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
        np.testing.assert_array_equal(np.sort(np.concatenate(batches)), index)
        assert sampler.epoch == epoch


def test_without_replacement_with_drop_last_skips_the_short_remainder():
    sampler = ab.WithoutReplacementSampler(drop_last=True)
    store, _ = epoch_store(sampler)
    index = LiveTable(store).indices()
    for epoch in (1, 2, 3):
        batches = np.concatenate([store.sample(5)["index"].numpy() for _ in range(4)])
        assert len(np.unique(batches)) == 20 and np.isin(batches, index).all()
        assert sampler.epoch == epoch


def test_without_replacement_adds_new_transitions_to_the_next_epoch_and_skips_evicted_ones():
    sampler = ab.WithoutReplacementSampler()
    store = make_store(30, sampler, seed=1)
    recorded = fill(store, [4, 4, 4, 4])                                    # 20 rows, 16 transitions
    first = [store.sample(4)["index"].numpy() for _ in range(2)]
    fill(store, [4, 4], recorded)                                           # 30 rows: nothing evicted
    rest = [store.sample(4)["index"].numpy() for _ in range(2)]
    np.testing.assert_array_equal(np.sort(np.concatenate(first + rest)), np.arange(16))
    assert sampler.epoch == 1
    fill(store, [4], recorded)                                              # evicts the first episode
    live = LiveTable(store)
    epoch = []
    while sampler.epoch < 3:
        batch = store.sample(4)
        if sampler.epoch == 2:
            epoch.append(batch["index"].numpy())
            check_batch_reads_its_rows(batch, recorded, live)
    np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), live.indices())


def test_without_replacement_refuses_a_batch_larger_than_the_store_with_drop_last():
    store, _ = epoch_store(ab.WithoutReplacementSampler(drop_last=True), steps=(3,))
    with pytest.raises(ValueError, match="batch of 4 is larger than the 3 stored transitions"):
        store.sample(4)


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_iter_batches_yields_every_transition_exactly_once(shuffle, drop_last):
    store = make_store(60, seed=3)
    recorded = fill(store, [5, 7, 11, 4, 9, 6, 8])                          # wraps: 57 rows written last lap
    live = LiveTable(store)
    index = live.indices()
    batches = list(store.iter_batches(batch_size=6, shuffle=shuffle, drop_last=drop_last))
    sizes = [b.batch_size[0] for b in batches]
    full, rest = divmod(len(index), 6)
    assert sizes == [6] * full + ([] if drop_last or not rest else [rest])
    seen = np.concatenate([b["index"].numpy() for b in batches])
    assert len(np.unique(seen)) == len(seen)
    if drop_last:
        assert np.isin(seen, index).all() and len(seen) == 6 * full
    else:
        np.testing.assert_array_equal(np.sort(seen), index)
    if not shuffle:
        np.testing.assert_array_equal(seen, index[:len(seen)])
    for batch in batches:
        check_batch_reads_its_rows(batch, recorded, live)


def test_iter_batches_skips_transitions_evicted_during_the_epoch():
    store = make_store(20, seed=3)
    recorded = fill(store, [4, 4, 4, 4, 4])                                 # 20 transitions: full
    seen = []
    for k, batch in enumerate(store.iter_batches(batch_size=5, shuffle=False)):
        check_batch_reads_its_rows(batch, recorded, LiveTable(store))
        seen.append(batch["index"].numpy())
        if k == 0:
            fill(store, [8], recorded)                                      # evicts indices 0..7
    assert [len(s) for s in seen] == [5, 2, 5, 5]
    np.testing.assert_array_equal(np.concatenate(seen), np.r_[0:5, 8:20])


# -- bad arguments -----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"alpha": -0.5}, r"alpha must be .*>= 0, got -0\.5"),
    ({"alpha": float("nan")}, r"alpha .* got nan"),
    ({"beta": 1.5}, r"beta must be in \[0, 1\], got 1\.5"),
    ({"beta": -0.1}, r"beta must be in \[0, 1\], got -0\.1"),
    ({"eps": 0.0}, r"eps must be .*> 0, got 0\.0"),
])
def test_prioritized_sampler_rejects_bad_arguments_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ab.PrioritizedSampler(**kwargs)


@pytest.mark.parametrize("seq_len", [0, -3, 2.5, True])
def test_sequence_sampler_rejects_a_length_below_one_or_not_an_int(seq_len):
    with pytest.raises(ValueError, match=rf"seq_len must be an int >= 1, got {seq_len!r}"):
        ab.SequenceSampler(seq_len=seq_len)


@pytest.mark.parametrize("index, priority, match", [
    ([0, 1, 2], [1.0, 2.0], r"index has 3 entries but priority has 2"),
    ([0, 1], [1.0, -1.0], r"priority must be finite and >= 0, got \[-1\.0\]"),
    ([0, 1], [float("nan"), 1.0], r"priority must be finite and >= 0, got \[nan\]"),
    ([0, 1], [float("inf"), 1.0], r"priority must be finite and >= 0, got \[inf\]"),
    ([0.0, 1.0], [1.0, 1.0], r"index must hold integers.*float64"),
])
def test_update_priorities_rejects_bad_input_naming_the_argument_and_value(index, priority, match):
    store, _ = prioritized_store(steps=(4,))
    leaves = store.sampler.tree.leaves.copy()
    with pytest.raises(ValueError, match=match):
        store.update_priorities(np.array(index), np.array(priority))
    np.testing.assert_array_equal(store.sampler.tree.leaves, leaves)


def test_update_priorities_on_a_store_without_priorities_names_its_sampler():
    store = make_store(10, ab.SequenceSampler(seq_len=2))
    fill(store, [3])
    with pytest.raises(ValueError, match=r"needs a PrioritizedSampler; this store uses SequenceSampler\(seq_len=2"):
        store.update_priorities([0], [1.0])


def test_a_sampler_serves_one_store_only():
    sampler = ab.PrioritizedSampler()
    make_store(10, sampler)
    with pytest.raises(ValueError, match="already used by another store"):
        make_store(10, sampler)


def test_a_drop_last_batch_larger_than_the_store_fails_without_starting_epochs():
    sampler = ab.WithoutReplacementSampler(drop_last=True)
    store = make_store(100, sampler)
    store.add_episode(make_episode(0, 5))
    with pytest.raises(ValueError, match="drop_last=True"):
        store.sample(6)
    assert sampler.epoch == 0
    assert store.sample(5)["index"].shape == (5,)


def test_num_workers_with_short_epoch_batches_is_refused_before_sampling():
    sampler = ab.WithoutReplacementSampler(drop_last=False)
    store = make_store(100, sampler)
    store.add_episode(make_episode(0, 5))
    with pytest.raises(ValueError, match="drop_last=True"):
        store.sample(4, num_workers=2)
    assert store.stats()["samples"] == 0 and sampler.epoch == 0


def test_sequence_sampler_keeps_its_former_length_argument_as_a_deprecated_alias():
    with pytest.warns(DeprecationWarning, match="seq_len"):
        sampler = ab.SequenceSampler(length=4, strict=False)
    assert (sampler.seq_len, sampler.strict) == (4, False)
    with pytest.raises(TypeError, match="seq_len=3 and its former name length=4"):
        ab.SequenceSampler(3, length=4)
    with pytest.raises(TypeError, match="needs seq_len"):
        ab.SequenceSampler()
