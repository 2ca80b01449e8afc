"""A Ray reader's n-step returns, frame stacks and non-strict sequence windows run across an
episode's held pieces (`arrowbuf.ray.across`), exactly as a loop over the whole played episode
and as a local store given the same steps.

Episodes are cut into pieces by the quarter-shard rule and the delivery timer of a small ring
(`arrowbuf.piece_cutting`), sealed into small blocks, so that an episode's pieces lie in
several blocks, and the ring evicts the oldest pieces. Two Ray stores serve most tests (one
draws transitions, one windows: a store has one sampler), each filled once per module; a
durable one (restarts), one with text and ragged fields and one whose shards draw (PER) have
a test each.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import arrowbuf as ab

pytestmark = pytest.mark.usefixtures("ray_session")

ENVS, STEPS = 3, 300
N, GAMMA, FRAMES, SEQ = 4, 0.9, 3, 6
PATIENCE = 60.0   # seconds a poll waits: a bound on a hang, not a timing claim


class Played:
    """Every env's ``STEPS`` steps, played once (seeded): each step's obs (env, episode, step),
    reward and flags, and the episodes they make, whole (`played`)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        lengths = [rng.integers(12, 140, size=64) for _ in range(ENVS)]
        truncates = [rng.random(64) < 0.3 for _ in range(ENVS)]
        rewards = rng.normal(size=(ENVS, STEPS)).astype(np.float32)
        self.steps = []   # (obs, reward, terminated, truncated) of every env, step by step
        self.episodes: dict[tuple[int, int], dict] = {}
        ep, t = np.zeros(ENVS, np.int64), np.zeros(ENVS, np.int64)
        for i in range(STEPS):
            end = np.array([t[e] == lengths[e][ep[e]] - 1 for e in range(ENVS)])
            trunc = end & np.array([truncates[e][ep[e]] for e in range(ENVS)])
            obs = np.stack([np.arange(ENVS), ep, t], axis=1).astype(np.float32)
            self.steps.append((obs, rewards[:, i], end & ~trunc, trunc))
            for e in range(ENVS):
                played = self.episodes.setdefault((e, int(ep[e])), {"reward": [], "terminated": [], "truncated": []})
                played["reward"].append(rewards[e, i])
                played["terminated"].append(bool(end[e] & ~trunc[e]))
                played["truncated"].append(bool(trunc[e]))
            t += 1
            ep[end] += 1
            t[end] = 0

    def write(self, store: ab.ExperienceStore, pause: int | None = None) -> None:
        """Every step into a writer of ``store`` (pausing every ``pause`` steps, so the delivery
        timer cuts pieces too), then ``flush``: each episode held whole or cut."""
        writer = store.writer(num_envs=ENVS, autoreset_mode="disabled", env_ids=[f"env-{e}" for e in range(ENVS)])
        for i, (obs, reward, terminated, truncated) in enumerate(self.steps):
            nxt = obs.copy()
            nxt[:, 2] += 1
            writer.add(obs=obs, action=np.arange(ENVS), reward=reward, terminated=terminated, truncated=truncated,
                       next_obs=nxt)
            if pause and i % pause == pause - 1:
                time.sleep(0.03)
        writer.flush()
        store.flush()
        writer.close()

    def played(self, env: int, episode: int) -> dict:
        return self.episodes[(env, episode)]


def expected(played: Played, env: int, episode: int, t: int, held: tuple[int, int], n: int = N,
             frames: int = FRAMES) -> dict:
    """A loop over the whole played episode: the n-step return of step t, its bootstrap step,
    its flags, and the frames of steps t and t + k, among the steps ``held`` ([first, end))."""
    p = played.played(env, episode)
    first, end = held
    k = min(n, end - t)
    reward = sum(GAMMA ** i * float(p["reward"][t + i]) for i in range(k))
    return {"n_steps": k, "reward": reward, "discount": GAMMA ** k, "next_t": t + k,
            "terminated": p["terminated"][t + k - 1], "truncated": p["truncated"][t + k - 1],
            "frames": [max(t - j, first) for j in range(frames - 1, -1, -1)],
            "next_frames": [max(t + k - j, first) for j in range(frames - 1, -1, -1)]}


