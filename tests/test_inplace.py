"""Step writers that write in place (`arrowbuf.inplace`): every step once, straight into the
arena rows it keeps, sampleable as soon as its next observation is known.

The reference is the steps the scripted envs played (`FakeVectorRollout`'s tags: row
``[tag, t]`` is step t of the episode tagged ``tag``), not a model of the layout: the
checks hold for any placement of regions and pieces, with evictions, wraps and open tails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.episodes import StepWriter
from arrowbuf.played import entries_arrow

from support.compare import column_numpy
from support.envs import FakeVectorRollout
from support.episodes import EPISODE_SCHEMA, ExpectedEpisode, decode, tagged_action, tagged_obs, tagged_reward

MODES = ["next_step", "same_step", "disabled"]


@dataclass(frozen=True)
class Piece:
    """One row of ``episodes(include_open=True)``, with the tag its rows were written with."""

    tag: int
    first_step: int
    length: int
    first_row: int
    open: bool
    terminated: bool
    truncated: bool
    ret: float
    has_final: bool = True


def cut(rollout: FakeVectorRollout) -> None:
    """`FakeVectorRollout.flush` mid-rollout: the cut episodes are recorded, and each env
    goes on with a new episode (a new tag) from step 0, as after a writer's `flush`."""
    cut_envs = [e for e in range(rollout.num_envs) if rollout.t[e] > 0]
    rollout.flush()
    for e in cut_envs:
        rollout.tag[e] = rollout._new_tag()


def played(rollouts: list[FakeVectorRollout], whole: list = ()) -> tuple[set[tuple[int, int]], dict[int, object]]:
    """Every complete transition the rollouts played (and the ``whole`` episodes added
    with `add_episode`), and their ended episodes by tag."""
    steps, ended = set(), {}
    for e in whole:
        steps |= {(e.tag, t) for t in range(e.length)}
        ended[e.tag] = e
    for rollout in rollouts:
        for e in rollout.sealed:
            steps |= {(e.tag, t) for t in range(e.steps)}
            ended[e.tag] = e
        for env in range(rollout.num_envs):
            if not rollout.resetting[env]:
                steps |= {(rollout.tag[env], t) for t in range(rollout.t[env])}
    return steps, ended


def pieces_of(store: ab.ExperienceStore) -> list[Piece]:
    table = entries_arrow(store.engine.table, include_open=True).to_pylist()   # the stored pieces
    obs = store.engine.shard.reader("obs")
    out = []
    for row in table:
        tag, first = decode(obs[np.array([row["first_row"]])])
        out.append(Piece(int(tag[0]), row.get("first_step", 0), row["length"], row["first_row"],
                         bool(row.get("open", False)), row["terminated"], row["truncated"], row["return"],
                         row["has_final"] or bool(row.get("open", False))))
    return out


def held_run(at: dict, tag: int, t: int) -> tuple[int, int]:
    """The run of steps of episode ``tag`` held around step t (pieces read as one episode
    across their boundaries): transitions ``lo .. hi - 1``, observations ``lo .. hi``."""
    lo, hi = t, t
    while (tag, lo - 1) in at:
        lo -= 1
    while (tag, hi) in at:
        hi += 1
    return lo, hi


