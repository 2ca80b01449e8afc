"""`UnfilledRows` (`arrowbuf.ray.lent`): episodes placed without their rows, filled before a read.

Pure: an engine and the episodes' own arrays stand for a shard actor and its writers' objects.
"""

from __future__ import annotations

import numpy as np

import arrowbuf as ab
from arrowbuf.engine import ShardEngine
from arrowbuf.episode_read import read_episode
from arrowbuf.ray.lent import UnfilledRows
from support.episodes import EPISODE_SCHEMA, decode, make_episode


def placed(engine: ShardEngine, unfilled: UnfilledRows, tag: int, steps: int, lent: bool) -> int:
    """Add tagged episode ``tag``: lent (placed, its rows kept unfilled) or copied."""
    episode, schema = read_episode(make_episode(tag, steps), EPISODE_SCHEMA)
    with engine.lock:
        episode_id = engine.add(episode, schema, rows=not lent)
        if lent:
            unfilled.add(episode_id, episode)
    return episode_id


def tags_in_arena(engine: ShardEngine) -> list[int]:
    """The tag of every live episode, read from its rows in the arena (-1: not a tagged
    episode's rows, such as an arena row nothing wrote: uninitialized memory)."""
    tags = []
    for episode_id in engine.episodes().column("episode_id").to_pylist():
        obs = np.array(engine.episode(episode_id).column("obs").to_pylist())
        tag, step = obs[:, 0], obs[:, 1]
        tagged = (step == np.arange(len(obs))).all() and (tag == tag[0]).all() and tag[0] == round(tag[0])
        tags.append(int(decode(obs)[0][0]) if tagged else -1)
    return tags


def make_engine(capacity: int) -> ShardEngine:
    return ShardEngine(capacity, sampler=ab.UniformSampler(), rate_limiter=ab.RateLimiter(), seed=0,
                       schema=EPISODE_SCHEMA, whole_pieces=True)   # as a Ray shard's (lent rows are Ray's only)


def test_a_lent_episode_is_placed_without_its_rows_until_filled():
    engine, unfilled = make_engine(100), UnfilledRows()
    placed(engine, unfilled, 1, 20, lent=False)
    placed(engine, unfilled, 2, 20, lent=True)
    assert len(engine) == 40 and len(unfilled) == 1
    assert tags_in_arena(engine) == [1, -1]   # placed, counted, sampled from, but not in the arena
    assert unfilled.fill(engine) is engine and len(unfilled) == 0
    assert tags_in_arena(engine) == [1, 2]


def test_an_episode_evicted_before_it_is_filled_never_overwrites_the_rows_of_its_successor():
    # 20 transitions each in a shard of 50: the third evicts the first whole (lent, never filled).
    engine, unfilled = make_engine(50), UnfilledRows()
    placed(engine, unfilled, 1, 20, lent=True)
    placed(engine, unfilled, 2, 20, lent=True)
    placed(engine, unfilled, 3, 20, lent=False)
    unfilled.fill(engine)
    assert tags_in_arena(engine) == [2, 3]
    assert engine.sample(200)["obs"][:, 0].unique().tolist() == [2.0, 3.0]


def test_forgetting_the_evicted_episodes_keeps_the_live_ones():
    engine, unfilled = make_engine(50), UnfilledRows()
    for tag in (1, 2, 3):
        placed(engine, unfilled, tag, 20, lent=True)
    unfilled.forget_evicted(engine.table)
    assert len(unfilled) == 2   # episode 1 was evicted: its object may be freed
    unfilled.fill(engine)
    assert tags_in_arena(engine) == [2, 3]


def test_clear_leaves_nothing_to_fill():
    engine, unfilled = make_engine(100), UnfilledRows()
    placed(engine, unfilled, 1, 20, lent=True)
    engine.clear()
    unfilled.clear()
    placed(engine, unfilled, 2, 20, lent=False)
    unfilled.fill(engine)
    assert tags_in_arena(engine) == [2]