def held_ranges(store: ab.ExperienceStore) -> dict[int, tuple[int, int]]:
    """[first held step, end) of each played episode, by episode id."""
    table = store.episodes(include_open=True).to_pydict()
    return {i: (f, f + n) for i, f, n in zip(table["episode_id"], table["first_step"], table["length"])}


def items(batch) -> list[dict]:
    """Every valid item of a batch (of windows: each step under ``mask``), as plain values."""
    flat = batch.reshape(-1) if batch.ndim > 1 else batch
    mask = flat["mask"].numpy() if "mask" in flat.keys() else np.ones(len(flat), bool)
    obs, nxt = flat["obs"].numpy(), flat["next", "obs"].numpy()   # [B, frames, 3]
    out = []
    for k in np.flatnonzero(mask).tolist():
        out.append({"env": int(obs[k, -1, 0]), "episode": int(obs[k, -1, 1]), "t": int(obs[k, -1, 2]),
                    "step": int(flat["step"][k]), "episode_id": int(flat["episode_id"][k]),
                    "n_steps": int(flat["n_steps"][k]), "reward": float(flat["reward"][k]),
                    "discount": float(flat["discount"][k]), "terminated": bool(flat["terminated"][k]),
                    "truncated": bool(flat["truncated"][k]),
                    "frames": obs[k, :, 2].astype(int).tolist(), "next_frames": nxt[k, :, 2].astype(int).tolist(),
                    "frame_envs": obs[k, :, :2].tolist(), "next_envs": nxt[k, :, :2].tolist()})
    return out


def check_item(item: dict, played: Played, held: tuple[int, int]) -> None:
    want = expected(played, item["env"], item["episode"], item["t"], held)
    assert item["step"] == item["t"]
    assert item["n_steps"] == want["n_steps"], (item, want, held)
    assert item["reward"] == pytest.approx(want["reward"], rel=1e-5, abs=1e-5), (item, want)
    assert item["discount"] == pytest.approx(want["discount"], rel=1e-6)
    assert (item["terminated"], item["truncated"]) == (want["terminated"], want["truncated"]), (item, want)
    assert item["frames"] == want["frames"], (item, want, held)
    assert item["next_frames"] == want["next_frames"], (item, want, held)
    assert item["next_frames"][-1] == want["next_t"]
    same = [[item["env"], item["episode"]]] * FRAMES   # every frame is of the item's own played episode
    assert item["frame_envs"] == same and item["next_envs"] == same


def local_values(store: ab.ExperienceStore, **args) -> dict[tuple[int, int, int], dict]:
    """Every step's values as a local store samples them, by (env, episode, step)."""
    found: dict[tuple[int, int, int], dict] = {}
    for _ in range(20):
        for item in items(store.sample(4096, n_step=N, gamma=GAMMA, frame_stack=FRAMES, **args)):
            found[(item["env"], item["episode"], item["t"])] = item
        if len(found) == len(store):
            return found
    raise AssertionError(f"local samples found {len(found)} of {len(store)} steps")


def check_against_local(item: dict, local: dict, held: tuple[int, int]) -> None:
    """The Ray item is the local store's (which holds every step): its n-step return, and its
    frames where its stack reads no step the Ray ring evicted."""
    mine = local[(item["env"], item["episode"], item["t"])]
    for name in ("n_steps", "discount", "terminated", "truncated", "step"):
        assert item[name] == mine[name], (name, item, mine)
    assert item["reward"] == pytest.approx(mine["reward"], rel=1e-6, abs=1e-6)
    if held[0] == 0:
        assert item["frames"] == mine["frames"] and item["next_frames"] == mine["next_frames"], (item, mine)


def piece_ends(store: ab.ExperienceStore) -> tuple[set, int]:
    """((episode id, step) where a held piece ends and the next held one begins, blocks) as the
    store's reader sees them: the setup's own check that episodes are cut and spread."""
    reader = store._backend._reader
    reader.sync()
    ends, blocks = set(), 0
    for view in reader.views.values():
        table, blocks = view.table, blocks + len(view.blocks)
        episode, first, length = table.col("episode"), table.col("first_step"), table.col("length")
        starts = set(zip(episode.tolist(), first.tolist()))
        ends |= {(e, f + n) for e, f, n in zip(episode.tolist(), first.tolist(), length.tolist())} & starts
    return ends, blocks