def check_store(store: ab.ExperienceStore, rollouts: list[FakeVectorRollout], *, evicts: bool,
                whole: list = ()) -> None:
    """The store against the played steps: pieces, counts, an epoch, samples, n-step
    returns, frame stacks. ``evicts``: whether the ring may have dropped played steps;
    ``whole``: episodes added with `add_episode`."""
    steps, ended = played(rollouts, whole)
    pieces = pieces_of(store)
    at: dict[tuple[int, int], Piece] = {}
    shard = store.engine.shard
    for p in pieces:
        rows = np.arange(p.first_row, p.first_row + p.length + 1)
        np.testing.assert_array_equal(shard.reader("obs")[rows], tagged_obs(p.tag, p.first_step + np.arange(p.length + 1)))
        np.testing.assert_array_equal(shard.reader("action")[rows[:-1]], tagged_action(p.tag, p.first_step + np.arange(p.length)))
        for s in range(p.first_step, p.first_step + p.length):
            assert (p.tag, s) not in at, f"step {s} of episode {p.tag} is stored twice"
            assert (p.tag, s) in steps, f"step {s} of episode {p.tag} was never played"
            at[(p.tag, s)] = p
        if not p.open:
            episode = ended.get(p.tag)
            last = episode is not None and p.first_step + p.length == episode.length
            assert p.terminated == (last and episode.terminated) and p.truncated == (last and episode.truncated)
            steps_of = p.length + (0 if p.has_final else 1)   # without its final observation: one step more
            assert p.ret == pytest.approx(float(tagged_reward(p.tag, p.first_step + np.arange(steps_of)).sum()))
            if p.has_final:
                assert shard.reader("action")[np.array([p.first_row + p.length])][0] == 0, "the final row holds zeros"
    assert len(store) == len(at) == sum(p.length for p in pieces)
    # Pieces are storage: an episode counts once, when its end is stored.
    going_on = {p.tag for p in pieces if p.open}
    assert store.num_episodes == len({p.tag for p in pieces} - going_on) == store.episodes().num_rows
    if not evicts:
        assert set(at) == steps, "a played step is missing"
    # Open tails are the freshest steps: every step of each env's open piece is there.
    for rollout in rollouts:
        for env in range(rollout.num_envs):
            tag = rollout.tag[env]
            mine = [p for p in pieces if p.tag == tag and p.open]
            if mine:
                assert mine[0].first_step + mine[0].length == rollout.t[env]

    if not len(store):
        with pytest.raises(ab.EmptyStoreError):
            store.sample(4)
        return
    seen = []
    for batch in store.iter_batches(7, shuffle=True):
        tag, step = decode(batch["obs"])
        np.testing.assert_array_equal(batch["step"].numpy(), step)
        np.testing.assert_array_equal(np.asarray(batch["next", "obs"]), tagged_obs(tag, step + 1))
        seen += list(zip(tag.tolist(), step.tolist()))
    assert len(seen) == len(set(seen)) == len(at), "an epoch reads every transition exactly once"
    assert set(seen) == set(at)

    batch = store.sample(64)
    tag, step = decode(batch["obs"])
    assert {(a, b) for a, b in zip(tag.tolist(), step.tolist())} <= set(at)
    np.testing.assert_array_equal(batch["step"].numpy(), step)
    np.testing.assert_array_equal(np.asarray(batch["next", "obs"]), tagged_obs(tag, step + 1))
    np.testing.assert_array_equal(batch["action"].numpy(), tagged_action(tag, step))
    np.testing.assert_array_equal(batch["reward"].numpy(), tagged_reward(tag, step))

    n, gamma = 3, 0.5
    batch = store.sample(64, n_step=n, gamma=gamma)
    tag, step = decode(batch["obs"])
    for i, (a, t) in enumerate(zip(tag.tolist(), step.tolist())):
        _, hi = held_run(at, a, t)
        k = min(n, hi - t)   # across pieces; stops at the last held (an open tail's last written) step
        assert batch["n_steps"][i] == k
        assert float(batch["reward"][i]) == pytest.approx(float(sum(gamma ** j * tagged_reward(a, t + j) for j in range(k))))
        np.testing.assert_array_equal(np.asarray(batch["next", "obs"][i]), tagged_obs(a, t + k))
        q = at[(a, t + k - 1)]   # the piece of the window's last step
        assert bool(batch["terminated"][i]) == (t + k == q.first_step + q.length and q.terminated and q.has_final)

    frames = 3
    batch = store.sample(64, frame_stack=frames)
    obs = np.asarray(batch["obs"])
    assert obs.shape == (64, frames, 2)
    tag, step = decode(obs[:, -1])
    for i, (a, t) in enumerate(zip(tag.tolist(), step.tolist())):
        lo, _ = held_run(at, a, t)
        expect = np.maximum(t - np.arange(frames - 1, -1, -1), lo)   # held rows of the episode, across pieces
        np.testing.assert_array_equal(obs[i], tagged_obs(a, expect))
        np.testing.assert_array_equal(np.asarray(batch["next", "obs"][i]),
                                      tagged_obs(a, np.maximum(t + 1 - np.arange(frames - 1, -1, -1), lo)))


# -- property tests ---------------------------------------------------------------------------


