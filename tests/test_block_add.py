"""`add_episodes` of E equal episodes places and copies them as one block (`arrowbuf.block_add`):
what it stores is what E single `add_episode` calls store (the reference: the block path turned
off), row for row, episode for episode, with the same evictions, ids, indices and samples."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import arrowbuf as ab
from arrowbuf.engine import ShardEngine


def batch(rng: np.random.Generator, envs: int, steps: int, final: bool, tag: int) -> dict:
    """E episodes of T steps as [E, T, ...] arrays (obs [E, T + 1, ...] with final observations)."""
    return {"obs": rng.standard_normal((envs, steps + int(final), 3)).astype(np.float32) + tag,
            "action": rng.integers(0, 9, (envs, steps)), "reward": rng.standard_normal((envs, steps)).astype(np.float32),
            "terminated": rng.random((envs, steps)) < 0.3, "truncated": np.zeros((envs, steps), bool),
            "log_prob": rng.standard_normal((envs, steps, 2)).astype(np.float32)}


def contents(store: ab.ExperienceStore) -> tuple:
    episodes = store.episodes().drop_columns(["inserted_at", "first_row"])   # where rows lie: the placement's
    return store.to_arrow().to_pydict(), episodes.to_pydict(), len(store), store.num_episodes


def play(writes: list, capacity: int, sampler=None, blocks: bool = True, monkeypatch=None,
         mode: str = "circular") -> tuple[ab.ExperienceStore, list]:
    """The store after ``writes`` (envs, steps, final observations, lengths), and the errors they raised."""
    if not blocks:
        monkeypatch.setattr(ShardEngine, "add_block", lambda self, episodes, schema=None: None)
    store = ab.ExperienceStore(capacity=capacity, seed=3, sampler=sampler, mode=mode)
    rng = np.random.default_rng(0)
    errors = []
    for tag, (envs, steps, final, lengths, *as_list) in enumerate(writes):
        data = batch(rng, envs, steps, final, tag)
        try:
            if envs == 1 and lengths is None:
                store.add_episode({name: value[0] for name, value in data.items()}, env_id=f"single-{tag}")
            elif as_list and as_list[0]:   # a list of episodes of any lengths
                cut = lengths if lengths is not None else [steps] * envs
                store.add_episodes([{name: value[e, :cut[e] + (final and name == "obs")] for name, value in data.items()}
                                    for e in range(envs)], env_ids=[f"env-{e}" for e in range(envs)])
            else:
                store.add_episodes(data, lengths=lengths, env_ids=[f"env-{e}" for e in range(envs)])
        except ab.CapacityError as err:
            errors.append(str(err))
    if not blocks:
        monkeypatch.undo()
    return store, errors


def assert_blocks_store_what_single_adds_store(writes: list, capacity: int, fixed: bool) -> None:
    """``writes`` played with the block path and without it (the reference) store the same rows, episodes,
    errors and uniform draws."""
    mode = "fixed" if fixed else "circular"
    with pytest.MonkeyPatch.context() as monkeypatch:
        reference, refused = play(writes, capacity, blocks=False, monkeypatch=monkeypatch, mode=mode)
    blocked, errors = play(writes, capacity, mode=mode)
    assert contents(blocked) == contents(reference) and errors == refused
    if len(blocked):
        assert (blocked.sample(32)["index"] == reference.sample(32)["index"]).all()


WRITES = st.lists(st.tuples(st.integers(1, 6), st.integers(1, 7)), min_size=1, max_size=8)


@settings(max_examples=40, deadline=None)
@given(writes=WRITES, capacity=st.integers(8, 60), final=st.booleans(), fixed=st.booleans())
def test_blocks_store_what_single_adds_store_through_every_eviction(writes, capacity, final, fixed):
    """Random batches (a batch of one env is an `add_episode`) into small rings: every write evicts."""
    writes = [(e, t, final, None) for e, t in writes]
    assert_blocks_store_what_single_adds_store(writes, capacity, fixed)


@st.composite
def ragged_writes(draw):
    """Batches of E episodes of lengths in [1, T], given as [E, T] arrays with ``lengths`` or as a list."""
    writes, final = [], draw(st.booleans())
    for envs, steps in draw(WRITES):
        lengths = draw(st.one_of(st.none(), st.lists(st.integers(1, steps), min_size=envs, max_size=envs)))
        writes.append((envs, steps, final, lengths, draw(st.booleans())))
    return writes


@settings(max_examples=40, deadline=None)
@given(writes=ragged_writes(), capacity=st.integers(8, 60), fixed=st.booleans())
def test_batches_of_several_lengths_and_lists_store_what_single_adds_store(writes, capacity, fixed):
    """Episodes of several lengths, with and without final observations, as [E, T] arrays with
    ``lengths`` or as a list of episodes (`Shard.write_parts`), into small rings that every write evicts."""
    assert_blocks_store_what_single_adds_store(writes, capacity, fixed)


def test_a_block_is_one_placement_and_one_copy_a_field(monkeypatch):
    """The WBC shape in small: E envs' episodes of one length go through the block path (counted),
    and episodes of several lengths, or a batch past the capacity, go one by one."""
    import arrowbuf.block_add as block_add

    placed, parts = [], []
    write_block, write_parts = block_add.Shard.write_block, block_add.Shard.write_parts
    monkeypatch.setattr(block_add.Shard, "write_block", lambda self, *a: placed.append(a[0]) or write_block(self, *a))
    monkeypatch.setattr(block_add.Shard, "write_parts", lambda self, *a: parts.append(a[0]) or write_parts(self, *a))
    store, _ = play([(8, 5, True, None)], capacity=100)
    assert sorted(placed) == sorted(store.schema.fields) and store.num_episodes == 8 and not parts
    placed.clear()
    store, _ = play([(8, 5, True, [5, 4, 5, 5, 5, 5, 5, 5]), (6, 3, False, None, True)], capacity=100)
    assert not placed and parts == 2 * sorted(store.schema.fields, key=list(store.schema.fields).index)
    parts.clear()
    play([(30, 5, True, None)], capacity=100)
    assert not placed and not parts   # 150 transitions past a capacity of 100: one by one


def test_a_prioritized_sampler_is_told_of_every_blocked_row(monkeypatch):
    writes = [(6, 4, True, None), (6, 4, True, None), (5, 3, True, None)]
    reference, _ = play(writes, 30, ab.PrioritizedSampler(alpha=0.6), blocks=False, monkeypatch=monkeypatch)
    blocked, _ = play(writes, 30, ab.PrioritizedSampler(alpha=0.6))
    assert contents(blocked) == contents(reference)
    drawn, expected = blocked.sample(4096), reference.sample(4096)
    assert set(drawn["index"].tolist()) == set(expected["index"].tolist())
    # (the draws themselves differ: the sum tree is over arena rows, which the block places otherwise)
    assert set(drawn["weight"].tolist()) == set(expected["weight"].tolist()) == {1.0}   # every row at the max priority


@pytest.mark.parametrize("capacity", [40, 400])
def test_batches_beside_a_live_writer_store_what_single_adds_store(capacity, monkeypatch):
    """Demos added as batches while a writer's episodes are open (published, sampleable): the same
    rows, episodes and open tails either way, through evictions (capacity 40). (A writer's regions
    leave the ring's pieces out of order: `Ring.plan_block` then declines, and the batches go one
    episode at a time; the test holds whichever path a change takes.)"""
    def run() -> tuple:
        store = ab.ExperienceStore(capacity=capacity, seed=0)
        writer = store.writer(num_envs=2, autoreset_mode="same_step")
        rng = np.random.default_rng(5)
        obs = np.zeros((2, 3), np.float32)
        for t in range(30):
            nxt = obs + 1
            writer.add(obs=obs, action=np.full(2, t), reward=np.ones(2, np.float32), terminated=np.zeros(2, bool),
                       truncated=np.zeros(2, bool), next_obs=nxt)
            obs = nxt
            if t % 7 == 3:
                demos = batch(rng, 3, 4, True, t)
                demos.pop("log_prob")
                store.add_episodes(demos, env_ids="demo")
        return contents(store), store.episodes(include_open=True).drop_columns(["inserted_at", "first_row"]).to_pydict()

    blocked = run()
    monkeypatch.setattr(ShardEngine, "add_block", lambda self, episodes, schema=None: None)
    assert blocked == run()


@pytest.mark.parametrize("sampler", [lambda: ab.SequenceSampler(3, strict=True), lambda: ab.PrioritizedSampler(alpha=0.6)],
                         ids=["sequence", "prioritized"])
def test_a_first_write_of_a_batch_binds_the_sampler_before_its_episodes_are_appended(sampler, monkeypatch):
    """A new store's first write as a batch: its sampler binds to the shard before the episodes go
    in, as for a single add (a strict sequence sampler's windows and a prioritized one's row map
    then count every episode), and holds what single adds give it."""
    writes = [(5, 6, True, None), (4, 6, True, None)]
    reference, _ = play(writes, 100, sampler(), blocks=False, monkeypatch=monkeypatch)
    blocked, _ = play(writes, 100, sampler())
    assert contents(blocked) == contents(reference)
    assert blocked.sampler.mass(blocked.engine.table) == reference.sampler.mass(reference.engine.table) > 0
    assert blocked.sample(16)["obs"].shape[:2] == reference.sample(16)["obs"].shape[:2]


def one_row_episodes(count: int) -> dict:
    """``count`` one-step episodes without final observations: a row each and no transition."""
    return {"obs": np.zeros((count, 1, 2), np.float32), "action": np.arange(count)[:, None],
            "reward": np.ones((count, 1), np.float32), "terminated": np.ones((count, 1), bool),
            "truncated": np.zeros((count, 1), bool)}


@pytest.mark.parametrize("count", [90, 200])
def test_a_batch_of_more_rows_than_the_arena_goes_one_by_one(count, monkeypatch):
    """A reviewer's case: E one-row episodes (no transition, so no eviction by count) past the
    arena's 89 rows were placed as one run beyond the arena's end (a wrong table, then heap
    corruption); they go one by one, as single adds place them."""
    def run() -> tuple:
        store = ab.ExperienceStore(capacity=10, seed=0)
        store.add_episodes(one_row_episodes(count), observations=["obs"])
        return store.engine.shard.rows, store.num_episodes, store.to_arrow().to_pydict()

    blocked = run()
    monkeypatch.setattr(ShardEngine, "add_block", lambda self, episodes, schema=None: None)
    assert blocked == run() and blocked[1] <= blocked[0] == 89


def test_a_first_batch_the_block_declines_makes_one_arena(monkeypatch):
    """A first write that add_block declines (a torch arena always does) took a second arena: the one
    it made stayed alive beside the one the single adds made (a CUDA arena is allocated at once)."""
    made = []
    make = ShardEngine._make_shard
    monkeypatch.setattr(ShardEngine, "_make_shard", lambda self, schema: made.append(make(self, schema)) or made[-1])
    store = ab.ExperienceStore(capacity=100, seed=0, storage_device="cpu")
    rng = np.random.default_rng(0)
    store.add_episodes(batch(rng, 4, 5, True, 0))
    assert len({id(shard) for shard in made}) == 1 and store.num_episodes == 4


@pytest.mark.parametrize("final", [True, False])
def test_a_store_of_exactly_num_envs_x_t_takes_each_rollout_as_one_block_and_holds_only_it(final, monkeypatch):
    """The size a rollout user picks: E x T transitions, one add_episodes of E episodes a rollout, no
    clear(). Each rollout goes in as one block (it evicts the whole rollout before it, by count), the
    store holds that rollout and nothing else, ids and indices go on counting, and the ring keeps
    the rows of one rollout (its final observations included): no slack grows."""
    import arrowbuf.block_add as block_add

    took = []
    add = block_add.add_block
    monkeypatch.setattr("arrowbuf.engine.add_block", lambda *a, **kw: took.append(add(*a, **kw)) or took[-1])
    E, T = 64, 32
    store = ab.ExperienceStore(capacity=E * T, seed=0)
    rings = set()
    for k in range(4):
        data = {"obs": np.full((E, T + int(final), 2), k, np.float32), "action": np.tile(np.arange(T), (E, 1)),
                "reward": np.ones((E, T), np.float32), "terminated": np.zeros((E, T), bool),
                "truncated": np.ones((E, T), bool)}
        assert store.add_episodes(data) == list(range(k * E, (k + 1) * E))
        assert len(store) == E * T and store.num_episodes == E and took[-1] is not None
        held = store.gather(np.arange(*store.engine.live_range()))
        assert (held["obs"][:, 0] == k).all() and (held["action"].bincount(minlength=T) == E).all()
        rings.add(store.engine.shard.ring)
    assert rings == {E * (T + int(final))}