def ray_store(sampler: ab.Sampler, shards: int) -> ab.ExperienceStore:
    # A ring of 2 x 240 transitions (a quarter of a shard: 60 steps a piece at most) below the
    # 900 steps played; blocks of ~2 KiB, so pieces of one episode are sealed into several.
    return ab.ExperienceStore(480, backend="ray", num_shards=shards, seed=0, sampler=sampler,
                              ray_options=ab.RayOptions(block_bytes=2048, delivery_latency=0.02))


@pytest.fixture(scope="module")
def played() -> Played:
    return Played(seed=3)


def written(played: Played, sampler: ab.Sampler, num_shards: int, pause: int):
    """A Ray store of ``sampler`` holding the played steps (closed when the module's tests end)."""
    store = ray_store(sampler, num_shards)
    try:
        played.write(store, pause=pause)
        yield store
    finally:
        store.close()


@pytest.fixture(scope="module")
def uniform(played: Played):
    yield from written(played, ab.UniformSampler(), 2, pause=13)


@pytest.fixture(scope="module")
def windows(played: Played):
    yield from written(played, ab.SequenceSampler(seq_len=SEQ, strict=False), 1, pause=11)


@pytest.fixture(scope="module")
def local(played: Played) -> dict:
    """The local store's values of every step, given the same steps with room for all of them."""
    store = ab.ExperienceStore(2 * ENVS * STEPS, seed=0)
    played.write(store)
    return local_values(store)


def test_n_step_returns_and_frame_stacks_on_ray_run_across_an_episodes_pieces_as_over_the_played_episode(
        uniform, played, local):
    ends, blocks = piece_ends(uniform)
    assert len(ends) > 5 and blocks > 2, (ends, blocks)   # the setup cuts episodes and spreads them
    held = held_ranges(uniform)
    ids: dict[tuple[int, int], int] = {}
    crossed = padded = 0
    for _ in range(4):
        for item in items(uniform.sample(512, n_step=N, gamma=GAMMA, frame_stack=FRAMES)):
            span = held[item["episode_id"]]
            check_item(item, played, span)
            check_against_local(item, local, span)
            assert ids.setdefault((item["env"], item["episode"]), item["episode_id"]) == item["episode_id"]
            crossed += any((item["episode_id"], b) in ends for b in range(item["t"] + 1, item["t"] + N))
            padded += 0 < span[0] and item["t"] - FRAMES + 1 < span[0]   # a stack reaching an evicted piece
    assert crossed > 50 and padded, (crossed, padded)


def test_non_strict_windows_on_ray_go_on_into_an_episodes_next_pieces(windows, played, local):
    ends, blocks = piece_ends(windows)
    assert len(ends) > 5 and blocks > 2, (ends, blocks)
    held = held_ranges(windows)
    for args in ({}, {}, {"n_step": N, "gamma": GAMMA, "frame_stack": FRAMES}, {"n_step": N, "gamma": GAMMA,
                                                                              "frame_stack": FRAMES}):
        batch = windows.sample(128, **args)
        assert batch.shape == (128, SEQ)
        step = batch["step"].numpy()
        obs, nxt = batch["obs"].numpy(), batch["next", "obs"].numpy()
        if not args:   # each step's own row and next observation, the played ones
            assert (obs[..., 2] == step).all() and (nxt[..., 2] == step + 1).all()
            assert (obs[..., 1] == obs[:, :1, 1]).all() and (obs[..., 0] == obs[:, :1, 0]).all()
        first = batch["step"][:, 0].numpy()
        end = np.array([held[i][1] for i in batch["episode_id"][:, 0].tolist()])
        # A window goes on to its episode's last held step, across pieces; mask False only after it.
        assert (batch["mask"].numpy() == (first[:, None] + np.arange(SEQ) < end[:, None])).all()
        assert (batch["episode_id"] == batch["episode_id"][:, :1]).all()
        last = np.minimum(first[:, None] + np.arange(SEQ), end[:, None] - 1)
        assert (step == last).all()   # past the end: the last held step repeated
        if not args:
            continue
        for item in items(batch):
            check_item(item, played, held[item["episode_id"]])
            check_against_local(item, local, held[item["episode_id"]])