EPISODE_LENGTHS = st.lists(st.lists(st.integers(1, 12), min_size=1, max_size=4), min_size=1, max_size=3)
OPS = st.lists(st.tuples(st.sampled_from([0, 1, "episode"]), st.integers(1, 9), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(mode=st.sampled_from(MODES), capacity=st.one_of(st.integers(8, 80), st.just(100_000)),
       lengths=st.tuples(EPISODE_LENGTHS, EPISODE_LENGTHS), ops=OPS)
# 4 envs in 28 rows: the head wrapped onto the open region of an env stepped in the same
# call, which then wrote its step into rows another env's new region held.
@example(mode="same_step", capacity=28, lengths=([[5], [1], [1]], [[1]]), ops=[(0, 5, False)])
# Regions of 2 rows: a piece a step; n-step returns and frame stacks cross the pieces.
@example(mode="next_step", capacity=8, lengths=([[2]], [[1]]), ops=[(0, 1, False), (0, 1, False)])
@example(mode="disabled", capacity=12, lengths=([[11]], [[3, 5]]), ops=[(0, 6, False), (1, 4, False), (0, 4, True)])
def test_in_place_writers_store_exactly_the_played_steps_under_any_interleaving(mode, capacity, lengths, ops):
    store = ab.ExperienceStore(capacity=capacity, seed=0, schema=EPISODE_SCHEMA)
    rollouts = [FakeVectorRollout(lengths[k], mode, first_tag=1000 * k) for k in range(2)]
    writers = [store.writer(num_envs=r.num_envs, autoreset_mode=mode) for r in rollouts]
    whole = []   # whole episodes added between the writers' steps
    for which, count, flag in ops:
        if which == "episode":
            if count + int(flag) <= capacity // 2:
                whole.append(ExpectedEpisode(5000 + len(whole), count, flag, terminated=True))
                store.add_episode(whole[-1].arrays)
            continue
        for _ in range(count):
            writers[which].add(**rollouts[which].step_arrays())
        if flag:
            writers[which].flush()
            cut(rollouts[which])
        check_store(store, rollouts, evicts=capacity < 100_000, whole=whole)   # 100k rows: room for all



@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(["tokens", "obs"]), mode=st.sampled_from(MODES), budget=st.integers(400, 2_000),
       capacity=st.one_of(st.integers(8, 80), st.just(100_000)), lengths=st.tuples(EPISODE_LENGTHS, EPISODE_LENGTHS),
       ops=OPS)
@example(kind="obs", mode="same_step", budget=400, capacity=100_000, lengths=([[12, 12], [12], [12]], [[12]] * 4),
         ops=[(0, 9, False), (1, 9, True), (0, 9, False)])
def test_in_place_writers_hold_max_bytes_and_every_step_they_keep_under_any_interleaving(kind, mode, budget, capacity,
                                                                                         lengths, ops):
    # 1b3f084: writers' open tails were never evicted for max_bytes: they held a few times the budget.
    field = ab.Field("int64", (None,), max_bytes=budget) if kind == "tokens" else \
        ab.Field("float64", (2,), observation=True, codec="zstd", max_bytes=budget)
    store = ab.ExperienceStore(capacity=capacity, seed=0, schema={**EPISODE_SCHEMA.fields, kind: field})
    column = store.engine.shard.arena[kind]
    rollouts = [FakeVectorRollout(lengths[k], mode, first_tag=1000 * k) for k in range(2)]
    writers = [store.writer(num_envs=r.num_envs, autoreset_mode=mode) for r in rollouts]
    for which, count, flag in ops:
        if which == "episode":
            continue
        for _ in range(count):
            step = rollouts[which].step_arrays()
            if kind == "tokens":   # 8 tokens a step (64 bytes), read back from the action
                step["tokens"] = [np.full(8, action) for action in step["action"].tolist()]
            writers[which].add(**step)
            assert column.heap.live <= budget
        if flag:
            writers[which].flush()
            cut(rollouts[which])
        check_store(store, rollouts, evicts=True)
        if kind == "tokens" and len(store):
            batch = store.sample(16)
            np.testing.assert_array_equal(batch["tokens"].values().numpy(), np.repeat(batch["action"].numpy(), 8))

@settings(max_examples=15, deadline=None)
@given(capacity=st.integers(12, 60), lengths=st.lists(st.lists(st.integers(1, 30), min_size=1, max_size=3),
                                                    min_size=1, max_size=3), num_steps=st.integers(1, 80))
def test_a_torch_arena_writer_stores_exactly_the_played_steps(capacity, lengths, num_steps):
    store = ab.ExperienceStore(capacity=capacity, seed=0, schema=EPISODE_SCHEMA, storage_device="cpu")
    rollout = FakeVectorRollout(lengths, "same_step")
    writer = store.writer(num_envs=rollout.num_envs, autoreset_mode="same_step")
    for _ in range(num_steps):
        step = rollout.step_arrays()
        writer.add(**{k: torch.from_numpy(v) if isinstance(v, np.ndarray) and v.dtype != object else v
                      for k, v in step.items()})
    check_store(store, [rollout], evicts=True)


@settings(max_examples=20, deadline=None)
@given(capacity=st.integers(10, 60), seq_len=st.integers(1, 6), lengths=st.lists(
    st.lists(st.integers(1, 15), min_size=1, max_size=3), min_size=1, max_size=3), num_steps=st.integers(1, 60))
@example(capacity=10, seq_len=2, lengths=[[2]], num_steps=2)   # regions of 2 rows: a piece a step
@example(capacity=12, seq_len=5, lengths=[[9]], num_steps=8)    # windows over 3 pieces
def test_sequence_windows_cross_pieces_and_stop_at_the_last_held_step(capacity, seq_len, lengths, num_steps):
    store = ab.ExperienceStore(capacity=capacity, seed=0, schema=EPISODE_SCHEMA,
                               sampler=ab.SequenceSampler(seq_len, strict=False))
    rollout = FakeVectorRollout(lengths, "disabled")
    writer = store.writer(num_envs=rollout.num_envs, autoreset_mode="disabled")
    for _ in range(num_steps):
        writer.add(**rollout.step_arrays())
    at = {(p.tag, s): p for p in pieces_of(store) for s in range(p.first_step, p.first_step + p.length)}
    batch = store.sample(32)
    obs, mask = np.asarray(batch["obs"]), batch["mask"].numpy()
    tag, step = decode(obs[:, 0])
    for i, (a, t) in enumerate(zip(tag.tolist(), step.tolist())):
        valid = min(seq_len, held_run(at, a, t)[1] - t)   # across pieces, to the last held step
        np.testing.assert_array_equal(mask[i], np.arange(seq_len) < valid)
        np.testing.assert_array_equal(obs[i, :valid], tagged_obs(a, t + np.arange(valid)))
        np.testing.assert_array_equal(np.asarray(batch["next", "obs"][i, :valid]), tagged_obs(a, t + 1 + np.arange(valid)))
        np.testing.assert_array_equal(batch["step"][i, :valid].numpy(), t + np.arange(valid))
        np.testing.assert_array_equal(batch["action"][i, :valid].numpy(), tagged_action(a, t + np.arange(valid)))


# -- continuing tasks, eviction of open regions, limits --------------------------------------


def test_a_continuing_task_streams_ten_capacities_through_a_small_ring_and_samples_every_step():
    capacity = 64
    store = ab.ExperienceStore(capacity=capacity, seed=3, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[10 ** 9]], "disabled")   # one env, no episode end
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    with pytest.raises(ab.EmptyStoreError):
        store.sample(4)
    for t in range(1, 10 * capacity + 1):
        writer.add(**rollout.step_arrays())
        assert len(store) >= min(t, capacity // 2), "the freshest steps are sampleable at once"
        batch = store.sample(16)
        tag, step = decode(batch["obs"])
        assert (tag == 0).all() and (step < t).all() and (step >= t - capacity).all()
        np.testing.assert_array_equal(batch["step"].numpy(), step)
        np.testing.assert_array_equal(np.asarray(batch["next", "obs"]), tagged_obs(0, step + 1))
        np.testing.assert_array_equal(batch["action"].numpy(), tagged_action(0, step))
        np.testing.assert_array_equal(batch["reward"].numpy(), tagged_reward(0, step))
        epoch = sorted(s for b in store.iter_batches(64, shuffle=False) for s in b["step"].tolist())
        assert epoch == list(range(t - len(store), t)), "the newest steps, each once, the latest included"
    # One played episode, still going on: its pieces are storage, it is listed once, as open.
    listed = store.episodes(include_open=True)
    assert writer.open_steps[0] > 0 and store.num_episodes == 0
    assert listed.column("open").to_pylist() == [True] and listed.column("length").to_pylist() == [len(store)]
    check_store(store, [rollout], evicts=True)
    pieces = pieces_of(store)
    assert all(p.tag == 0 and not p.terminated and not p.truncated for p in pieces)
    assert [p.first_step for p in pieces] == sorted(p.first_step for p in pieces)


def test_eviction_takes_an_open_episodes_oldest_steps_first_a_whole_piece_at_a_time():
    # Two envs step together, never ending (issue 25: what eviction does to an open episode).
    store = ab.ExperienceStore(capacity=48, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[10 ** 9], [10 ** 9]], "disabled")
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    earliest = [0, 0]
    evicted_some = False
    for t in range(1, 6 * 48):
        writer.add(**rollout.step_arrays())
        pieces = pieces_of(store)
        for env in range(2):
            mine = sorted((p for p in pieces if p.tag == env), key=lambda p: p.first_step)
            held = [s for p in mine for s in range(p.first_step, p.first_step + p.length)]
            # The newest steps stay, the oldest go first: a suffix of the played steps,
            # whose start only moves on, and only to where a piece began.
            assert held == list(range(held[0], t)), f"env {env} at step {t}: held steps {held}"
            assert held[0] >= earliest[env] and held[0] == mine[0].first_step
            evicted_some |= held[0] > earliest[env]
            earliest[env] = held[0]
            assert mine[-1].open and mine[-1].first_step + mine[-1].length == t, "the open tail is never evicted"
        assert len(store) >= min(2 * t, 48 // 2), "pieces of a quarter ring at most: half the ring stays sampleable"
    assert evicted_some and min(earliest) > 48
    # Reads start at the earliest held step: a frame stack there repeats its frame.
    batch = store.sample(256, frame_stack=4)
    tag, step = decode(np.asarray(batch["obs"])[:, -1])
    at_earliest = np.flatnonzero(step == np.array(earliest)[tag])
    assert len(at_earliest), "256 draws of a few dozen steps reach the earliest held ones"
    for i in at_earliest:
        np.testing.assert_array_equal(np.asarray(batch["obs"][i]), tagged_obs(tag[i], [step[i]] * 4))
    check_store(store, [rollout], evicts=True)


def test_a_writer_that_stalls_keeps_its_open_steps_while_another_streams_past_the_capacity():
    store = ab.ExperienceStore(capacity=24, seed=0, schema=EPISODE_SCHEMA)
    slow, fast = FakeVectorRollout([[100]], "disabled"), FakeVectorRollout([[5]], "disabled", first_tag=50)
    slow_writer = store.writer(num_envs=1, autoreset_mode="disabled")
    fast_writer = store.writer(num_envs=1, autoreset_mode="disabled")
    for _ in range(3):
        slow_writer.add(**slow.step_arrays())
    assert store.episodes(include_open=True).column("length").to_pylist() == [3]
    for _ in range(60):   # laps the ring: the sealed pieces go oldest first, open tails last
        fast_writer.add(**fast.step_arrays())
        assert len(store) == min(24, 4 + _)
    assert slow_writer.open_steps.tolist() == [3], "its open steps stay in its region"
    slow_writer.add(**slow.step_arrays())   # its episode goes on in its region, from step 3
    mine = [p for p in pieces_of(store) if p.tag == 0]
    assert [(p.first_step, p.length, p.open) for p in mine] == [(0, 4, True)]
    check_store(store, [slow, fast], evicts=True)


def test_regions_shrink_to_fit_many_envs_and_a_step_of_more_envs_than_the_capacity_is_refused():
    store = ab.ExperienceStore(capacity=16, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[40]] * 8, "disabled")
    writer = store.writer(num_envs=8, autoreset_mode="disabled")
    for _ in range(30):   # 8 envs, 16 transitions: regions of 2 rows, a piece a step
        writer.add(**rollout.step_arrays())
    check_store(store, [rollout], evicts=True)
    assert len(store) == 16   # (8 when the capacity counted rows: a repeated observation a piece)
    small = ab.ExperienceStore(capacity=2, seed=0, schema=EPISODE_SCHEMA)
    writer = small.writer(num_envs=3, autoreset_mode="disabled")
    with pytest.raises(ab.CapacityError, match="a step of 3 envs is 3 transitions, more than the store's capacity=2"):
        writer.add(**FakeVectorRollout([[4]] * 3, "disabled").step_arrays())
    assert len(small) == 0 and small.num_episodes == 0


