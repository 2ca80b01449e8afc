"""n-step returns, frame stacks and index lookups at sample time, against slow or plain references."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import arrowbuf as ab
from arrowbuf.indexing import frame_rows, n_step, piece_chains, run_lookup
from arrowbuf.placement import arena_rows
from arrowbuf.table import EpisodeTable

from support.episodes import LiveTable, add_tagged, check_batch_reads_its_rows, episode_schema

# float32 rewards, the common case: n-step returns are summed and returned in the reward's dtype.
SCHEMA = episode_schema(reward_dtype="float32")


def add(store, recorded, steps, **kwargs):
    return add_tagged(store, recorded, steps, reward_dtype="float32", **kwargs)


def reference(recorded, episode_id, step, n, gamma, frames, first_held):
    """n-step targets and frame stacks computed one transition at a time from what was written;
    a frame stack repeats the earliest step still held (``first_held``: 0, or later once the
    oldest transitions of the episode were evicted)."""
    out = {"reward": [], "discount": [], "n_steps": [], "terminated": [], "truncated": [], "obs": [],
           "next_obs": []}
    for e, t, f in zip(episode_id.reshape(-1).tolist(), step.reshape(-1).tolist(), first_held.reshape(-1).tolist()):
        written = recorded[e].arrays
        k = min(n, recorded[e].length - t)
        out["reward"].append(sum(gamma ** i * float(written["reward"][t + i]) for i in range(k)))
        out["discount"].append(gamma ** k)
        out["n_steps"].append(k)
        out["terminated"].append(bool(written["terminated"][t + k - 1]))
        out["truncated"].append(bool(written["truncated"][t + k - 1]))
        out["obs"].append([written["obs"][max(t - frames + 1 + j, f)] for j in range(frames)])
        out["next_obs"].append([written["obs"][max(t + k - frames + 1 + j, f)] for j in range(frames)])
    shape = episode_id.shape
    result = {key: np.array(value).reshape(shape + np.array(value).shape[1:]) for key, value in out.items()}
    if frames == 1:
        result["obs"], result["next_obs"] = result["obs"][..., 0, :], result["next_obs"][..., 0, :]
    return result


def check_against_reference(batch, recorded, n, gamma, frames, live):
    episode_id = batch["episode_id"].numpy()
    step = batch["step"].numpy().astype(np.int64)
    first_held = live.first_step[live.position(episode_id.reshape(-1))].reshape(episode_id.shape)
    expected = reference(recorded, episode_id, step, n, gamma, frames, first_held)
    np.testing.assert_allclose(batch["reward"].numpy(), expected["reward"], rtol=1e-6)
    assert batch["reward"].dtype == SCHEMA.fields["reward"].torch_dtype
    np.testing.assert_array_equal(batch["terminated"].numpy(), expected["terminated"])
    np.testing.assert_array_equal(batch["truncated"].numpy(), expected["truncated"])
    np.testing.assert_array_equal(batch["obs"].numpy(), expected["obs"])
    np.testing.assert_array_equal(batch["next", "obs"].numpy(), expected["next_obs"])
    if n > 1:
        np.testing.assert_allclose(batch["discount"].numpy(), expected["discount"], rtol=1e-6)
        np.testing.assert_array_equal(batch["n_steps"].numpy(), expected["n_steps"])


@st.composite
def histories(draw):
    episodes = draw(st.lists(st.tuples(st.integers(1, 9), st.booleans()), min_size=1, max_size=6))
    capacity = draw(st.integers(max(s + 1 for s, _ in episodes), 36))
    return capacity, episodes


SAMPLERS = {
    "uniform": lambda: ab.UniformSampler(),
    "prioritized": lambda: ab.PrioritizedSampler(alpha=0.6, beta=0.4),
    "loose_sequence": lambda: ab.SequenceSampler(seq_len=3, strict=False),
}


def replay_and_check(sampler, capacity, episodes, n, gamma, frames, seed):
    store = ab.ExperienceStore(capacity=capacity, sampler=sampler, seed=seed, schema=SCHEMA)
    recorded = {}
    rows = transitions = k = 0
    # Write until 2.5 laps of the capacity (transitions) evict, or of the arena's rows for
    # episodes that hold no transition (one step, no final observation).
    while transitions < 2.5 * capacity and rows < 2.5 * arena_rows(capacity):
        steps, has_final = episodes[k % len(episodes)]
        add(store, recorded, steps, has_final=has_final, terminated=k % 3 != 0)
        rows += steps + has_final
        transitions += steps - (not has_final)
        k += 1
        if len(store):
            batch = store.sample(16, n_step=n, gamma=gamma, frame_stack=frames)
            live = LiveTable(store)
            live.check_live(batch["episode_id"].numpy(), batch["step"].numpy(), batch["index"].numpy())
            check_against_reference(batch, recorded, n, gamma, frames, live)
    assert store.episodes()["episode_id"][0].as_py() > 0


@settings(max_examples=40, deadline=None)
@given(history=histories(), kind=st.sampled_from(sorted(SAMPLERS)), n=st.integers(1, 5),
       gamma=st.sampled_from([0.0, 0.5, 0.9, 1.0]), seed=st.integers(0, 2**16))
def test_n_step_targets_equal_a_plain_python_reference_while_the_ring_wraps(history, kind, n, gamma, seed):
    capacity, episodes = history
    replay_and_check(SAMPLERS[kind](), capacity, episodes, n, gamma, 1, seed)


@settings(max_examples=40, deadline=None)
@given(history=histories(), kind=st.sampled_from(sorted(SAMPLERS)), frames=st.integers(2, 4),
       n=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_frame_stacks_repeat_the_first_frame_at_episode_start_also_for_next_obs(history, kind, frames, n, seed):
    capacity, episodes = history
    replay_and_check(SAMPLERS[kind](), capacity, episodes, n, 0.5, frames, seed)


def test_a_batch_with_one_step_lookahead_is_the_plain_transition():
    store = ab.ExperienceStore(capacity=50, seed=0, schema=SCHEMA)
    recorded = {}
    for steps in (3, 6, 2):
        add(store, recorded, steps)
    batch = store.sample(64, n_step=1, frame_stack=1)
    check_batch_reads_its_rows(batch, recorded, LiveTable(store))
    assert "discount" not in batch.keys() and "n_steps" not in batch.keys()


def test_n_step_stops_at_the_episode_end_and_takes_the_last_flags():
    store = ab.ExperienceStore(capacity=50, seed=0, schema=SCHEMA, sampler=ab.WithoutReplacementSampler())
    recorded = {}
    episode_id = add(store, recorded, 4, terminated=True)          # rewards 0.5, 0.75, 1, 1.25
    batch = store.sample(4, n_step=3, gamma=0.5)
    order = np.argsort(batch["step"].numpy())
    assert batch["reward"].numpy()[order].tolist() == [0.5 + 0.75 / 2 + 1 / 4, 0.75 + 1 / 2 + 1.25 / 4, 1 + 1.25 / 2,
                                                       1.25]
    assert batch["n_steps"].numpy()[order].tolist() == [3, 3, 2, 1]
    assert batch["discount"].numpy()[order].tolist() == [0.125, 0.125, 0.25, 0.5]
    assert batch["terminated"].numpy()[order].tolist() == [False, True, True, True]
    assert batch["next", "obs"].numpy()[order][:, 1].tolist() == [3, 4, 4, 4]
    assert (batch["episode_id"] == episode_id).all()


def test_frame_stack_of_the_first_steps_repeats_the_first_frame():
    store = ab.ExperienceStore(capacity=50, seed=0, schema=SCHEMA, sampler=ab.WithoutReplacementSampler())
    add(store, {}, 3)
    batch = store.sample(3, frame_stack=3)
    order = np.argsort(batch["step"].numpy())
    assert batch["obs"].shape == (3, 3, 2) and batch["next", "obs"].shape == (3, 3, 2)
    assert batch["obs"].numpy()[order][..., 1].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 2]]
    assert batch["next", "obs"].numpy()[order][..., 1].tolist() == [[0, 0, 1], [0, 1, 2], [1, 2, 3]]


def test_n_step_function_sums_discounted_rewards_up_to_the_episode_end():
    reward = np.array([1.0, 2.0, 4.0, 8.0, 16.0, 32.0], np.float32)
    rows = np.array([0, 2, 3, 5])
    last = np.array([3, 3, 3, 5])                      # rows 0..3 are one episode, row 5 another
    ahead = n_step(rows, last, reward, 2, 0.5)
    assert ahead.reward.tolist() == [2.0, 8.0, 8.0, 32.0]
    assert ahead.reward.dtype == np.float32
    assert ahead.steps.tolist() == [2, 2, 1, 1]
    assert ahead.next_rows.tolist() == [2, 4, 4, 6]
    assert ahead.last_rows.tolist() == [1, 3, 3, 5]
    assert ahead.discount.tolist() == [0.25, 0.25, 0.5, 0.5]


def test_integer_rewards_give_float32_n_step_returns():
    ahead = n_step(np.array([0]), np.array([2]), np.array([1, 1, 1], np.int64), 3, 0.5)
    assert ahead.reward.dtype == np.float32 and ahead.reward.tolist() == [1.75]


def test_frame_rows_are_oldest_first_and_clamped_to_the_episode_start():
    rows = np.array([[10, 11], [12, 13]])
    first = np.array([[10, 10], [12, 12]])
    assert frame_rows(rows, first, 3).tolist() == [[[10, 10, 10], [10, 10, 11]], [[12, 12, 12], [12, 12, 13]]]


@pytest.mark.parametrize("kwargs, match", [
    ({"n_step": 0}, r"n_step must be an int >= 1, got 0"),
    ({"frame_stack": 0}, r"frame_stack must be an int >= 1, got 0"),
    ({"gamma": 1.5}, r"gamma must be a number in \[0, 1\], got 1\.5"),
    ({"gamma": -0.1}, r"gamma must be a number in \[0, 1\], got -0\.1"),
])
def test_bad_lookahead_arguments_are_refused_naming_them(kwargs, match):
    store = ab.ExperienceStore(capacity=50, seed=0, schema=SCHEMA)
    add(store, {}, 3)
    with pytest.raises(ValueError, match=match):
        store.sample(4, **kwargs)


def test_n_step_needs_a_reward_field():
    store = ab.ExperienceStore(capacity=50, seed=0, schema={"obs": ab.Field("float64", (2,), True), "action": "float64"})
    store.add_episode({"obs": np.zeros((4, 2)), "action": np.zeros(3)})
    with pytest.raises(ValueError, match=r"n_step > 1 needs a 'reward' field.*\['obs', 'action'\]"):
        store.sample(4, n_step=3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=40), st.integers(0, 2**40), st.integers(0, 2**32 - 1))
def test_a_run_lookup_finds_the_run_a_binary_search_finds(lengths, start, seed):
    first = start + np.cumsum([0] + lengths[:-1]).astype(np.int64)
    stop = start + sum(lengths)
    lookup = run_lookup(first, stop, stop - start)   # a bucket per unit at most: always built
    assert lookup is not None
    units = np.random.default_rng(seed).integers(start, stop, 500)
    units[:2] = start, stop - 1   # both ends
    expected = np.searchsorted(first, units, side="right") - 1
    np.testing.assert_array_equal(lookup(units), expected)
    assert lookup.bucket.size <= 2 * sum(lengths) // min(lengths[:-1] or [sum(lengths)]) + 1


def test_a_run_lookup_declines_empty_runs_and_too_many_buckets():
    assert run_lookup(np.array([0, 5, 5, 9]), 12, 100) is None     # an episode without transitions
    assert run_lookup(np.array([0, 1, 1000]), 2000, 100) is None    # one short run: 2,000 buckets of 1
    assert run_lookup(np.array([], np.int64), 0, 100) is None
    assert run_lookup(np.array([0, 1, 1000]), 2000, 4000) is not None


def test_piece_chains_link_only_live_contiguous_pieces_of_one_env_added_before():
    table = EpisodeTable()
    first = dict(num_rows=4, length=3, has_final=True, terminated=False, truncated=False, ret=0.0)
    table.append(first_row=0, env_id="a", first_step=0, **first)                  # serial 0
    table.append(first_row=4, env_id="a", first_step=3, prev_piece=0, **first)    # 1: continues 0
    table.append(first_row=8, env_id="b", first_step=6, prev_piece=1, **first)    # 2: another env
    table.append(first_row=12, env_id="a", first_step=7, prev_piece=1, **first)   # 3: steps 6 missing
    table.append(first_row=16, env_id="a", first_step=3, prev_piece=5, **first)   # 4: a serial not added yet
    table.append(first_row=20, env_id="a", first_step=6, prev_piece=1, **first)   # 5: continues 1
    chains = piece_chains(table)
    assert chains.prev.tolist() == [-1, 0, -1, -1, -1, 1]
    assert chains.next.tolist() == [1, 5, -1, -1, -1, -1]
    # Steps 0..8 of env a's episode, from piece 1: rows across pieces 0, 1 and 5, clamped at both ends.
    rows, pos = chains.locate(np.array([1]), np.arange(-1, 11))
    assert rows.tolist() == [0, 0, 1, 2, 4, 5, 6, 20, 21, 22, 23, 23]
    assert pos.tolist() == [0, 0, 0, 0, 1, 1, 1, 5, 5, 5, 5, 5]
    table.pop_oldest(1)   # piece 0 evicted: piece 1 is the earliest held
    chains = piece_chains(table)
    assert chains.prev.tolist() == [-1, -1, -1, -1, 0]
    assert chains.frames(np.array([0]), np.array([4]), 4).tolist() == [[4, 4, 4, 5]]


@st.composite
def chains(draw):
    """A `PieceChains` of random pieces: episodes cut into runs of steps, some links missing (gaps)."""
    from arrowbuf.indexing import PieceChains

    lengths = draw(st.lists(st.integers(0, 6), min_size=1, max_size=12))
    linked = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    first_row = np.cumsum([0] + [n + 1 for n in lengths[:-1]]).astype(np.int64)
    first_step, prev = np.zeros(len(lengths), np.int64), np.full(len(lengths), -1, np.int64)
    for i in range(1, len(lengths)):
        if linked[i]:
            first_step[i], prev[i] = first_step[i - 1] + lengths[i - 1], i - 1
    nxt = np.full(len(lengths), -1, np.int64)
    nxt[prev[prev >= 0]] = np.flatnonzero(prev >= 0)
    return PieceChains(first_row, first_step, np.array(lengths, np.int64), prev, nxt)


def walk(chain, at: int, s: int) -> tuple[int, int]:
    """(entry, row) of episode step ``s`` from entry ``at``: one piece at a time, back or ahead
    while a link goes on, then clamped to the entry's steps (its final observation included)."""
    while True:
        if s < chain.first_step[at] and chain.prev[at] >= 0:
            at = int(chain.prev[at])
        elif s >= chain.first_step[at] + chain.length[at] and chain.next[at] >= 0:
            at = int(chain.next[at])
        else:
            break
    clamped = min(max(s, chain.first_step[at]), chain.first_step[at] + chain.length[at])
    return at, int(chain.first_row[at] + clamped - chain.first_step[at])