def test_an_episodes_later_piece_not_yet_sealed_reads_as_an_open_tail_does_locally(uniform):
    # Pieces reach a reader once sealed: until then, a look-up stops at the last step the
    # reader holds and bootstraps from the observation after it (n_steps < n), as a local
    # store's at an open tail's last written step.
    writer = uniform.writer(num_envs=1, autoreset_mode="disabled", env_ids=["open"])
    try:
        obs = np.array([[7, 0, 0]], np.float32)
        for t in range(12):   # one open episode, its steps shipped on the timer: several pieces
            nxt = obs.copy()
            nxt[0, 2] += 1
            writer.add(obs=obs, action=np.zeros(1, np.int64), reward=np.ones(1, np.float32),
                       terminated=np.zeros(1, bool), truncated=np.zeros(1, bool), next_obs=nxt)
            obs = nxt
            time.sleep(0.03)
        deadline = time.monotonic() + PATIENCE
        end = None
        while end != 12:   # until this reader holds the 12 steps (sealed, in its manifest)
            assert time.monotonic() < deadline, f"the reader held steps up to {end} of the 12 open steps"
            batch = uniform.sample(512, n_step=N, gamma=1.0, frame_stack=FRAMES)
            mine = batch["obs"][:, -1, 0].numpy() == 7
            t, k = batch["obs"][mine, -1, 2].numpy().astype(int), batch["n_steps"][mine].numpy()
            assert (batch["reward"][mine].numpy() == k).all()
            assert (batch["next", "obs"][mine, -1, 2].numpy() == t + k).all()
            assert not batch["terminated"][mine].any() and not batch["truncated"][mine].any()
            # Within what the reader holds, a return goes across pieces, and stops (k < n) only at
            # the last step it holds: every shorter one bootstraps from the same observation.
            stops = set((t + k)[k < N].tolist())
            assert len(stops) <= 1, (t, k)
            end = stops.pop() if stops else None
            if end is not None:
                assert (k == np.minimum(N, end - t)).all(), (t, k, end)
            assert (batch["obs"][mine, :, 2].numpy() == np.maximum(t[:, None] - np.arange(FRAMES - 1, -1, -1), 0)).all()
        assert uniform.episodes(include_open=True).to_pydict()["open"][-1] is True
    finally:
        writer.close()


def restart(store: ab.ExperienceStore, shard: int) -> None:
    """Kill a shard actor (Ray restarts it: a durable store's) and wait until calls reach the new process."""
    import os

    import ray

    handle = ray.get_actor(f"{store.name}:{shard}", namespace="arrowbuf")
    pid = lambda: ray.get(handle.__ray_call__.remote(lambda server: os.getpid()))   # noqa: E731
    old = pid()
    ray.kill(handle, no_restart=False)
    deadline = time.monotonic() + PATIENCE
    while pid() == old:
        assert time.monotonic() < deadline, "the killed shard did not restart"
        time.sleep(0.1)


def test_a_restarted_durable_shard_recovers_its_piece_links_from_its_log(tmp_path):
    # A restarted shard rebuilt its episodes from its log without the links between pieces:
    # each piece came back an episode of its own (its own id, counted in num_episodes).
    store = ab.ExperienceStore(1_000, backend="ray", num_shards=1, seed=0, durable=tmp_path,
                               ray_options=ab.RayOptions(delivery_latency=0.02))
    try:
        writer = store.writer(num_envs=2, autoreset_mode="disabled")

        def play(t: int, done: np.ndarray) -> None:
            obs = np.array([[0, 0, t], [1, 0, t]], np.float32)
            writer.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32), terminated=done,
                       truncated=np.zeros(2, bool), next_obs=obs + np.float32([0, 0, 1]))
            deadline = time.monotonic() + PATIENCE
            while writer.open_steps.sum():   # shipped before the next step: a piece per step
                assert time.monotonic() < deadline
                time.sleep(0.01)

        for t in range(6):   # env 0's episode ends at step 5, env 1's goes on: 6 pieces each
            play(t, np.array([t == 5, False]))
        store.flush()
        before = store.episodes(include_open=True).to_pydict()
        assert before["length"] == [6, 6] and before["open"] == [False, True] and store.num_episodes == 1
        store.save(tmp_path / "checkpoint")   # the durable shard's own checkpoint too: its log is compacted
        restart(store, 0)
        after = store.episodes(include_open=True).to_pydict()
        assert after == before and store.num_episodes == 1 and len(store) == 12
        batch = store.sample(256, n_step=3, gamma=1.0)
        t, k = batch["obs"][:, 2].numpy().astype(int), batch["n_steps"].numpy()
        assert (k == np.minimum(3, 6 - t)).all()                 # across the recovered pieces
        assert len(set(batch["episode_id"].tolist())) == 2
        for t in range(6, 9):   # env 1's episode goes on after the restart, and ends
            play(t, np.array([False, t == 8]))
        store.flush()
        table = store.episodes(include_open=True).to_pydict()
        ended = [i for i, env in enumerate(table["env_id"]) if env == "env-1"]
        assert [table["length"][i] for i in ended] == [9] and table["episode_id"][ended[0]] == before["episode_id"][1]
        assert store.num_episodes == 2 and table["open"] == [False, False, True]   # env 0 plays a new one
        assert table["env_id"][2] == "env-0" and table["length"][2] == 3
        writer.flush()   # every step shipped already: the shard is told env 0's episode ended
        restart(store, 0)   # from the checkpoint and the log after it
        table = store.episodes(include_open=True).to_pydict()
        assert table["length"] == [6, 9, 3] and not any(table["open"]) and store.num_episodes == 3
        writer.close()
    finally:
        store.close()