def test_an_episode_longer_than_the_capacity_is_stored_in_linked_pieces():
    store = ab.ExperienceStore(capacity=20, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[45, 3]], "disabled")
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    for _ in range(48):
        writer.add(**rollout.step_arrays())
    assert writer.episodes_written == 2
    pieces = [p for p in pieces_of(store) if p.tag == 0]
    assert pieces and pieces[-1].first_step + pieces[-1].length == 45 and pieces[-1].terminated
    check_store(store, [rollout], evicts=True)


def test_obs_is_read_at_a_pieces_first_step_only_and_next_obs_stored_once():
    store = ab.ExperienceStore(capacity=100, seed=0, schema=EPISODE_SCHEMA)
    writer = store.writer(num_envs=1, autoreset_mode="disabled")
    step = {"action": np.zeros(1, np.int64), "reward": np.zeros(1), "terminated": np.zeros(1, bool),
            "truncated": np.zeros(1, bool)}
    writer.add(obs=tagged_obs(7, [0]), next_obs=tagged_obs(7, [1]), **step)
    with pytest.raises(ab.ObservationMismatchError, match="step 1"):   # obs 1 is next_obs 0's: never replaced
        writer.add(obs=np.full((1, 2), -5.0), next_obs=tagged_obs(7, [2]), **step)
    writer.add(obs=tagged_obs(7, [1]), next_obs=tagged_obs(7, [2]), **step)
    batch = store.sample(32)
    assert sorted(set(decode(batch["obs"])[1].tolist())) == [0, 1]
    assert (np.asarray(batch["obs"]) != -5).all()