@settings(max_examples=200, deadline=None)
@given(chain=chains(), seed=st.integers(0, 2**32 - 1), width=st.integers(1, 4), n=st.integers(1, 9))
def test_piece_chains_read_n_steps_and_frames_as_a_walk_along_the_chain_one_element_at_a_time(
        chain, seed, width, n):
    rng = np.random.default_rng(seed)
    count = len(chain.first_row)
    pos = rng.integers(0, count, size=(8, 1))
    steps = chain.first_step[pos] + rng.integers(-8, 14, size=(8, width))
    rows, where = chain.locate(pos, steps)
    for k in range(8):
        for j in range(width):
            assert (where[k, j], rows[k, j]) == walk(chain, int(pos[k, 0]), int(steps[k, j]))
    held = np.flatnonzero(chain.length > 0)
    if not len(held):
        return
    at = rng.choice(held, size=8)
    step = chain.first_step[at] + rng.integers(0, chain.length[at])   # transitions of each entry
    reward = rng.normal(size=int(chain.first_row[-1] + chain.length[-1] + 1)).astype(np.float32)
    ahead = chain.n_step(at, step, reward, n, 0.5)
    stacked = chain.frames(at, step, width)
    for i, (a, t) in enumerate(zip(at.tolist(), step.tolist())):
        _, target = walk(chain, a, t + n)
        end, _ = walk(chain, a, t + n)
        k = int(chain.first_step[end] + target - chain.first_row[end] - t)
        window = [walk(chain, a, t + m)[1] for m in range(k)]
        assert (ahead.steps[i], ahead.next_rows[i], ahead.last_rows[i]) == (k, target, window[-1])
        assert ahead.reward[i] == pytest.approx(sum(0.5 ** m * reward[r] for m, r in enumerate(window)), abs=1e-5)
        assert stacked[i].tolist() == [walk(chain, a, t - b)[1] for b in range(width - 1, -1, -1)]