def test_text_and_ragged_fields_of_items_read_across_blocks_are_their_own_steps():
    # An item whose look-ups cross blocks is read from a block of its own rows: its text and
    # ragged fields (each block's dictionary and values of their own) come along, as its step's.
    schema = {"obs": ab.Field("float32", (2,), observation=True), "action": ab.Field("int64"),
              "reward": ab.Field("float32"), "terminated": ab.Field("bool"), "truncated": ab.Field("bool"),
              "note": ab.Field("string"), "tokens": ab.Field("int32", (None,))}
    store = ab.ExperienceStore(480, backend="ray", num_shards=1, seed=0, schema=schema,
                               ray_options=ab.RayOptions(block_bytes=2048, delivery_latency=0.02))
    try:
        writer = store.writer(num_envs=2, autoreset_mode="disabled")
        for t in range(150):
            obs = np.array([[0, t], [1, t]], np.float32)
            writer.add(obs=obs, action=np.zeros(2, np.int64), reward=np.ones(2, np.float32),
                       terminated=np.zeros(2, bool), truncated=np.zeros(2, bool), next_obs=obs + np.float32([0, 1]),
                       note=[f"e0-{t}", f"e1-{t}"], tokens=[np.arange(t % 5 + 1, dtype=np.int32),
                                                            np.arange(t % 3 + 1, dtype=np.int32)])
            if t % 9 == 8:
                time.sleep(0.03)
        writer.flush()
        store.flush()
        ends, blocks = piece_ends(store)
        assert len(ends) > 5 and blocks > 2, (ends, blocks)
        held = held_ranges(store)
        for _ in range(3):
            batch = store.sample(256, n_step=N, gamma=1.0, frame_stack=FRAMES)
            env, t = batch["obs"][:, -1].numpy().astype(int).T
            k = batch["n_steps"].numpy()
            end = np.array([held[i][1] for i in batch["episode_id"].tolist()])
            assert (k == np.minimum(N, end - t)).all() and (batch["next", "obs"][:, -1, 1].numpy() == t + k).all()
            assert list(batch["note"]) == [f"e{e}-{s}" for e, s in zip(env, t)]
            for tokens, e, s in zip(batch["tokens"].unbind(0), env, t):
                assert tokens.tolist() == list(range(s % (5 if e == 0 else 3) + 1))
        writer.close()
    finally:
        store.close()


def test_items_the_shards_draw_read_across_pieces_too(played):
    # Prioritized draws are made by the shards, answered with indices: the reader reads them
    # across pieces as its own draws (several parts, one per shard, shuffled together).
    store = ray_store(ab.PrioritizedSampler(), 2)
    try:
        played.write(store, pause=13)
        held = held_ranges(store)
        for _ in range(2):
            for item in items(store.sample(256, n_step=N, gamma=GAMMA, frame_stack=FRAMES)):
                check_item(item, played, held[item["episode_id"]])
    finally:
        store.close()