def test_clear_drops_open_tails_and_open_episodes_continue_in_new_regions():
    store = ab.ExperienceStore(capacity=40, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[30], [7]], "disabled")
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    for _ in range(5):
        writer.add(**rollout.step_arrays())
    store.clear()
    assert len(store) == 0 and writer.open_steps.tolist() == [0, 0]
    writer.add(**rollout.step_arrays())
    assert sorted((p.tag, p.first_step, p.length) for p in pieces_of(store)) == [(0, 5, 1), (1, 5, 1)]


def test_a_staged_writer_is_used_where_a_write_may_be_refused():
    for kwargs in ({"mode": "fixed"}, {"rate_limiter": ab.SampleToInsertRatio(1.0, min_size=1, error_buffer=100)}):
        store = ab.ExperienceStore(capacity=40, seed=0, schema=EPISODE_SCHEMA, **kwargs)
        rollout = FakeVectorRollout([[3]], "disabled")
        writer = store.writer(num_envs=1, autoreset_mode="disabled")
        writer.add(**rollout.step_arrays())
        assert len(store) == 0 and writer.open_steps.tolist() == [1], "staged until the episode ends"
    assert isinstance(writer, StepWriter)


# -- persistence of stores with open episodes ---------------------------------------------------


def test_a_checkpoint_keeps_open_tails_sampleable_and_the_loaded_writer_continues_them_in_place(tmp_path):
    store = ab.ExperienceStore(capacity=60, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[9, 4], [30]], "same_step")
    writer = store.writer(num_envs=2, autoreset_mode="same_step", name="actor")
    for _ in range(40):   # wraps the ring: pieces, evictions, two open tails
        writer.add(**rollout.step_arrays())
    assert store.episodes(include_open=True).column("open").to_pylist().count(True) == 2
    store.save(tmp_path / "ckpt")
    loaded = ab.ExperienceStore.load(tmp_path / "ckpt")
    restored = loaded.writer(num_envs=2, autoreset_mode="same_step", name="actor")
    assert len(loaded) == len(store) and loaded.num_episodes == store.num_episodes
    keep = ["first_row", "num_rows", "length", "first_step", "open", "terminated", "truncated", "env_id"]
    assert loaded.episodes(include_open=True).select(keep) == store.episodes(include_open=True).select(keep)
    check_store(loaded, [rollout], evicts=True)
    twin = FakeVectorRollout([[9, 4], [30]], "same_step")
    for _ in range(40):
        twin.step_arrays()
    for _ in range(25):
        writer.add(**rollout.step_arrays())
        restored.add(**twin.step_arrays())
    assert loaded.episodes(include_open=True).select(keep) == store.episodes(include_open=True).select(keep)
    check_store(loaded, [twin], evicts=True)


def test_parquet_exports_every_written_step_of_a_store_with_open_episodes(tmp_path):
    # The export holds what to_arrow() reads, as a Ray store's does: an open episode up to its last
    # written step and the observation after it (it held the sealed pieces only, cut where the ring was).
    store = ab.ExperienceStore(capacity=50, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[7], [70]], "disabled")
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    for _ in range(45):
        writer.add(**rollout.step_arrays())
    pieces = entries_arrow(store.engine.table, include_open=True)
    open_steps = int(pieces.filter(pieces.column("open")).column("length").to_numpy().sum())
    assert open_steps > 0 and store.num_episodes > 0
    store.to_parquet(tmp_path / "out")
    loaded = ab.ExperienceStore.from_parquet(tmp_path / "out")
    listed = store.episodes(include_open=True)
    assert len(loaded) == len(store) and loaded.to_arrow().num_rows == store.to_arrow().num_rows
    # One row per played episode, its pieces read as one (an open one: up to its last written step);
    # ids are renumbered on import (they are not consecutive: an id is an episode's first piece's).
    exported = loaded.episodes()
    assert exported.num_rows == listed.num_rows
    assert exported.column("first_step").to_pylist() == listed.column("first_step").to_pylist()
    assert exported.column("return").to_pylist() == listed.column("return").to_pylist()
    for episode_id in exported.column("episode_id").to_pylist():
        rows = loaded.episode(episode_id)
        tag, step = decode(np.asarray(column_numpy(rows.column("obs"))))
        assert len(set(tag.tolist())) == 1 and np.array_equal(step, step[0] + np.arange(len(step)))
    batch = loaded.sample(64)
    tag, step = decode(batch["obs"])
    np.testing.assert_array_equal(batch["step"].numpy(), step)
    np.testing.assert_array_equal(np.asarray(batch["next", "obs"]), tagged_obs(tag, step + 1))
    np.testing.assert_array_equal(batch["action"].numpy(), tagged_action(tag, step))



def test_a_step_counts_as_an_insert_once_written_whether_written_or_loaded_in_place():
    # As a Ray shard counts a shipped piece's steps: stats()["inserts"] counted them only once sealed.
    stores = [ab.ExperienceStore(40, seed=0, schema=EPISODE_SCHEMA, mode=mode) for mode in ("fixed", "circular")]
    writers = [store.writer(num_envs=2, autoreset_mode="disabled") for store in stores]
    rollout = FakeVectorRollout([[30], [30]], "disabled")
    for _ in range(3):
        writers[0].add(**rollout.step_arrays())   # fixed: staged, not in the store
    assert len(stores[0]) == stores[0].stats()["inserts"] == 0
    writers[1].load_state_dict(writers[0].state_dict())   # the staged steps, written in place
    writers[1].add(**rollout.step_arrays())
    assert len(stores[1]) == stores[1].stats()["inserts"] == 8 and stores[1].num_episodes == 0

@pytest.mark.parametrize("sampler", [lambda: ab.PrioritizedSampler(), lambda: ab.SequenceSampler(2),
                                     lambda: ab.EpisodeSampler(), lambda: ab.WithoutReplacementSampler()])
def test_samplers_of_sealed_episodes_wait_for_a_seal_and_never_draw_open_tails(sampler):
    store = ab.ExperienceStore(capacity=100, seed=0, schema=EPISODE_SCHEMA, sampler=sampler())
    rollout = FakeVectorRollout([[3], [50]], "disabled")
    writer = store.writer(num_envs=2, autoreset_mode="disabled")
    writer.add(**rollout.step_arrays())
    assert len(store) == 2 and store.num_episodes == 0
    with pytest.raises(ab.EmptyStoreError, match="draws sealed episodes"):
        store.sample(4)
    for _ in range(4):
        writer.add(**rollout.step_arrays())   # env 0's episode (tag 0) is sealed at step 3, its next is open
    tag, _ = decode(store.sample(16)["obs"])
    assert set(tag.reshape(-1).tolist()) == {0}, "only the sealed episode is drawn"


def test_a_new_writer_per_rollout_reuses_the_regions_and_slots_of_the_writers_before():
    store = ab.ExperienceStore(capacity=2 * 4 * 11, seed=0, schema=EPISODE_SCHEMA)
    rows = set()
    for rollout_number in range(6):
        rollout = FakeVectorRollout([[10]] * 4, "disabled", first_tag=100 * rollout_number)
        with store.writer(num_envs=4, autoreset_mode="disabled") as writer:
            for _ in range(10):
                writer.add(**rollout.step_arrays())
        table = store.episodes()
        rows |= set(table.column("first_row").to_pylist())
        assert table.column("length").to_pylist() == [10] * 4
        check_store(store, [rollout], evicts=False)
        store.clear()
    assert len(rows) == 4, "every rollout wrote the same (warm) rows"
    assert store.engine.shard.regions.size == 4, "released slots are reused"


def test_a_writer_state_with_regions_past_the_capacity_rows_loads():
    # Capacity counts transitions: the ring's rows reach past it (final observations, regions'
    # repeated rows), so a saved writer's regions may lie there; its state loads back.
    store = ab.ExperienceStore(capacity=8, seed=0)
    writer = store.writer(2, autoreset_mode="disabled")
    for t in range(40):
        done = np.array([t % 3 == 2, t % 5 == 4])
        writer.add(obs=np.full((2, 2), t, float), action=np.zeros(2), reward=np.ones(2, np.float32),
                   terminated=done, truncated=np.zeros(2, bool), next_obs=np.full((2, 2), t + 1, float))
    state = writer.state_dict()
    assert (state["regions"]["end"][state["regions"]["held"]] > store.capacity).any(), "a region past row 8"
    restored = store.writer(2, autoreset_mode="disabled")
    restored.load_state_dict(state)
    assert restored.open_steps.tolist() == writer.open_steps.tolist()


# -- byte budgets (max_bytes) -------------------------------------------------------------------------


def _frame(env: int, episode: int, t: int) -> np.ndarray:
    """Observation t of an env's episode: 64 random (incompressible) bytes, made again from its tag."""
    return np.random.default_rng([env, episode, t]).integers(0, 256, 64, dtype=np.uint8)


def _tag(env: Any, episode: Any, t: Any) -> Any:
    return env * 10_000 + episode * 100 + t


@pytest.mark.parametrize("kind", ["ragged", "zstd"])
@pytest.mark.parametrize("num_envs", [1, 4])
def test_an_in_place_writer_holds_a_fields_max_bytes_of_one_episode_and_refuses_a_larger_step(kind, num_envs):
    # 1b3f084: writers' open tails were never evicted for max_bytes (4 envs held 4 times a budget of
    # one episode's bytes), and a step larger than the whole budget evicted everything, then was
    # stored over it.
    T = 10
    from arrowbuf.codecs import encode_rows, parse_codec

    row = len(encode_rows(parse_codec("zstd", "uint8", (64,), "obs"), _frame(0, 0, 0)[None])[0])
    budget = (T + 1) * row if kind == "zstd" else T * 64   # one episode: 11 encoded rows, or 10 x 8 int64 tokens
    fields = {"obs": ab.Field("uint8", (64,), observation=True, codec="zstd" if kind == "zstd" else None,
                              max_bytes=budget if kind == "zstd" else None),
              "action": ab.Field("int64"), "reward": ab.Field("float32"), "terminated": ab.Field("bool"),
              "truncated": ab.Field("bool")}
    if kind == "ragged":
        fields["tokens"] = ab.Field("int64", (None,), max_bytes=budget)
    store = ab.ExperienceStore(capacity=1_000, schema=fields, seed=0)
    column = store.engine.shard.arena["obs" if kind == "zstd" else "tokens"]
    writer = store.writer(num_envs=num_envs, autoreset_mode="same_step")
    envs = np.arange(num_envs)

    def step(episode: int, t: int, tokens: list | None = None) -> dict:
        tags = _tag(envs, episode, t)
        end = t == T - 1
        return {"obs": np.stack([_frame(e, episode, t) for e in envs]), "action": tags,
                "reward": np.ones(num_envs, np.float32), "terminated": np.full(num_envs, end), "truncated": np.zeros(num_envs, bool),
                "next_obs": np.stack([_frame(e, episode + end, 0 if end else t + 1) for e in envs]),
                "final_obs": np.stack([_frame(e, episode, T) for e in envs]) if end else None,
                **({"tokens": tokens or [np.full(8, tag) for tag in tags]} if kind == "ragged" else {})}

    for episode in range(3):
        for t in range(T):
            writer.add(**step(episode, t))
            assert column.heap.live <= budget
        batch = store.sample(64)
        tags = batch["action"].numpy()
        env, ep, t = tags // 10_000, tags // 100 % 100, tags % 100
        np.testing.assert_array_equal(batch["obs"].numpy(), [_frame(*key) for key in zip(env, ep, t)])
        np.testing.assert_array_equal(batch["next", "obs"].numpy(), [_frame(*key) for key in zip(env, ep, t + 1)])
        if kind == "ragged":
            np.testing.assert_array_equal(batch["tokens"].values().numpy(), np.repeat(tags, 8))
    # The budget holds the newest steps it can: an episode's tokens, or its rows less the open tails'
    # last observations (one an env), which no eviction frees.
    assert len(store) >= (T if kind == "ragged" else T + 1 - num_envs)
    before = len(store), store.episodes(include_open=True).to_pylist(), column.heap.live
    if kind == "ragged":   # one row of more tokens than the budget holds
        big = [np.zeros(T * 8 + 1, np.int64)] + [np.zeros(1, np.int64)] * (num_envs - 1)
        with pytest.raises(ab.CapacityError, match=rf"field 'tokens': a step of {num_envs} env\(s\) writes "
                                                   rf"{(T * 8 + num_envs) * 8:,} bytes of values, more than the "
                                                   rf"{budget:,} bytes its max_bytes={budget:,} gives this store"):
            writer.add(**step(3, 0, big))
        assert (len(store), store.episodes(include_open=True).to_pylist(), column.heap.live) == before
        writer.add(**step(3, 0))
    small = ab.ExperienceStore(capacity=100, schema={**fields, "obs": ab.Field(
        "uint8", (64,), observation=True, codec="zstd", max_bytes=row - 1)} if kind == "zstd" else fields)
    if kind == "zstd":   # one encoded row more than the whole budget
        with pytest.raises(ab.CapacityError, match=rf"field 'obs': a step of {num_envs} env\(s\) writes "
                                                   rf"{2 * num_envs * row:,} bytes encoded, more than the {row - 1:,}"):
            small.writer(num_envs=num_envs, autoreset_mode="same_step").add(**step(0, 0))
        assert len(small) == 0 and small.episodes(include_open=True).num_rows == 0


# What `EpisodeTable.publish_open` writes for each open tail (the sealed entries' other columns it leaves).
OPEN_COLUMNS = ("episode_id", "env", "first_row", "num_rows", "length", "has_final", "terminated", "truncated",
                "first_step", "prev_piece", "episode", "tail", "first_index")


@settings(max_examples=60, deadline=None)
@given(mode=st.sampled_from(MODES), capacity=st.one_of(st.integers(8, 60), st.just(100_000)),
       lengths=st.tuples(EPISODE_LENGTHS, EPISODE_LENGTHS),
       ops=st.lists(st.tuples(st.sampled_from([0, 1, "episode", "clear"]), st.integers(1, 9), st.booleans()),
                    min_size=1, max_size=10))
@example(mode="next_step", capacity=100_000, lengths=([[9]], [[9]]), ops=[(0, 3, False), ("episode", 2, False),
                                                                          (0, 3, False)])
def test_a_step_that_only_lengthens_the_open_tails_publishes_what_a_full_publish_does(mode, capacity, lengths, ops):
    """A step that seals nothing and reserves nothing writes only the open tails' lengths
    (`OpenRegions.published` says so); after every single step, that equals publishing them whole."""
    store = ab.ExperienceStore(capacity=capacity, seed=0, schema=EPISODE_SCHEMA)
    rollouts = [FakeVectorRollout(lengths[k], mode, first_tag=1000 * k) for k in range(2)]
    writers = [store.writer(num_envs=r.num_envs, autoreset_mode=mode) for r in rollouts]
    table, shard = store.engine.table, store.engine.shard
    publish, calls = table.publish_open, []

    def counted(*tails, grown_only=False):
        calls.append(grown_only)
        publish(*tails, grown_only=grown_only)

    table.publish_open = counted
    for which, count, flag in ops:
        if which == "clear":
            store.clear()
        elif which == "episode" and count + int(flag) <= capacity // 2:
            store.add_episode(ExpectedEpisode(5000 + count, count, flag, terminated=True).arrays)
        for _ in range(count if which in (0, 1) else 0):
            writers[which].add(**rollouts[which].step_arrays())
            seen = {name: table.ecol(name).copy() for name in OPEN_COLUMNS}
            totals = (table.num_open, table.open_total, table.longest, table.sample_range())
            publish(*shard.regions.published()[:-1])   # in full
            for name in OPEN_COLUMNS:
                np.testing.assert_array_equal(seen[name], table.ecol(name), err_msg=name)
            assert totals == (table.num_open, table.open_total, table.longest, table.sample_range())
        if flag and which in (0, 1):
            writers[which].flush()
            cut(rollouts[which])


def test_only_a_step_that_seals_nothing_and_reserves_nothing_writes_the_tails_lengths_alone():
    store = ab.ExperienceStore(capacity=10_000, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[4], [6]], "next_step")
    writer = store.writer(num_envs=2, autoreset_mode="next_step")
    table = store.engine.table
    publish, calls = table.publish_open, []
    table.publish_open = lambda *tails, grown_only=False: (calls.append(grown_only), publish(*tails, grown_only=grown_only))
    for _ in range(6):
        writer.add(**rollout.step_arrays())
    # 1: regions reserved; 2, 3: both tails longer; 4: env 0's episode ends (sealed); 5: env 0's reset step
    # (next_step: not a transition) leaves it without a tail, env 1's grows; 6: env 0's new tail appears.
    assert calls == [False, True, True, False, True, False]
    check_store(store, [rollout], evicts=False, whole=[])


@pytest.mark.parametrize("mode, new_writer", [("disabled", False), ("disabled", True), ("same_step", False),
                                              ("same_step", True), ("next_step", False)])
def test_forty_envs_in_a_store_of_exactly_num_envs_x_t_seal_their_pieces_as_played(mode, new_writer):
    """A flush of 40 envs seals their pieces in one table batch (`EpisodeTable.append_many`), in a
    store of exactly num_envs x T that each rollout fills and the next evicts: pieces, ids, counts,
    returns and samples are the played steps', whether one writer is kept or one made a rollout."""
    envs, T = 40, 20
    store = ab.ExperienceStore(capacity=envs * T, seed=0, schema=EPISODE_SCHEMA)
    rollout = FakeVectorRollout([[3 + (7 * e) % 30, 45] for e in range(envs)], mode)
    batches = []
    writer = None
    for k in range(4):
        if writer is None or new_writer:
            writer = store.writer(num_envs=envs, autoreset_mode=mode)
        for _ in range(T):
            writer.add(**rollout.step_arrays())
        if k == 0:
            table = store.engine.table
            append_many = table.append_many
            table.append_many = lambda *a, **kw: (batches.append(len(a[0])), append_many(*a, **kw))[1]
        writer.flush()
        cut(rollout)
        check_store(store, [rollout], evicts=True)
        if mode == "disabled":
            assert len(store) == envs * T, "each rollout fills the store exactly"
    assert max(batches) == envs, "a flush seals every env's piece in one batch"
